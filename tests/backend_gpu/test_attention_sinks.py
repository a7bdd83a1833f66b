"""Attention sinks (gpt-oss: a learned logit per query head in the softmax's denominator):
the torch path (decodes one by one, decodes batched, prefill chunks over a cached
context, fresh prompts) against transformers' own eager gpt-oss attention over each
sequence's whole context; then the Triton decode and prefill kernels against the torch
path, in Triton's interpreter without CUDA (conftest.py), with GQA groups up to
gpt-oss's 8, sliding windows, decode splits and an FP8 cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from backend_gpu.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    DecodeSpan,
    PrefillSpan,
    paged_attention,
)
from backend_gpu.quantization.fp8 import FP8
from tests.backend_gpu.test_triton_attention import (
    BLOCK,
    DEVICE,
    LENGTHS,
    PREFILL_SHAPES,
    SCALE,
    Batch,
    assert_matches,
    make_batch,
    slots_of,
)

pytest.importorskip("triton")

from backend_gpu.layers.triton_attention import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
)


def sinks_for(heads: int, seed: int = 7) -> torch.Tensor:
    """Logits about the size of the scores', so the sinks take a real share."""
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2


def torch_path(batch: Batch, window: int | None, sinks, grouped: bool = False) -> torch.Tensor:
    """The torch path in float32: decodes one by one (or as one padded group), chunks
    as spans."""
    k_cache, v_cache = (c.flatten(0, 1).clone() for c in (batch.k_cache, batch.v_cache))
    if k_cache.dtype != FP8:
        k_cache, v_cache = k_cache.float(), v_cache.float()
    bs = batch.k_cache.shape[1]
    workspace = batch.tables.numel() * bs * k_cache[0].numel()  # every table padded
    meta = AttentionMetadata(
        slot_mapping=batch.slot_mapping(),
        block_size=bs,
        k_workspace=torch.empty(workspace),
        v_workspace=torch.empty(workspace),
    )
    row, decodes = 0, []
    for table, (past, new) in zip(batch.tables.long(), batch.shapes, strict=True):
        blocks = table[: -(-(past + new) // bs)]
        if new == 1:
            decodes.append((row, past + 1, table))
            if not grouped:
                meta.decodes.append(DecodeSpan(row, past + 1, blocks))
        else:
            meta.prefills.append(PrefillSpan(row, row + new, past, blocks))
        row += new
    if grouped and decodes:
        meta.decode_groups.append(
            DecodeGroup(
                rows=torch.tensor([r for r, _, _ in decodes]),
                block_ids=torch.cat([t.long() for _, _, t in decodes]),
                lens=torch.tensor([n for _, n, _ in decodes]),
                shortest=min(n for _, n, _ in decodes),
            )
        )
    scales = dict(k_scale=batch.k_scale, v_scale=batch.v_scale)
    q = batch.q.float()
    return paged_attention(
        q, batch.k_new, batch.v_new, k_cache, v_cache, meta, SCALE, window, **scales, sinks=sinks
    )


def transformers_reference(batch: Batch, window: int | None, sinks) -> torch.Tensor:
    """transformers' eager gpt-oss attention over each sequence's whole context (float32
    keys and values as the cache holds them), its last queries kept."""
    heads, kv_heads = batch.q.shape[1], batch.k_cache.shape[2]
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=heads // kv_heads, training=False)
    bs = batch.k_cache.shape[1]
    outs, row = [], 0
    for table, (past, new) in zip(batch.tables, batch.shapes, strict=True):
        slots = slots_of(table, 0, past + new, bs)
        k = batch.k_cache.flatten(0, 1)[slots].float() * batch.k_scale
        v = batch.v_cache.flatten(0, 1)[slots].float() * batch.v_scale
        q = batch.q[row : row + new].float()
        q_pos = torch.arange(past, past + new)[:, None]
        key_pos = torch.arange(past + new)[None, :]
        seen = key_pos <= q_pos
        if window is not None:
            seen &= key_pos > q_pos - window
        mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))[None, None]
        out, _ = eager_attention_forward(
            module,
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            mask,
            SCALE,
        )
        outs.append(out[0])
        row += new
    return torch.cat(outs)


