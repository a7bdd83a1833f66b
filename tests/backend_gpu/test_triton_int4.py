"""The Triton INT4/INT8 matmul (backend_gpu/layers/triton_int4.py) against its torch
reference, x @ dequantize(w).T (backend_gpu/quantization/packed.py): 4 and 8 bits,
groups of 32, 64 and 128 and per-channel, symmetric and asymmetric zero points, GPTQ's
act order (g_idx shuffled), one to four rows (the GEMV shape) and more (the tl.dot tile,
several row tiles), K split over programs, sizes that fill no tile exactly.

Without CUDA they run in Triton's interpreter, which conftest.py turns on. Its tl.dot is
wrong on bfloat16 (triton-lang/triton#11584), so bfloat16 is checked on the GEMV shape
only, which has no tl.dot; bfloat16 dots and model sizes are in the CUDA test."""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else interpreted (conftest)
pytest.importorskip("triton")

from backend_gpu.layers.triton_int4 import int4_matmul  # noqa: E402
from backend_gpu.quantization.packed import PackedWeight, dequantize, pack_rows  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def packed_weight(
    k: int,
    n: int,
    bits: int,
    group_size: int,
    symmetric: bool = False,
    act_order: bool = False,
    scale_dtype: torch.dtype = torch.float16,
    seed: int = 0,
) -> PackedWeight:
    """Random integers, scales and zero points in the packed layout (group_size -1:
    per-channel); with act_order, the rows' groups in a shuffled order, as GPTQ's
    desc_act writes g_idx."""
    gen = torch.Generator().manual_seed(seed)
    group_size = k if group_size == -1 else group_size
    groups = -(-k // group_size)
    q = torch.randint(0, 2**bits, (k, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005).to(scale_dtype)
    if symmetric:
        zeros = torch.full((groups, n), 2 ** (bits - 1), dtype=torch.uint8)
    else:
        zeros = torch.randint(0, 2**bits, (groups, n), generator=gen).to(torch.uint8)
    g_idx = None
    if act_order:
        rows = torch.randperm(k, generator=gen)
        g_idx = (rows // group_size).to(torch.int32).to(DEVICE)
    return PackedWeight(
        qweight=pack_rows(q, bits).to(DEVICE),
        scales=scales.to(DEVICE),
        zeros=zeros.to(DEVICE),
        g_idx=g_idx,
        bits=bits,
        group_size=group_size,
        in_features=k,
        out_features=n,
    )


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)


def assert_matches_reference(x: torch.Tensor, w: PackedWeight, splits: int | None) -> None:
    got = int4_matmul(x, w, num_splits=splits)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.out_features)
    want = x.float() @ dequantize(w, x.dtype).float().T
    # relative to the outputs' size: an 8-bit weight's sums run to tens, and an output
    # near 0 is the difference of such sums
    tol = TOLERANCE[x.dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


# (K, N, bits, group size, symmetric, act order): every layout the readers produce, at
# sizes that leave partial column tiles (N not a multiple of 64) and, per-channel, a
# partial K tile
WEIGHTS = [
    (256, 96, 4, 128, True, False),
    (256, 72, 4, 32, False, False),
    (192, 80, 4, -1, False, False),
    (256, 64, 4, 32, False, True),
    (256, 40, 8, 64, False, False),
    (128, 72, 8, 32, True, True),
]
# (rows, K splits): the GEMV shape at 1 and 3 rows, then two 64-row tl.dot tiles
# (the 16-row tile is the test below's)
BATCHES = [(1, 1), (3, 3), (70, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "splits"), BATCHES)
@pytest.mark.parametrize(("k", "n", "bits", "group", "sym", "act_order"), WEIGHTS)
def test_matches_dequantize_then_matmul(dtype, rows, splits, k, n, bits, group, sym, act_order):
    w = packed_weight(k, n, bits, group, sym, act_order, seed=k + n + bits)
    assert_matches_reference(randn(rows, k, dtype=dtype, seed=rows), w, splits)


@pytest.mark.parametrize("rows", [1, 4])
def test_gemv_in_bfloat16_with_bfloat16_scales(rows):
    w = packed_weight(256, 72, 4, 128, scale_dtype=torch.bfloat16, seed=3)
    assert_matches_reference(randn(rows, 256, dtype=torch.bfloat16, seed=4), w, 2)


def test_rows_of_a_wider_tensor_and_no_rows():
    """x may be a row-strided view (a slice of a wider activation; 6 rows: a 16-row
    tl.dot tile); an empty batch is an empty result."""
    w = packed_weight(128, 64, 4, 32, seed=5)
    wide = randn(6, 384, dtype=torch.float32, seed=6)
    assert_matches_reference(wide[:, 128:256], w, 1)
    assert int4_matmul(wide[:0, :128], w).shape == (0, 64)


def test_a_weight_that_does_not_fit_x_is_refused():
    w = packed_weight(128, 64, 4, 32, seed=7)
    with pytest.raises(AssertionError, match="128"):
        int4_matmul(randn(2, 96, dtype=torch.float32, seed=8), w)


@functools.cache
def model_size_weight(bits: int, group: int, act_order: bool) -> PackedWeight:
    """A Llama-3-8B-sized projection (4096 in, 14336 out), made once per layout: packing
    its 59M integers on the CPU takes seconds."""
    return packed_weight(4096, 14336, bits, group, act_order=act_order, seed=9)


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("bits", "group", "act_order"), [(4, 128, False), (4, 128, True), (8, -1, False)]
)
def test_model_sizes_on_cuda(dtype, bits, group, act_order):
    """A model-sized projection, decode batches (the GEMV shape at 1 and 4 rows, a
    16-row tile, K split to fill the SMs) and a prefill chunk, compiled (the interpreter
    is off whenever CUDA is there); scales in the activations' dtype."""
    assert not os.environ.get("TRITON_INTERPRET")
    w = model_size_weight(bits, group, act_order)
    w = dataclasses.replace(w, scales=w.scales.to(dtype))
    for rows in (1, 4, 16, 300):
        assert_matches_reference(randn(rows, 4096, dtype=dtype, seed=rows), w, None)


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_packed_layer_runs_the_kernel_on_cuda():
    """PackedWeightLinear on CUDA (its forward calls int4_matmul) equals the layer's
    weight dequantized, then one matmul; a 3-D input keeps its leading dimensions."""
    from backend_gpu.layers.packed_weight_linear import PackedWeightLinear

    w = packed_weight(1024, 768, 4, 128, act_order=True, scale_dtype=torch.bfloat16, seed=11)
    layer = PackedWeightLinear(w, None, torch.bfloat16, {})
    x = randn(2, 3, 1024, dtype=torch.bfloat16, seed=12)
    got = layer(x)
    want = (x.float() @ dequantize(w, torch.bfloat16).float().T).to(torch.bfloat16)
    assert got.shape == (2, 3, 768)
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
