"""The packed INT4/INT8 layout's reference: packing round-trips, and dequantize follows
the layout's definition value by value, with and without g_idx."""

from __future__ import annotations

import pytest
import torch

from backend_gpu.layers.packed_weight_linear import PackedEmbedding, PackedWeightLinear
from backend_gpu.quantization.packed import PackedWeight, dequantize, pack_rows, unpack_rows
from backend_gpu.quantization.packed_shards import cut_columns, cut_rows, join_columns, pad_columns

KERNEL_LAYOUT_READ = torch.backends.cpu.get_cpu_capability().startswith("AVX512")


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


def random_weight(k=128, n=48, group=32, bits=4, act_order=False, seed=2) -> PackedWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (k, n), generator=gen, dtype=torch.int32)
    scales = torch.rand(k // group, n, generator=gen) + 0.1
    zeros = torch.randint(0, 2**bits, (k // group, n), generator=gen).to(torch.uint8)
    g_idx = torch.randperm(k, generator=gen).int() // group if act_order else None
    return PackedWeight(pack_rows(q, bits), scales, zeros, g_idx, bits, group, k, n)


@pytest.mark.parametrize(
    ("start", "stop", "act_order"),
    [(0, 64, False), (64, 128, False), (40, 96, False), (32, 128, True), (0, 128, False)],
)
def test_a_row_cut_is_the_whole_weights_columns(start, stop, act_order):
    """Row-parallel ranks: whole groups, a group cut at the edge (explicit g_idx), and
    act-order (every group's scales, the rank's g_idx rows)."""
    w = random_weight(act_order=act_order)
    part = cut_rows(w, start, stop, "m")
    assert torch.equal(dequantize(part, torch.float32), dequantize(w, torch.float32)[:, start:stop])
    assert part.in_features == stop - start
    assert (part.g_idx is not None) == (act_order or start % 32 != 0)


def test_a_row_cut_inside_a_word_is_refused():
    with pytest.raises(ValueError, match="m: tensor parallelism cuts its inputs at 4..64"):
        cut_rows(random_weight(), 4, 64, "m")


def test_column_cuts_join_back_into_the_whole_weight():
    w = random_weight(act_order=True)
    parts = [cut_columns(w, 0, 16), cut_columns(w, 16, 48)]
    joined = join_columns(parts, ["a", "b"])
    assert torch.equal(dequantize(joined, torch.float32), dequantize(w, torch.float32))
    other = random_weight(act_order=True, seed=3)
    with pytest.raises(ValueError, match="b and a are one fused layer"):
        join_columns([parts[0], cut_columns(other, 16, 48)], ["a", "b"])


@pytest.mark.parametrize("act_order", [False, True])
def test_the_cpu_int4_matmul_computes_the_dequantized_product(act_order):
    """bfloat16: torch's packed INT4 kernel, zeros as its float zero point, act-order as
    a permutation of x; float32: dequantize then matmul."""
    w = random_weight(act_order=act_order)
    bias = torch.nn.Parameter(torch.randn(w.out_features), requires_grad=False)
    x = torch.randn(5, w.in_features)
    want = torch.nn.functional.linear(x, dequantize(w, torch.float32), bias)
    fast = PackedWeightLinear(w, bias, torch.bfloat16, {})
    assert fast.cpu_int4 and not hasattr(fast, "qweight")
    got = fast(x.bfloat16()).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    exact = PackedWeightLinear(w, bias, torch.float32, {})
    assert not exact.cpu_int4
    torch.testing.assert_close(exact(x), want)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_packed_token_table_looks_up_the_rows_its_head_multiplies_by(act_order, dtype):
    """A table of 192 tokens (three of the CPU kernel's 64-row blocks): the rows that
    PackedEmbedding reads back (from the CPU kernel's own layout in bfloat16, from
    GPTQ's in float32) are the rows the head multiplies by, in the model's dtype."""
    w = random_weight(n=192, act_order=act_order)
    table = PackedWeightLinear(w, None, dtype, {}, table=True)
    # torch packs the kernel's layout per instruction set: `rows` reads the AVX-512 one;
    # elsewhere (AVX2) the table keeps GPTQ's layout, and its rows must agree all the same
    assert table.cpu_int4 == (dtype == torch.bfloat16 and KERNEL_LAYOUT_READ)
    ids = torch.tensor([[0, 31, 32, 63], [64, 100, 191, 5]])
    got = PackedEmbedding(table)(ids)
    assert got.dtype == dtype and got.shape == (2, 4, w.in_features)
    multiplied = table(torch.eye(w.in_features, dtype=dtype)).t()  # [tokens, hidden]
    torch.testing.assert_close(got, multiplied[ids])
    # the kernel's zero points are bfloat16 floats: within its rounding of values < 18
    close = {"atol": 0.1, "rtol": 0} if dtype == torch.bfloat16 else {"atol": 0, "rtol": 0}
    torch.testing.assert_close(got.float(), dequantize(w, torch.float32)[ids], **close)


def test_a_table_whose_rows_the_cpu_kernel_layout_cannot_give_back_keeps_gptqs():
    """80 tokens: not whole 64-row blocks of the kernel's layout, so the table stays in
    GPTQ's layout (dequantized per forward) rather than be looked up wrong."""
    w = random_weight(n=80)
    table = PackedWeightLinear(w, None, torch.bfloat16, {}, table=True)
    assert not table.cpu_int4
    assert PackedWeightLinear(w, None, torch.bfloat16, {}).cpu_int4  # a plain layer: the kernel
    ids = torch.tensor([7, 79])
    torch.testing.assert_close(
        PackedEmbedding(table)(ids).float(), dequantize(w, torch.bfloat16)[ids].float()
    )


def test_padding_a_vocabulary_shard_adds_zero_rows():
    w = random_weight(n=48)
    padded = pad_columns(w, 64)
    dense = dequantize(padded, torch.float32)
    assert padded.out_features == 64 and dense.shape == (64, w.in_features)
    torch.testing.assert_close(dense[:48], dequantize(w, torch.float32))
    assert not dense[48:].any()
