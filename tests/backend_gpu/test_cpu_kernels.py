"""The engine's CPU kernel (layers/cpu_kernels.py): built with the machine's compiler and
kept in the cache, its products equal torch's (every weight-row remainder, empty and
one-row runs, no bias, one and two threads), its blocked layout goes back to rows,
gpt-oss's float32 experts are held in that layout and take the kernel for decode-sized
runs and the BLAS for a prefill's, with the stacked path's outputs; where it cannot be
built or is switched off, nothing changes but the path."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

from backend_gpu.layers import cpu_kernels
from backend_gpu.layers.gpt_oss_moe import per_expert
from backend_gpu.quantization import mxfp4
from tests.backend_gpu.test_cpu_packed import HIDDEN, experts_of
from tests.backend_gpu.test_moe import routing

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler"
)


def reference(rows, runs, weight, bias):
    expert = torch.repeat_interleave(torch.arange(len(runs)), torch.tensor(runs))
    out = torch.einsum("rh,roh->ro", rows.double(), weight[expert].double())
    return (out if bias is None else out + bias[expert].double()).float()


@needs_compiler
@pytest.mark.parametrize("out_features", [1, 3, 4, 5, 13, 64])
@pytest.mark.parametrize("runs", [[1], [2, 0, 3], [0, 5, 1, 0], [17, 2]])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
def test_runs_equal_torch(out_features, runs, threads, bias):
    gen = torch.Generator().manual_seed(len(runs) * 100 + out_features)
    weight = torch.randn(len(runs), out_features, 24, generator=gen)
    biases = torch.randn(len(runs), out_features, generator=gen) if bias else None
    rows = torch.randn(sum(runs), 24, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_kernels.expert_runs(rows, runs, cpu_kernels.blocked(weight), biases)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, reference(rows, runs, weight, biases), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_features", [3, 4, 13])
def test_blocks_and_back(out_features):
    weight = torch.randn(2, out_features, 16)
    blocked = cpu_kernels.blocked(weight)
    if out_features >= cpu_kernels.BLOCK:  # a whole block's rows interleaved 8 at a time
        assert torch.equal(blocked[0].flatten()[8:16], weight[0, 1, :8])
    assert not torch.equal(blocked, weight) or out_features < cpu_kernels.BLOCK
    for e in range(2):
        assert torch.equal(cpu_kernels.rows_of(blocked[e]), weight[e])


@needs_compiler
def test_what_the_kernel_takes():
    weight = torch.randn(2, 8, 16)
    assert cpu_kernels.usable(weight)
    assert not cpu_kernels.usable(torch.randn(2, 8, 12))  # not a multiple of the lanes
    assert not cpu_kernels.usable(weight.half())
    assert not cpu_kernels.usable(weight.transpose(1, 2))  # not contiguous
    assert not cpu_kernels.usable(weight, torch.ones(2, 8))  # 8-bit's row scales
    assert not cpu_kernels.usable(None)


@needs_compiler
@pytest.mark.parametrize("tokens,skew", [(1, False), (3, False), (16, False), (40, True)])
@pytest.mark.parametrize("down_bias", [True, False])
def test_experts_take_the_kernel_with_the_stacked_outputs(tokens, skew, down_bias, monkeypatch):
    """40 skewed tokens: a run past MAX_ROWS, which the BLAS serves (no kernel call)."""
    experts = experts_of(torch.float32, down_bias)
    kernel = copy.deepcopy(experts)
    kernel.pack_for_cpu()
    assert kernel.kernel and kernel.packed is None
    for name in ("gate_up_proj", "down_proj"):  # in place, in the kernel's layout
        held, stacked = getattr(kernel, name), getattr(experts, name)
        assert all(torch.equal(cpu_kernels.rows_of(held[e]), stacked[e]) for e in range(8))
    calls = []
    real = cpu_kernels.expert_runs
    monkeypatch.setattr(cpu_kernels, "expert_runs", lambda *a: calls.append(a) or real(*a))
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(4))
    weights, ids = routing(tokens, 8, 4, skew)
    with torch.inference_mode():
        want = per_expert(experts, x, weights, ids)
        got = per_expert(kernel, x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    runs = torch.bincount(ids.flatten(), minlength=8)
    assert len(calls) == (0 if runs.max() > cpu_kernels.MAX_ROWS else 2)


@pytest.mark.parametrize("case", ["switched off", "no compiler", "unwritable cache"])
def test_switched_off_unbuildable_or_unwritable_the_torch_paths_serve(case, tmp_path, monkeypatch):
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    if case == "switched off":
        monkeypatch.setenv("KVGATE_CPU_KERNELS", "0")
    elif case == "no compiler":
        monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    else:
        (tmp_path / "cpu_kernels").write_text("a file where the cache's folder would be")
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
        experts = experts_of(torch.float32)
        experts.pack_for_cpu()
        assert not experts.kernel  # packed for oneDNN as before, or left stacked
        x = torch.randn(3, 16)
        torch.testing.assert_close(cpu_kernels.linear(x, torch.ones(4, 16)), x @ torch.ones(16, 4))
    finally:
        cpu_kernels.library.cache_clear()
    assert not list(tmp_path.glob("cpu_kernels/*.so*"))  # nothing built, nothing half-built


@needs_compiler
def test_built_once_a_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is not None
        (built,) = tmp_path.glob("cpu_kernels/*.so")
        stamp = os.stat(built).st_mtime_ns
        cpu_kernels.library.cache_clear()
        assert cpu_kernels.library() is not None  # loaded from the cache, not rebuilt
        assert os.stat(built).st_mtime_ns == stamp
        assert not list(tmp_path.glob("cpu_kernels/*.partial"))
    finally:
        cpu_kernels.library.cache_clear()


def attention_reference(q, k_cache, v_cache, rows, tables, lens, bs, window, sinks, scale):
    """Each sequence's query over its keys, gathered slot by slot, in float64."""
    out = torch.zeros_like(q, dtype=torch.float64)
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    for b, row in enumerate(rows.tolist()):
        length = int(lens[b])
        first = max(0, length - window) if window else 0
        slots = [int(tables[b, t // bs]) * bs + t % bs for t in range(first, length)]
        keys, values = k_cache[slots].double(), v_cache[slots].double()  # [L, Hkv, D]
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = keys[:, g] @ q[row, h].double() * scale
            if sinks is not None:
                scores = torch.cat([scores, sinks[h : h + 1].double()])
            probs = scores.softmax(0)[: len(slots)]
            out[row, h] = probs @ values[:, g]
    return out.float()


@needs_compiler
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_equals_the_reference(heads, kv_heads, window, with_sinks, threads):
    gen = torch.Generator().manual_seed(heads + (window or 0))
    bs, dim, blocks = 4, 16, 12
    k_cache = torch.randn(blocks * bs, kv_heads, dim, generator=gen)
    v_cache = torch.randn(blocks * bs, kv_heads, dim, generator=gen)
    lens = torch.tensor([9, 1, 12, 4])  # tables: 3 blocks a row, scattered
    tables = torch.randperm(blocks, generator=gen)[:12].view(4, 3)
    q = torch.randn(6, heads, dim, generator=gen)
    rows = torch.tensor([5, 0, 2, 3])  # row 1 and 4 are not decodes: left alone
    sinks = torch.randn(heads, generator=gen) if with_sinks else None
    out = torch.full_like(q, 7.0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        args = (rows, tables.flatten(), lens, bs, window, sinks, 0.25, 1.0, out)
        assert cpu_kernels.decode_attention(q, k_cache, v_cache, *args)
    finally:
        torch.set_num_threads(before)
    want = attention_reference(q, k_cache, v_cache, rows, tables, lens, bs, window, sinks, 0.25)
    torch.testing.assert_close(out[rows], want[rows], rtol=1e-5, atol=1e-5)
    assert (out[[1, 4]] == 7.0).all()


@needs_compiler
def test_decode_attention_declines_what_it_does_not_take():
    q, cache = torch.randn(2, 4, 16), torch.randn(8, 4, 16)
    common = (torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([3, 4]), 4, None, None)
    out = torch.empty_like(q)
    assert cpu_kernels.decode_attention(q, cache, cache, *common, 1.0, 1.0, out)
    for q2, c2 in ((q.half(), cache.half()), (q[..., :12], cache[..., :12])):
        out2 = torch.empty_like(q2)
        assert not cpu_kernels.decode_attention(q2, c2, c2, *common, 1.0, 1.0, out2)


@needs_compiler
@pytest.mark.parametrize("out_features", [3, 8, 13])
@pytest.mark.parametrize("runs", [[1], [2, 0, 3], [6, 1]])
@pytest.mark.parametrize("threads", [1, 2])
def test_mxfp4_runs_equal_the_widened_weights(out_features, runs, threads):
    """Every code under scales from 2^-9 to 2^2 (and -0): the decoded block is exactly
    mxfp4.dequantize's."""
    gen = torch.Generator().manual_seed(out_features + len(runs))
    experts, groups = len(runs), 2
    blocks = torch.randint(0, 256, (experts, out_features, groups, 16), generator=gen)
    blocks = blocks.to(torch.uint8)
    scales = torch.randint(118, 130, (experts, out_features, groups), generator=gen)
    scales = scales.to(torch.uint8)
    biases = torch.randn(experts, out_features, generator=gen)
    rows = torch.randn(sum(runs), groups * 32, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_kernels.mxfp4_runs(rows, runs, blocks, scales, biases)
    finally:
        torch.set_num_threads(before)
    weight = mxfp4.dequantize(blocks, scales, torch.float32)
    torch.testing.assert_close(got, reference(rows, runs, weight, biases), rtol=1e-5, atol=1e-5)
    assert cpu_kernels.mxfp4_runs(rows.double(), runs, blocks, scales, biases) is None
