"""Paged attention, a torch reference that runs wherever torch does.

Each step writes the new keys and values into the paged cache through the slot
mapping, then reads every sequence's context back block by block (whole blocks are
long contiguous rows, far cheaper to gather than single slots) into a reused
workspace. Decodes (one query each) run either as padded batches of similar length
through SDPA, which spreads batch x heads over threads (or a GPU), or, on a CPU running
one thread, one sequence at a time as two small matmuls over its KV heads: nothing is
padded or masked, the small workspace stays in the CPU's cache between the gather and
the matmuls, and SDPA's kernel is several times slower for a single query. A prefill
chunk goes through SDPA with the causal (and sliding-window) mask its position calls
for; a chunk that starts a sequence attends to its own fresh keys and skips the gather.
Rows may see past themselves (`key_last`: a Gemma 3 image's tokens see their whole
image, which the same chunk computes), on both paths.
An FP8 cache holds K and V divided by the layer's scales; the reads fold them back into
the query's scale and the attention output. Attention sinks (gpt-oss: a learned logit
per query head in the softmax's denominator, attending to nothing) have no SDPA form, so
a layer with sinks computes its scores explicitly (`_attention_with_sinks`).
A float32 decode group on the CPU takes the engine's own kernel where it is built
(cpu_kernels.py): it reads the keys where the blocks lie, one call a layer where the
torch path gathers, pads and makes some twenty (gpt-oss at 16 sequences: PERF.md).

A decoder serving as an embedding model has no cache at all (empty k_cache): its
inputs are whole prefills from position 0, which attend to their fresh keys only.

On CUDA the model runner sets `AttentionMetadata.paged` instead, and the Triton kernels
of triton_attention.py read the cache through the block tables with no gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from backend_gpu.layers import cpu_kernels
from backend_gpu.quantization.fp8 import FP8, to_fp8


@dataclass
class PrefillSpan:
    q_start: int  # first row of this chunk's queries in the flat batch
    q_end: int
    start_pos: int  # position of the first query in its sequence
    block_ids: torch.Tensor  # [n] blocks holding positions [0, start_pos + q_len)


@dataclass
class DecodeGroup:
    """Decodes of similar context length, run as one padded batch."""

    rows: torch.Tensor  # [B] rows of the one-token queries in the flat batch
    block_ids: torch.Tensor  # [B * max_blocks] block tables, padded
    lens: torch.Tensor  # [B] context lengths
    shortest: int = 0  # the least of lens: a sliding window skips the blocks before its


@dataclass
class DecodeSpan:
    row: int  # row of the one-token query in the flat batch
    ctx_len: int  # keys it attends to, its own included
    block_ids: torch.Tensor  # [n] blocks holding positions [0, ctx_len), or more (a verify's)


@dataclass
class PagedBatch:
    """The whole batch as the Triton kernels read it: sequence b's queries are rows
    query_start_loc[b]:query_start_loc[b + 1], the last of its context_lens[b] tokens."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32, the new tokens included
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's KV goes
    block_size: int
    k_workspace: torch.Tensor  # flat buffers the gathered context is read into
    v_workspace: torch.Tensor
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    decodes: list[DecodeSpan] = field(default_factory=list)  # run one by one
    prefills: list[PrefillSpan] = field(default_factory=list)
    paged: PagedBatch | None = None  # set: the Triton kernels run instead of the spans above
    # [T] per row, the index of the last key it sees where some row sees past itself (a
    # Gemma 3 image's tokens see their whole image); None: causal. Prefill rows only.
    key_last: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict)

    def decode_mask(self, g: int, window: int | None) -> torch.Tensor:
        """[B, 1, 1, L]: keys inside the context (and the window) of each decode query."""
        key = ("decode", g, window)
        if key not in self._masks:
            group = self.decode_groups[g]
            num_keys = group.block_ids.numel() // group.lens.numel() * self.block_size
            key_pos = torch.arange(num_keys, device=group.lens.device)
            lens = group.lens[:, None]
            mask = key_pos[None, :] < lens
            if window is not None:
                mask &= key_pos[None, :] > lens - 1 - window
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]

    def prefill_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        """[q_len, ctx_len] causal (and windowed) mask of a chunk, rows that see ahead
        seeing up to key_last (the window bounds only earlier keys, as transformers'
        Gemma 3 mask); None for plain causal."""
        span = self.prefills[i]
        ahead = None if self.key_last is None else self.key_last[span.q_start : span.q_end]
        if window is None and span.start_pos == 0 and ahead is None:
            return None
        key = (i, window)
        if key not in self._masks:
            q_len = span.q_end - span.q_start
            device = self.slot_mapping.device
            key_pos = torch.arange(span.start_pos + q_len, device=device)
            q_pos = torch.arange(span.start_pos, span.start_pos + q_len, device=device)[:, None]
            last = q_pos if ahead is None else ahead[:, None]
            mask = key_pos[None, :] <= last
            if window is not None:
                mask &= key_pos[None, :] > q_pos - window
            self._masks[key] = mask
        return self._masks[key]


