"""Paged attention against SDPA on the same keys laid out contiguously: decodes (one by
one and in padded groups) and prefill chunks mixed in one batch, blocks scattered over
the pool, GQA, windows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import backend_gpu.layers.attention as attention
from backend_gpu import LLM
from backend_gpu.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    DecodeSpan,
    PrefillSpan,
    paged_attention,
)
from backend_gpu.rank_handoff import StepRows
from backend_gpu.span_metadata import span_metadata
from tests.backend_gpu.test_correctness import check

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def reference(q, keys, values, start_pos: int, scale: float, window: int | None):
    """SDPA over one sequence's contiguous keys [L, Hkv, D] for queries at start_pos..."""
    q_len, ctx_len = q.shape[0], keys.shape[0]
    q_pos = torch.arange(start_pos, start_pos + q_len)[:, None]
    key_pos = torch.arange(ctx_len)[None, :]
    mask = key_pos <= q_pos
    if window is not None:
        mask &= key_pos > q_pos - window
    heads_first = [t.transpose(0, 1) for t in (q, keys, values)]  # SDPA takes [H, L, D]
    out = F.scaled_dot_product_attention(*heads_first, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("one_by_one", [True, False])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_sdpa_on_contiguous_keys(window, one_by_one):
    gen = torch.Generator().manual_seed(0)
    num_blocks = 32
    # (context before this step, new tokens): three decodes, a fresh prompt, a later chunk
    shapes = [(13, 1), (0, 6), (3, 1), (9, 5), (1, 1)]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.zeros(num_blocks * BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    contexts, tables = [], []
    for past, new in shapes:
        table = torch.tensor([free.pop() for _ in range(-(-(past + new) // BLOCK))])
        keys = torch.randn(past + new, KV_HEADS, DIM, generator=gen)
        values = torch.randn(past + new, KV_HEADS, DIM, generator=gen)
        slots = table[torch.arange(past) // BLOCK] * BLOCK + torch.arange(past) % BLOCK
        k_cache[slots], v_cache[slots] = keys[:past], values[:past]
        contexts.append((keys, values))
        tables.append(table)
    total = sum(new for _, new in shapes)
    q = torch.randn(total, HEADS, DIM, generator=gen)
    slot_mapping, k_new, v_new = [], [], []
    meta_decodes, meta_prefills = [], []
    row = 0
    for (past, new), table, (keys, values) in zip(shapes, tables, contexts, strict=True):
        positions = torch.arange(past, past + new)
        slot_mapping.append(table[positions // BLOCK] * BLOCK + positions % BLOCK)
        k_new.append(keys[past:])
        v_new.append(values[past:])
        if new == 1:
            meta_decodes.append(DecodeSpan(row, past + 1, table))
        else:
            meta_prefills.append(PrefillSpan(row, row + new, past, table))
        row += new
    groups = []
    if not one_by_one:  # the decodes as one padded group, as the runner builds it
        block_ids = [d.block_ids for d in meta_decodes]
        width = max(ids.numel() for ids in block_ids)
        padded = [torch.cat([ids, ids.new_zeros(width - ids.numel())]) for ids in block_ids]
        rows = torch.tensor([d.row for d in meta_decodes])
        lens = torch.tensor([d.ctx_len for d in meta_decodes])
        groups, meta_decodes = [DecodeGroup(rows, torch.cat(padded), lens)], []
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slot_mapping),
        block_size=BLOCK,
        k_workspace=torch.empty(num_blocks * BLOCK * KV_HEADS * DIM),
        v_workspace=torch.empty(num_blocks * BLOCK * KV_HEADS * DIM),
        decode_groups=groups,
        decodes=meta_decodes,
        prefills=meta_prefills,
    )
    scale = 0.3
    out = paged_attention(
        q, torch.cat(k_new), torch.cat(v_new), k_cache, v_cache, meta, scale, window
    )
    row = 0
    for (past, new), (keys, values) in zip(shapes, contexts, strict=True):
        expected = reference(q[row : row + new], keys, values, past, scale, window)
        torch.testing.assert_close(out[row : row + new], expected, rtol=1e-5, atol=1e-5)
        row += new


def test_a_windowed_group_skips_the_blocks_before_its_window():
    """Decodes as one padded group through SDPA under a sliding window: read from the
    first block the shortest member's window reaches (the values before it NaN here,
    which a read would spread), still equal to SDPA on each context."""
    gen = torch.Generator().manual_seed(1)
    window, lengths = 5, [22, 26, 30]
    blocks = -(-max(lengths) // BLOCK)
    k_cache = torch.randn(len(lengths) * blocks * BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(k_cache.shape, generator=gen)
    tables = torch.randperm(len(lengths) * blocks, generator=gen).view(len(lengths), blocks)
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen)
    want = []
    for i, n in enumerate(lengths):
        slots = tables[i, torch.arange(n) // BLOCK] * BLOCK + torch.arange(n) % BLOCK
        want.append(reference(q[i : i + 1], k_cache[slots], v_cache[slots], n - 1, 0.3, window))
    skipped = (min(lengths) - window) // BLOCK
    v_cache.view(-1, BLOCK, KV_HEADS, DIM)[tables[:, :skipped].flatten()] = float("nan")
    last = torch.tensor(
        [tables[i, (n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for i, n in enumerate(lengths)]
    )
    group = DecodeGroup(
        torch.arange(len(lengths)), tables.flatten(), torch.tensor(lengths), min(lengths)
    )
    meta = AttentionMetadata(
        slot_mapping=last,
        block_size=BLOCK,
        k_workspace=torch.empty(k_cache.numel()),
        v_workspace=torch.empty(k_cache.numel()),
        decode_groups=[group],
    )
    k_new, v_new = k_cache[last].clone(), v_cache[last].clone()
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, 0.3, window)
    torch.testing.assert_close(out, torch.cat(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_one_by_one_decodes_match_transformers(tiny_model_dir, arch, monkeypatch):
    """One torch thread switches the runner to one-by-one decodes (else padded groups)."""
    calls = []

    def counted(*args):
        calls.append(1)
        return decode_attention(*args)

    decode_attention = attention._decode_attention
    monkeypatch.setattr(attention, "_decode_attention", counted)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model_dir = tiny_model_dir(arch)
        check(LLM(model_dir, max_num_batched_tokens=24), model_dir)
    finally:
        torch.set_num_threads(threads)
    assert calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verifys_rows_compute_what_decodes_at_their_positions_do(dtype):
    """On one thread a short chunk after a context (a speculative verify's k + 1 rows)
    is attended row by row, as decodes: each row's output is, bit for bit, what a plain
    decode at its position computes, so greedy speculation cannot part from plain
    decoding there (bfloat16's SDPA over the chunk rounds otherwise)."""
    gen = torch.Generator().manual_seed(2)
    past, new, num_blocks = 21, 4, 16
    k_cache = torch.randn(num_blocks * BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[: -(-(past + new) // BLOCK)]
    block_tables = table[None].to(torch.int32)
    positions = torch.arange(past, past + new)
    slots = table[positions // BLOCK] * BLOCK + positions % BLOCK
    q = torch.randn(new, HEADS, DIM, generator=gen).to(dtype)

    def workspace(blocks: int):
        size = blocks * BLOCK * KV_HEADS * DIM
        return torch.empty(size, dtype=dtype), torch.empty(size, dtype=dtype)

    def attend(rows: slice, end: int) -> torch.Tensor:
        n = rows.stop - rows.start
        step = StepRows(
            token_ids=[0] * n,
            num_new=[n],
            ends=[end],
            tables=[table.tolist()],
            sample_rows=[n - 1],
            padded_seqs=1,
            scratch_slot=0,
        )
        meta = span_metadata(step, BLOCK, block_tables, slots[rows], workspace)
        assert not meta.prefills and len(meta.decodes) == n
        k_new, v_new = k_cache[slots[rows]].clone(), v_cache[slots[rows]].clone()
        return paged_attention(q[rows], k_new, v_new, k_cache, v_cache, meta, 0.3)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        verify = attend(slice(0, new), past + new)
        one_by_one = [attend(slice(j, j + 1), past + j + 1) for j in range(new)]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(verify, torch.cat(one_by_one))
    context = torch.arange(past + new)
    cached = table[context // BLOCK] * BLOCK + context % BLOCK
    want = reference(q.float(), k_cache[cached].float(), v_cache[cached].float(), past, 0.3, None)
    torch.testing.assert_close(verify.float(), want, rtol=0.02, atol=0.02)
