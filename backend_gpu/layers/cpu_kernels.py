"""The engine's own CPU kernels (cpu_kernels.c), built with the machine's C compiler at
first use and loaded through ctypes.

A decode step multiplies a few rows by weights read from memory, and the BLAS
libraries' kernels for so few rows run well below the memory's rate on an AVX2 machine:
gpt-oss's 4 layers of 16 experts at 4 rows an expert cost MKL 23.8 ms a step and oneDNN
30.4 (at the 6 rows its packed path computed), where summing the weights' bytes costs
11.3; the kernel, which reads each block of weight rows once for every row of a run,
16.2 (PERF.md, "gpt-oss decode: a CPU kernel of the engine's own";
studies/cpu_kernels.py). Its uses:
- `expert_runs`: every run of a layer's projection in one call, over float32 experts in
  the blocked layout (`blocked`); `mxfp4_runs`: the same over MXFP4 experts kept packed,
  each block of rows decoded once;
- `linear`: plain rows, one of cpu_rows.py's forms, picked where the machine times it
  fastest;
- `decode_attention`: a decode group's attention read where the paged blocks lie.

Built as Triton builds its launchers: with `cc` (or $CC) at -O3 -march=native, once per
machine (the library is kept in the kvgate cache under a name made of the source, the
compiler, its flags and the CPU), written under a temporary name and renamed, so
concurrent processes each see a whole file. No compiler, a failed build or
KVGATE_CPU_KERNELS=0: `library()` is None and the callers keep their torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from backend_gpu.gguf_loader import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# past this many rows in a run (a prefill's), the BLAS's blocked GEMM is as fast or
# faster: 32 rows an expert the kernel 67 ms a step against MKL's 70, 128 rows 252 against 185
MAX_ROWS = 16
LANES = 8  # the kernel's vectors: the inner dimension is a multiple of this
BLOCK = 4  # weight rows the kernel reads at once, interleaved LANES columns at a time
# with OpenMP for more than one thread, without where the compiler has none
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"],
    ["-O3", "-march=native", "-shared", "-fPIC"],
    ["-O3", "-shared", "-fPIC"],
)
BUILD_TIMEOUT_S = 120


def _cpu() -> str:
    """The CPU's model and flags (-march=native builds for them)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _build(compiler: str, flags: list[str], path: str) -> bool:
    """Compiles the source into `path` with these flags: whether it worked (a cache that
    cannot be written counts as a failed build)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".so.partial")
        os.close(fd)
    except OSError as exc:
        log.debug("cpu kernels: no place to build in: %s", exc)
        return False
    try:
        done = subprocess.run(
            [compiler, *flags, "-o", partial, str(SOURCE), "-lm"],
            capture_output=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        if done.returncode:
            log.debug("cpu kernels: %s %s failed: %s", compiler, flags, done.stderr[-2000:])
            return False
        os.replace(partial, path)
        return True
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("cpu kernels: %s could not run: %s", compiler, exc)
        return False
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _declare(lib: ctypes.CDLL) -> None:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.kvgate_runs.restype = None
    lib.kvgate_runs.argtypes = [
        *[pointer, pointer, size, pointer, pointer, pointer, size, size],
        *[ctypes.c_int, ctypes.c_int],  # threads, blocked
    ]
    lib.kvgate_runs_mxfp4.restype = ctypes.c_int
    lib.kvgate_runs_mxfp4.argtypes = [
        pointer,
        pointer,
        size,
        *[pointer] * 4,
        size,
        size,
        ctypes.c_int,
    ]
    lib.kvgate_decode_attention.restype = ctypes.c_int
    lib.kvgate_decode_attention.argtypes = [
        *[pointer, pointer, size],  # q, rows, batch
        *[pointer, pointer, pointer, size, pointer, size],  # k, v, tables, per row, lens, bs
        *[size, size, size, size, pointer],  # heads, kv heads, d, window, sinks
        *[ctypes.c_float, ctypes.c_float, pointer, ctypes.c_int],  # scale, v_scale, out
    ]


@cache
def library() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None where it cannot be (see above)."""
    if os.environ.get("KVGATE_CPU_KERNELS", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if compiler is None:
        log.info("cpu kernels: no C compiler; the torch paths serve")
        return None
    source = SOURCE.read_bytes()
    for flags in FLAG_SETS:
        tag = hashlib.sha256(b"|".join([source, compiler.encode(), " ".join(flags).encode()]))
        tag.update(_cpu().encode())
        path = os.path.join(cache_root(), "cpu_kernels", f"{tag.hexdigest()[:16]}.so")
        if os.path.exists(path) or _build(compiler, flags, path):
            try:
                lib = ctypes.CDLL(path)
            except OSError as exc:
                log.info("cpu kernels: %s did not load: %s", path, exc)
                continue
            _declare(lib)
            return lib
    log.info("cpu kernels: the build failed; the torch paths serve")
    return None


def usable(weight: torch.Tensor | None, scale: torch.Tensor | None = None) -> bool:
    """Whether the kernel can multiply by this stacked [experts, out, in] weight: float32
    on the CPU, contiguous, unscaled, `in` a multiple of LANES, the library built."""
    return (
        weight is not None
        and scale is None
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and weight.shape[-1] % LANES == 0
        and library() is not None
    )


def blocked(stacked: torch.Tensor) -> torch.Tensor:
    """A stacked [experts, out, in] weight (`usable`) in the kernel's layout, same shape:
    each whole block of BLOCK rows as [in / LANES, BLOCK, LANES], so that the kernel
    reads a block as one stream, the rows past the last whole block as they are."""
    experts, rows, cols = stacked.shape
    whole = rows // BLOCK * BLOCK
    out = torch.empty_like(stacked)
    blocks = stacked[:, :whole].reshape(experts, whole // BLOCK, BLOCK, cols // LANES, LANES)
    out[:, :whole] = blocks.transpose(2, 3).reshape(experts, whole, cols)
    out[:, whole:] = stacked[:, whole:]
    return out


def rows_of(weight: torch.Tensor) -> torch.Tensor:
    """One expert's [out, in] matrix in the kernel's layout back as rows (a copy), for a
    product the BLAS serves."""
    rows, cols = weight.shape
    whole = rows // BLOCK * BLOCK
    out = torch.empty_like(weight)
    blocks = weight[:whole].reshape(whole // BLOCK, cols // LANES, BLOCK, LANES)
    out[:whole] = blocks.transpose(1, 2).reshape(whole, cols)
    out[whole:] = weight[whole:]
    return out


def expert_runs(
    rows: torch.Tensor, runs: list[int], weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """[rows, out]: each run of `rows` ([rows, in], float32; runs[e] rows of expert e, in
    order) times expert e's weight ([experts, out, in], `usable`, `blocked`) plus its
    bias ([experts, out] or None), on torch's thread count."""
    experts, out_features, in_features = weight.shape
    assert len(runs) == experts and rows.shape == (sum(runs), in_features), (rows.shape, runs)
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.shape == (experts, out_features)
    return _runs(rows, runs, weight, bias, blocked=True)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear(x [rows, in], weight [out, in] as it is, bias) through the kernel: a form
    of cpu_rows.py's, which the machine's timing picks where it is the fastest (on this
    round's AVX2 machine a 4096 x 512 weight at 1 row 986 us against F.linear's 1464, at 4
    rows 1245 against oneDNN's 1615); F.linear where the kernel cannot take them."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or (bias is not None and bias.dtype != torch.float32)
        or weight.shape[1] % LANES
        or not weight.is_contiguous()
        or library() is None
    ):
        return F.linear(x, weight, bias)
    return _runs(x, [x.shape[0]], weight[None], None if bias is None else bias[None], False)


def _runs(rows, runs: list[int], weight, bias, blocked: bool) -> torch.Tensor:
    """kvgate_runs over checked operands: the weight `blocked` or plain rows."""
    experts, out_features, in_features = weight.shape
    rows = rows.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = rows.new_empty(rows.shape[0], out_features)
    library().kvgate_runs(
        rows.data_ptr(),
        (ctypes.c_int64 * experts)(*runs),
        experts,
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out_features,
        in_features,
        torch.get_num_threads(),
        int(blocked),
    )
    return out


def mxfp4_runs(
    rows: torch.Tensor,
    runs: list[int],
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """expert_runs over MXFP4 experts kept packed (blocks uint8 [experts, out, groups,
    16], scales uint8 [experts, out, groups]; quantization/mxfp4.py), each block of weight
    rows decoded once for every row of its run; None where the kernel cannot serve (not
    float32 rows on the CPU, no library): the caller widens the experts then."""
    experts, out_features, groups = scales.shape
    if (
        rows.device.type != "cpu"
        or rows.dtype != torch.float32
        or (bias is not None and bias.dtype != torch.float32)
        or blocks.dtype != torch.uint8
        or library() is None
    ):
        return None
    rows = rows.contiguous()
    assert len(runs) == experts and rows.shape == (sum(runs), groups * 32), (rows.shape, runs)
    blocks, scales = blocks.contiguous(), scales.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = rows.new_empty(rows.shape[0], out_features)
    failed = library().kvgate_runs_mxfp4(
        rows.data_ptr(),
        (ctypes.c_int64 * experts)(*runs),
        experts,
        blocks.data_ptr(),
        scales.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out_features,
        groups * 32,
        torch.get_num_threads(),
    )
    return None if failed else out


# the kernel's accumulator holds a head of at most this many values
MAX_HEAD_DIM = 512


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    window: int | None,
    sinks: torch.Tensor | None,
    scale: float,
    v_scale: float,
    out: torch.Tensor,
) -> bool:
    """out[rows[b]] = attention of q[rows[b]] ([T, H, D]) over the first lens[b] keys of
    sequence b (the last `window`), read from the paged caches ([slots, Hkv, D]) through
    tables [B, blocks] (cpu_kernels.c, kvgate_decode_attention); `sinks` [H] or None.
    False, nothing done, where the kernel cannot serve (not float32 on the CPU, a head
    size it does not take, no library): the caller's torch path then."""
    dim = q.shape[-1]
    if (
        q.device.type != "cpu"
        or not q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.float32
        or dim % LANES
        or dim > MAX_HEAD_DIM
        or not out.is_contiguous()
        or library() is None
    ):
        return False
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    rows, lens = rows.to(torch.int64).contiguous(), lens.to(torch.int64).contiguous()
    tables = tables.to(torch.int64).reshape(rows.shape[0], -1).contiguous()
    if sinks is not None:
        sinks = sinks.float().contiguous()
    failed = library().kvgate_decode_attention(
        q.data_ptr(),
        rows.data_ptr(),
        rows.shape[0],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        block_size,
        q.shape[1],
        k_cache.shape[1],
        dim,
        window or 0,
        None if sinks is None else sinks.data_ptr(),
        scale,
        v_scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return failed == 0