def _write(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """cache[slots] = x / scale; an FP8 cache stores it saturated to its range (the
    layer's calibrated scale, quantization/kv_calibration.py: E4M3 is floating point,
    the scale moves its range onto the layer's values)."""
    if cache.dtype == x.dtype:
        cache.index_copy_(0, slots, x if scale == 1.0 else x / scale)
        return
    assert cache.dtype == FP8, cache.dtype
    # index_copy_ has no FP8 kernel on the CPU; bytes are bytes
    cache.view(torch.uint8).index_copy_(0, slots, to_fp8(x, scale).view(torch.uint8))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, workspace: torch.Tensor, bs: int):
    """[n * bs, Hkv, D]: the cache rows of blocks `block_ids`, in order, in the
    workspace's dtype (an FP8 cache is widened on the way)."""
    _, heads, dim = cache.shape
    row = bs * heads * dim
    out = workspace[: block_ids.numel() * row].view(-1, row)
    if cache.dtype == workspace.dtype:
        torch.index_select(cache.view(-1, row), 0, block_ids, out=out)
    else:  # FP8: gathered as bytes (index kernels need not know FP8), widened by the copy
        out.copy_(cache.view(torch.uint8).view(-1, row).index_select(0, block_ids).view(FP8))
    return out.view(-1, heads, dim)


def _decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
):
    """out [H, D] = attention of one query q [H, D], already scaled, over k, v [L, Hkv, D]:
    each KV head with the query heads that share it (h // (H / Hkv), as SDPA's enable_gqa).
    `sinks` [H]: a logit per head that joins the softmax and attends to nothing."""
    heads, dim = k.shape[1], k.shape[2]
    scores = torch.bmm(q.view(heads, -1, dim), k.permute(1, 2, 0)).float()  # [Hkv, H / Hkv, L]
    if sinks is not None:
        sink = sinks.float().view(heads, -1, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1].to(v.dtype)
    else:
        probs = scores.softmax(-1).to(v.dtype)
    torch.bmm(probs, v.transpose(0, 1), out=out.view(heads, -1, dim))


# the most float32 scores (query heads x queries x keys) _attention_with_sinks holds at once
SINK_SCORES = 1 << 24


