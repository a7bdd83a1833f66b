"""Rows that see past themselves (a Gemma 3 image's tokens see their whole image): the torch
path (the CPU's) and the Triton prefill kernel (interpreted without CUDA) with
AttentionMetadata.key_last against a dense softmax under transformers' Gemma 3 mask,
OR(causal, same image) and, in a sliding layer, AND(window, that); fresh prompts and
chunks after a cached context (one starting inside an image, as a prefix hit may), with
and without a window shorter than an image; and the scheduler's rule that keeps a chunk
from ending inside an image."""

from __future__ import annotations

import pytest
import torch

from backend_gpu.layers.attention import AttentionMetadata, PagedBatch, PrefillSpan, paged_attention
from backend_gpu.multimodal import ImagePrompt, ImageSpan
from engine_api.images import image_input

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK, HEADS, KV_HEADS, DIM, SCALE = 8, 4, 2, 16, 0.25
# per sequence: (tokens cached before the step, new tokens, its images' [start, end))
SEQS = [
    (0, 30, [(3, 13), (17, 27)]),  # a fresh prompt with two images
    (12, 14, [(8, 20)]),  # a chunk that starts inside an image (a prefix hit there)
    (5, 20, [(6, 22)]),  # a chunk after a cached context, an image inside it
    (9, 6, []),  # text only, beside them
]


def dense_reference(q, k, v, seqs, window: int | None) -> torch.Tensor:
    """Each sequence's queries over all its keys under transformers' mask, float32."""
    outs, row, key = [], 0, 0
    for past, new, images in seqs:
        length = past + new
        q_pos = torch.arange(past, length)[:, None]
        k_pos = torch.arange(length)[None, :]
        block = torch.full((length,), -1)
        for i, (a, b) in enumerate(images):
            block[a:b] = i
        same = (block[q_pos] == block[k_pos]) & (block[q_pos] >= 0)
        mask = (k_pos <= q_pos) | same
        if window is not None:
            mask &= k_pos > q_pos - window
        qs = q[row : row + new].transpose(0, 1)  # [H, new, D]
        ks = k[key : key + length].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        vs = v[key : key + length].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2) * SCALE).masked_fill(~mask, float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        row, key = row + new, key + length
    return torch.cat(outs)


def key_last(seqs) -> torch.Tensor:
    """Per new row, the last key it sees: its own position, or its image's last."""
    rows = []
    for past, new, images in seqs:
        last = torch.arange(past, past + new)
        for a, b in images:
            lo, hi = max(a, past), min(b, past + new)
            if lo < hi:
                last[lo - past : hi - past] = b - 1
        rows.append(last)
    return torch.cat(rows)


@pytest.fixture(scope="module")
def batch():
    """Random q, every key and value of each sequence, a cache holding them in blocks
    laid out one sequence after another, and the metadata of both paths."""
    gen = torch.Generator().manual_seed(0)
    lengths = [p + n for p, n, _ in SEQS]
    total = sum(lengths)
    q = torch.randn(sum(n for _, n, _ in SEQS), HEADS, DIM, generator=gen)
    k = torch.randn(total, KV_HEADS, DIM, generator=gen)
    v = torch.randn(total, KV_HEADS, DIM, generator=gen)
    blocks = [-(-n // BLOCK) for n in lengths]
    k_cache = torch.zeros(sum(blocks) * BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.zeros(len(SEQS), max(blocks), dtype=torch.int32)
    slots, new_rows, prefills = [], [], []
    first_block = first_key = row = 0
    for i, ((past, new, _), length) in enumerate(zip(SEQS, lengths, strict=True)):
        table = torch.arange(first_block, first_block + blocks[i])
        tables[i, : blocks[i]] = table
        positions = torch.arange(length)
        cache_rows = table[positions // BLOCK] * BLOCK + positions % BLOCK
        k_cache[cache_rows[:past]] = k[first_key : first_key + past]
        v_cache[cache_rows[:past]] = v[first_key : first_key + past]
        slots.append(cache_rows[past:])
        new_rows.append(torch.arange(first_key + past, first_key + length))
        prefills.append(PrefillSpan(row, row + new, past, table))
        first_block, first_key, row = first_block + blocks[i], first_key + length, row + new
    new_rows = torch.cat(new_rows)
    return dict(
        q=q,
        k=k,
        v=v,
        k_new=k[new_rows],
        v_new=v[new_rows],
        k_cache=k_cache,
        v_cache=v_cache,
        slots=torch.cat(slots),
        tables=tables,
        prefills=prefills,
    )


def run(batch, window: int | None, paged: bool) -> torch.Tensor:
    k_cache, v_cache = batch["k_cache"].clone().to(DEVICE), batch["v_cache"].clone().to(DEVICE)
    workspace = torch.empty(k_cache.numel(), device=DEVICE)
    meta = AttentionMetadata(batch["slots"].to(DEVICE), BLOCK, workspace, workspace.clone())
    if paged:
        news = torch.tensor([n for _, n, _ in SEQS], dtype=torch.int32)
        lens = torch.tensor([p + n for p, n, _ in SEQS], dtype=torch.int32)
        starts = torch.cat([news.new_zeros(1), news.cumsum(0, dtype=torch.int32)])
        tensors = (t.to(DEVICE) for t in (batch["tables"], lens, starts))
        meta.paged = PagedBatch(*tensors, max_query_len=int(news.max()))
    else:
        meta.prefills = batch["prefills"]
    meta.key_last = key_last(SEQS).to(DEVICE)
    q, k, v = (batch[name].to(DEVICE) for name in ("q", "k_new", "v_new"))
    return paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, window).cpu()


@pytest.mark.parametrize("window", [None, 6], ids=["global", "window-6"])
def test_the_torch_path_lets_an_image_see_itself(batch, window):
    want = dense_reference(batch["q"], batch["k"], batch["v"], SEQS, window)
    torch.testing.assert_close(run(batch, window, paged=False), want, atol=2e-5, rtol=2e-5)
    # the mask matters: without key_last (causal) the image rows differ, the text rows not
    causal = dense_reference(
        batch["q"], batch["k"], batch["v"], [(p, n, []) for p, n, _ in SEQS], window
    )
    assert not torch.allclose(causal, want)


@pytest.mark.parametrize("window", [None, 6], ids=["global", "window-6"])
def test_the_triton_prefill_kernel_lets_an_image_see_itself(batch, window):
    pytest.importorskip("triton")
    want = dense_reference(batch["q"], batch["k"], batch["v"], SEQS, window)
    torch.testing.assert_close(run(batch, window, paged=True), want, atol=2e-5, rtol=2e-5)


def test_a_chunk_never_ends_inside_an_image():
    picture = image_input(2, 2, bytes(12))
    spans = [ImageSpan(4, 20, picture, (1, 8, 8)), ImageSpan(22, 38, picture, (1, 8, 8))]
    whole = ImagePrompt(spans, [], None, 0, whole=True)
    assert whole.chunk_end(0, 10) == 4  # back to the image's start
    assert whole.chunk_end(0, 21) == 21 and whole.chunk_end(0, 20) == 20
    assert whole.chunk_end(10, 15) == 10  # a hit inside the image: wait for room
    assert whole.chunk_end(10, 20) == 20
    assert whole.chunk_end(0, 30) == 22
    assert ImagePrompt(spans, [], None, 0).chunk_end(0, 10) == 10  # Qwen's: anywhere
    last = whole.key_last(2, 24)
    assert last.tolist() == [2, 3, *[19] * 16, 20, 21, 37, 37]
    assert whole.key_last(38, 40) is None and ImagePrompt(spans, [], None, 0).key_last(0, 9) is None