@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("grouped", [False, True])
def test_torch_path_decodes_equal_transformers(group, window, grouped):
    batch = make_batch([(n - 1, 1) for n in LENGTHS], group, seed=group)
    sinks = sinks_for(batch.q.shape[1])
    want = transformers_reference(batch, window, sinks)
    torch.testing.assert_close(torch_path(batch, window, sinks, grouped), want)
    # the sinks take a share: without them the output differs
    assert not torch.allclose(torch_path(batch, window, None, grouped), want, atol=1e-3)


def test_grouped_decodes_read_only_their_windows_blocks():
    """A padded group under a sliding window reads from the first block its shortest
    member's window reaches: the blocks before it (NaN here, which a read would spread
    through the values' matmul) are never gathered."""
    lengths = (40, 50, 70)
    batch = make_batch([(n - 1, 1) for n in lengths], 8, seed=3)
    sinks = sinks_for(batch.q.shape[1])
    want = transformers_reference(batch, 5, sinks)
    skipped = (min(lengths) - 5) // BLOCK
    for table in batch.tables.long():
        batch.v_cache[table[:skipped]] = float("nan")
    torch.testing.assert_close(torch_path(batch, 5, sinks, grouped=True), want)


@pytest.mark.parametrize("group", [2, 8])
@pytest.mark.parametrize("window", [None, 5])
def test_torch_path_prefill_chunks_equal_transformers(group, window):
    batch = make_batch(PREFILL_SHAPES, group, seed=10 + group)
    sinks = sinks_for(batch.q.shape[1])
    want = transformers_reference(batch, window, sinks)
    torch.testing.assert_close(torch_path(batch, window, sinks), want)


def test_torch_path_slices_long_chunks(monkeypatch):
    """A chunk whose scores pass SINK_SCORES runs in query slices, to the same result."""
    import backend_gpu.layers.attention as attention

    batch = make_batch([(0, 70), (9, 40)], 4, seed=5)
    sinks = sinks_for(batch.q.shape[1])
    whole = torch_path(batch, None, sinks)
    monkeypatch.setattr(attention, "SINK_SCORES", 700)  # a few queries a slice
    torch.testing.assert_close(torch_path(batch, None, sinks), whole)


def decode(batch: Batch, window, sinks, splits=None) -> torch.Tensor:
    paged = batch.paged()
    return paged_decode_attention(
        batch.q.to(DEVICE),
        batch.k_cache.to(DEVICE),
        batch.v_cache.to(DEVICE),
        paged.block_tables,
        paged.context_lens,
        SCALE,
        window,
        batch.k_scale,
        batch.v_scale,
        num_splits=splits,
        sinks=sinks.to(DEVICE),
    )


def prefill(batch: Batch, window, sinks) -> torch.Tensor:
    paged = batch.paged()
    return paged_prefill_attention(
        batch.q.to(DEVICE),
        batch.k_cache.to(DEVICE),
        batch.v_cache.to(DEVICE),
        paged.block_tables,
        paged.context_lens,
        paged.query_start_loc,
        paged.max_query_len,
        SCALE,
        window,
        batch.k_scale,
        batch.v_scale,
        sinks=sinks.to(DEVICE),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [2, 8])
@pytest.mark.parametrize(("window", "splits"), [(None, 1), (5, 4), (None, 8)])
def test_decode_kernel_matches_torch_path(dtype, group, window, splits):
    batch = make_batch([(n - 1, 1) for n in LENGTHS], group, dtype, seed=group)
    sinks = sinks_for(batch.q.shape[1])
    assert_matches(decode(batch, window, sinks, splits), torch_path(batch, window, sinks), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [2, 8])
@pytest.mark.parametrize("window", [None, BLOCK + 3])
def test_prefill_kernel_matches_torch_path(dtype, group, window):
    batch = make_batch(PREFILL_SHAPES, group, dtype, seed=10 + group)
    sinks = sinks_for(batch.q.shape[1])
    assert_matches(prefill(batch, window, sinks), torch_path(batch, window, sinks), dtype)


def test_kernels_read_an_fp8_cache_with_sinks():
    """K's scale joins the scores, never the sink; V's multiplies the output."""
    decodes = make_batch([(n - 1, 1) for n in LENGTHS], 4, fp8=True, dim=32, seed=20)
    sinks = sinks_for(decodes.q.shape[1])
    assert_matches(decode(decodes, None, sinks, 2), torch_path(decodes, None, sinks), torch.float32)
    chunks = make_batch(PREFILL_SHAPES, 4, fp8=True, dim=32, seed=21)
    assert_matches(prefill(chunks, None, sinks), torch_path(chunks, None, sinks), torch.float32)
