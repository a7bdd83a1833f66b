"""The packed INT4/INT8 layout's reference: packing round-trips, and dequantize follows
the layout's definition value by value, with and without g_idx."""

from __future__ import annotations

import pytest
import torch

from backend_gpu.quantization.packed import PackedWeight, dequantize, pack_rows, unpack_rows


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_rows_round_trips_and_puts_the_first_row_lowest(bits):
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 2**bits, (64, 5), generator=gen, dtype=torch.int32)
    packed = pack_rows(q, bits)
    assert packed.shape == (64 * bits // 32, 5) and packed.dtype == torch.int32
    assert torch.equal(unpack_rows(packed, bits), q)
    word = int(packed[0, 0]) & 0xFFFFFFFF
    assert [(word >> (i * bits)) & (2**bits - 1) for i in range(32 // bits)] == q[
        : 32 // bits, 0
    ].tolist()


def test_pack_rows_refuses_a_partial_word():
    with pytest.raises(ValueError, match="whole 32-bit words"):
        pack_rows(torch.zeros(12, 3, dtype=torch.int32), 4)


@pytest.mark.parametrize(("bits", "act_order"), [(4, False), (4, True), (8, False)])
def test_dequantize_follows_the_definition(bits, act_order):
    gen = torch.Generator().manual_seed(1)
    k, n, group = 64, 6, 16
    q = torch.randint(0, 2**bits, (k, n), generator=gen, dtype=torch.int32)
    scales = torch.rand(k // group, n, generator=gen) + 0.1
    zeros = torch.randint(0, 2**bits, (k // group, n), generator=gen).to(torch.uint8)
    g_idx = torch.randperm(k, generator=gen).int() // group if act_order else None
    w = PackedWeight(pack_rows(q, bits), scales, zeros, g_idx, bits, group, k, n)
    out = dequantize(w, torch.float32)
    assert out.shape == (n, k)
    for row in range(k):
        g = int(g_idx[row]) if act_order else row // group
        for col in range(n):
            want = (int(q[row, col]) - int(zeros[g, col])) * float(scales[g, col])
            assert out[col, row].item() == pytest.approx(want, rel=1e-6)
    assert w.nbytes == k * n * bits // 8 + scales.nbytes + zeros.nbytes + (
        k * 4 if act_order else 0
    )
