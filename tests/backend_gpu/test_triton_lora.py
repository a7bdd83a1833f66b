"""The Triton LoRA kernels (backend_gpu/layers/triton_lora.py) against their torch
reference: ranks from 1 to 128, batches that mix slots unsorted, repeat them and leave
tokens without an adapter, token tiles and K splits past one, an output that is a column
slice of a wider tensor; then the GPU check's timing on a tiny shape.

Without CUDA they run in Triton's interpreter, which conftest.py turns on. Its tl.dot is
wrong on bfloat16 (triton-lang/triton#11584) and it truncates float32 to bfloat16 where a
GPU rounds to nearest, so bfloat16 tensors are checked here around a float32 dot (with
float32 adapters), to one bfloat16 step; bfloat16 dots and model sizes are in the CUDA
test."""

from __future__ import annotations

import json
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else interpreted (conftest)
pytest.importorskip("triton")

from backend_gpu.layers.triton_lora import (  # noqa: E402
    group_by_adapter,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
)
from studies import lora_kernels  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def slots_of(num_tokens: int, num_slots: int, seed: int) -> torch.Tensor:
    """Unsorted slots with repeats and -1s, every slot and -1 present at least once."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32)
    idx[: num_slots + 1] = torch.arange(-1, num_slots, dtype=torch.int32)
    return idx[torch.randperm(num_tokens, generator=gen)].to(DEVICE)


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_tokens_grouped_by_slot():
    idx = torch.tensor([2, -1, 0, 2, -1, 2, 0], dtype=torch.int32)
    groups = group_by_adapter(idx, 4)
    assert groups.order.tolist() == [1, 4, 2, 6, 0, 3, 5]  # -1s first, stable within a slot
    assert groups.counts.tolist() == [2, 0, 3, 0]
    assert groups.starts.tolist() == [2, 4, 4, 7]


# (tokens, K, rank, K splits): a decode-sized batch, a rank of 1, odd sizes, splits of
# K, the largest rank, and a batch over several 64-token tiles of one slot
SHRINK_CASES = [(5, 48, 8, 1), (9, 33, 1, 1), (23, 100, 20, 3), (12, 64, 128, 2), (150, 40, 16, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "k", "rank", "splits"), SHRINK_CASES)
def test_shrink_matches_reference(dtype, tokens, k, rank, splits):
    x = randn(tokens, k, dtype=dtype, seed=1)
    a = randn(3, rank, k, dtype=dtype, seed=2, scale=0.2)
    idx = slots_of(tokens, 3, seed=3)
    out = lora_shrink(x, a, idx, num_splits=splits)
    assert out.dtype == torch.float32 and out.shape == (tokens, rank)
    assert_close(out, lora_shrink_ref(x, a, idx), dtype)
    assert not out[idx < 0].any() and out[idx >= 0].abs().sum(1).all()


# (tokens, N, rank): a decode, N not a multiple of the 64-wide tile, small and large ranks
EXPAND_CASES = [(4, 64, 8), (11, 90, 1), (23, 70, 20), (9, 40, 128), (150, 30, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "n", "rank"), EXPAND_CASES)
def test_expand_into_a_column_slice_matches_reference(dtype, tokens, n, rank):
    wide = randn(tokens, n + 13, dtype=dtype, seed=4)
    before = wide.clone()
    y = wide[:, 5 : 5 + n]  # a strided view: its row stride is n + 13
    t = randn(tokens, rank, dtype=torch.float32, seed=5)
    b = randn(3, n, rank, dtype=dtype, seed=6, scale=0.2)
    scale = torch.tensor([0.5, 2.0, -1.0], device=DEVICE)
    idx = slots_of(tokens, 3, seed=7)
    want = y.clone()
    lora_expand_ref(want, t, b, idx, scale)
    lora_expand(y, t, b, idx, scale)
    assert_close(y, want, dtype)
    assert torch.equal(wide[idx < 0], before[idx < 0])  # rows without an adapter untouched
    assert torch.equal(wide[:, :5], before[:, :5]) and torch.equal(
        wide[:, 5 + n :], before[:, 5 + n :]
    )
    assert not torch.equal(wide[idx >= 0], before[idx >= 0])


def test_bfloat16_activations_with_float32_adapters():
    """bfloat16 loads and stores around a float32 dot (what the interpreter can check)."""
    tokens, k, n, rank = 13, 50, 70, 16
    x = randn(tokens, k, dtype=torch.bfloat16, seed=8)
    a = randn(4, rank, k, dtype=torch.float32, seed=9, scale=0.2)
    b = randn(4, n, rank, dtype=torch.float32, seed=10, scale=0.2)
    scale = torch.tensor([1.0, 0.25, 3.0, 0.5], device=DEVICE)
    idx = slots_of(tokens, 4, seed=11)
    t = lora_shrink(x, a, idx)
    assert_close(t, lora_shrink_ref(x, a, idx), torch.float32)
    y = randn(tokens, n, dtype=torch.bfloat16, seed=12)
    want = y.clone()
    lora_expand_ref(want, t, b, idx, scale)
    lora_expand(y, t, b, idx, scale)
    assert_close(y, want, torch.bfloat16)


def test_no_adapter_and_no_tokens():
    x = randn(6, 32, dtype=torch.float32, seed=13)
    a = randn(2, 8, 32, dtype=torch.float32, seed=14)
    b = randn(2, 24, 8, dtype=torch.float32, seed=15)
    none = torch.full((6,), -1, dtype=torch.int32, device=DEVICE)
    t = lora_shrink(x, a, none)
    assert t.shape == (6, 8) and not t.any()
    y = randn(6, 24, dtype=torch.float32, seed=16)
    before = y.clone()
    lora_expand(y, t + 1.0, b, none, torch.ones(2, device=DEVICE))
    assert torch.equal(y, before)
    empty = torch.empty(0, dtype=torch.int32, device=DEVICE)
    assert lora_shrink(x[:0], a, empty).shape == (0, 8)
    lora_expand(y[:0], t[:0], b, empty, torch.ones(2, device=DEVICE))


def test_gpu_check_timing_runs_on_a_tiny_shape(tmp_path):
    """studies/lora_kernels.py, the GPU check's LoRA timing, end to end on a tiny shape."""
    lora_kernels.main(["--out", str(tmp_path), "--shape", "tiny", "--device", DEVICE])
    result = json.loads((tmp_path / "lora_kernels.json").read_text())
    assert [r["tokens"] for r in result["runs"]] == list(lora_kernels.SHAPES["tiny"].tokens)
    for run in result["runs"]:
        assert run["matches_reference"]
        assert {"base", "base_kernels", "base_torch_loop"} <= set(run["seconds"])
        assert run["kernels_over_base"] == pytest.approx(
            run["seconds"]["base"] / run["seconds"]["base_kernels"]
        )


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [7, 2000])
def test_model_sizes_on_cuda(dtype, tokens):
    """A Llama-3-8B-sized projection (4096 in, 14336 out, into a slice of a fused
    output), a decode-sized batch and a prefill chunk, ranks 8 to 128, compiled (the
    interpreter is off whenever CUDA is there)."""
    assert not os.environ.get("TRITON_INTERPRET")
    k, n = 4096, 14336
    idx = slots_of(tokens, 5, seed=20)
    x = randn(tokens, k, dtype=dtype, seed=21)
    fused = randn(tokens, 2 * n, dtype=dtype, seed=22)
    scale = torch.tensor([0.5, 2.0, 1.0, 0.125, 4.0], device=DEVICE)
    for rank in (8, 64, 128):  # each a width of the kernels' rank tile
        a = randn(5, rank, k, dtype=dtype, seed=rank, scale=0.02)
        b = randn(5, n, rank, dtype=dtype, seed=rank + 1, scale=0.05)
        t = lora_shrink(x, a, idx)
        assert_close(t, lora_shrink_ref(x, a, idx), dtype)
        y = fused[:, n:]
        want = y.clone()
        lora_expand_ref(want, t, b, idx, scale)
        lora_expand(y, t, b, idx, scale)
        assert_close(y, want, dtype)