def _attention_with_sinks(
    q: torch.Tensor,  # [B, H, Q, D]
    k: torch.Tensor,  # [B, Hkv, L, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # broadcast to [B, H, Q, L], True where a key is seen; None: causal
    scale: float,
    sinks: torch.Tensor,  # [H]
) -> torch.Tensor:
    """SDPA (GQA) with each head's sink logit in the softmax's denominator, as
    transformers' eager gpt-oss attention computes it; queries in slices, so the float32
    scores of a long prefill chunk stay under SINK_SCORES."""
    batch, heads, queries, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    if mask is None:
        mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(keys - queries)
    mask = mask.expand(batch, heads, queries, keys)
    sink = sinks.float().view(1, heads, 1, 1)
    out = torch.empty_like(q)
    step = max(1, SINK_SCORES // max(1, batch * heads * keys))
    for lo in range(0, queries, step):
        qs = q[:, :, lo : lo + step]
        rows = qs.shape[2]
        grouped = qs.reshape(batch, kv_heads, -1, dim)  # a KV head's query heads, stacked
        scores = _by_kv_head(grouped, k.transpose(-1, -2)).view(batch, heads, rows, keys)
        scores = (scores.float() * scale).masked_fill(~mask[:, :, lo : lo + rows], float("-inf"))
        with_sink = torch.cat([scores, sink.expand(batch, heads, rows, 1)], dim=-1)
        probs = with_sink.softmax(-1)[..., :-1].to(v.dtype)
        probs = probs.view(batch, kv_heads, -1, keys)
        out[:, :, lo : lo + rows] = _by_kv_head(probs, v).view(batch, heads, rows, dim)
    return out


def _by_kv_head(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b over [B, Hkv, ...] as a batched matmul per KV head: a gathered cache's K and
    V ([B, L, Hkv, D] seen as [B, Hkv, L, D]) are then read in place, where one matmul
    over both batch dimensions first copies them whole into its layout."""
    return torch.stack([torch.bmm(a[:, g], b[:, g]) for g in range(a.shape[1])], dim=1)


def _sdpa(q, k, v, mask, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA with GQA over a boolean mask (None: causal), or with sinks when the layer has them."""
    if sinks is not None:
        return _attention_with_sinks(q, k, v, mask, scale, sinks)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )


def _unscale(x: torch.Tensor, v_scale: float) -> torch.Tensor:
    """An attention output over values cached as v / v_scale, back to v's scale."""
    return x if v_scale == 1.0 else x * v_scale


def _kernel_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    k_scale: float,
    v_scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The Triton kernels on the batch: decode's when every query is alone, else prefill's."""
    # imported here: triton comes with CUDA builds of torch, a CPU-only install may lack it
    from backend_gpu.layers import triton_attention

    paged, bs = meta.paged, meta.block_size
    k_cache = k_cache.view(-1, bs, *k_cache.shape[1:])  # [num_blocks, block_size, Hkv, D]
    v_cache = v_cache.view(-1, bs, *v_cache.shape[1:])
    tables, lens = paged.block_tables, paged.context_lens
    if paged.max_query_len == 1:
        return triton_attention.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale, window, k_scale, v_scale, sinks=sinks
        )
    return triton_attention.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        paged.query_start_loc,
        paged.max_query_len,
        scale,
        window,
        k_scale,
        v_scale,
        sinks,
        meta.key_last,
    )


def _decodes_one_by_one(
    q_scaled: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
    sinks: torch.Tensor | None,
    v_scale: float,
    out: torch.Tensor,
) -> None:
    """meta.decodes' rows of out, each over its context, computed in float32 whatever
    the cache's dtype: at one query's sizes a bfloat16 bmm costs about four float32
    ones (oneDNN's call), and float32 is the more exact. Consecutive rows reading the
    same blocks (a verify's, span_metadata) share one gather, widened once."""
    bs = meta.block_size
    q_wide = q_scaled.float()
    out_wide = out if out.dtype == torch.float32 else torch.empty_like(out, dtype=torch.float32)
    gathered = None  # (its blocks, the first block read, K, V)
    for d in meta.decodes:
        # a sliding window reads only the blocks it reaches into
        first = 0 if window is None else max(0, d.ctx_len - window)
        skip = first // bs
        if gathered is None or gathered[0] is not d.block_ids or gathered[1] != skip:
            blocks = d.block_ids[skip:]
            kd = _gather(k_cache, blocks, meta.k_workspace, bs).float()
            vd = _gather(v_cache, blocks, meta.v_workspace, bs).float()
            gathered = (d.block_ids, skip, kd, vd)
        _, _, kd, vd = gathered
        lo, hi = first - skip * bs, d.ctx_len - skip * bs
        _decode_attention(q_wide[d.row], kd[lo:hi], vd[lo:hi], out_wide[d.row], sinks)
    rows = [d.row for d in meta.decodes]
    if out_wide is not out:
        out[rows] = out_wide[rows].to(out.dtype)
    if v_scale != 1.0:
        out[rows] *= v_scale


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks * block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    k_scale: float = 1.0,  # the caches hold k / k_scale and v / v_scale
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # [H]: a logit per query head in the denominator
) -> torch.Tensor:
    if k_cache.numel():  # an embedding model's layers keep no cache: fresh keys only
        _write(k_cache, meta.slot_mapping, k, k_scale)
        _write(v_cache, meta.slot_mapping, v, v_scale)
    if meta.paged is not None:
        return _kernel_attention(q, k_cache, v_cache, meta, scale, window, k_scale, v_scale, sinks)
    # keys and values read back from the cache are scaled down: rather than a pass over
    # the gathered workspace, K's scale joins the query's, q . (k * s) = (q * s) . k,
    # and V's multiplies the attention output
    cached_scale = scale * k_scale
    out = torch.empty_like(q)
    bs = meta.block_size
    for g, group in enumerate(meta.decode_groups):
        args = (group.rows, group.block_ids, group.lens, bs, window, sinks, cached_scale)
        if cpu_kernels.decode_attention(q, k_cache, v_cache, *args, v_scale, out):
            continue  # read where the blocks lie (layers/cpu_kernels.py)
        batch = group.rows.numel()
        qd = q.index_select(0, group.rows).unsqueeze(2)  # [B, H, 1, D]
        # a sliding window reads from the first block the shortest member's reaches into
        skip = 0 if window is None else max(0, group.shortest - window) // bs
        blocks = group.block_ids.view(batch, -1)[:, skip:].flatten()
        kd = _gather(k_cache, blocks, meta.k_workspace, bs)
        vd = _gather(v_cache, blocks, meta.v_workspace, bs)
        kd = kd.view(batch, -1, *kd.shape[1:]).transpose(1, 2)  # [B, Hkv, L, D]
        vd = vd.view(batch, -1, *vd.shape[1:]).transpose(1, 2)
        mask = meta.decode_mask(g, window)[..., skip * bs :]
        od = _sdpa(qd, kd, vd, mask, cached_scale, sinks)
        out.index_copy_(0, group.rows, _unscale(od.squeeze(2), v_scale))
    if meta.decodes:
        _decodes_one_by_one(q * cached_scale, k_cache, v_cache, meta, window, sinks, v_scale, out)
    for i, span in enumerate(meta.prefills):
        if span.start_pos == 0:  # the whole context is this chunk: no need to gather it
            kp, vp = k[span.q_start : span.q_end], v[span.q_start : span.q_end]
            span_scale, span_v_scale = scale, 1.0  # fresh, not scaled down
        else:
            ctx_len = span.start_pos + span.q_end - span.q_start
            kp = _gather(k_cache, span.block_ids, meta.k_workspace, bs)[:ctx_len]
            vp = _gather(v_cache, span.block_ids, meta.v_workspace, bs)[:ctx_len]
            span_scale, span_v_scale = cached_scale, v_scale
        qp = q[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        kp = kp.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        vp = vp.transpose(0, 1).unsqueeze(0)
        mask = meta.prefill_mask(i, window)
        op = _sdpa(qp, kp, vp, mask, span_scale, sinks)
        out[span.q_start : span.q_end] = _unscale(op[0].transpose(0, 1), span_v_scale)
    return out
