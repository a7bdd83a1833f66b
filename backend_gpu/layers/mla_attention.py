"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over the paged KV cache, with
the up-projection absorbed: the torch path (the CPU's and the reference), and the
switch to the Triton kernel (triton_mla.py) on CUDA.

A token's keys and values for every head are one up-projection of a shared latent,
so the cache holds only that latent (kv_lora_rank values, normed) and the rotary part
of the key (qk_rope_head_dim, shared by all heads): one row of
kv_lora_rank + qk_rope_head_dim per token and layer, in the layer's k_cache
([slots, 1, row]; its v_cache stays empty). DeepSeek-V3's 576 values a token and
layer are what a full cache of its 128 heads would hold in 2 x 128 x 192: 1/71.

Absorbed (the DeepSeek-V2 paper's trick): the key up-projection W_UK folds into the
query, q_nope . (W_UK c) = (q_nope W_UK) . c, so each head's query becomes a
kv_lora_rank vector scored against the latents as they are cached, plus its rotary
part against the cached rotary keys; the values are the latents themselves, and the
value up-projection W_UV applies once to each head's output. Attention is then one
KV head shared by every query head, of width kv_lora_rank + qk_rope_head_dim, values
the first kv_lora_rank of it: nothing is decompressed per cached token. The caller
(models/deepseek_v3.py) absorbs and expands; this file attends.

The torch path reads the step metadata of attention.py (decode groups, one-by-one
decodes, prefill chunks) and gathers a sequence's blocks into the K workspace as the
dense path does; an FP8 cache holds the rows divided by k_scale, which joins the
score scale and multiplies the output (values and keys are the same rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend_gpu.layers.attention import AttentionMetadata, _gather, _unscale, _write


def mla_attention(
    q: torch.Tensor,  # [T, H, R + P]: absorbed queries (q_nope W_UK), then rotary parts
    kv: torch.Tensor,  # [T, R + P]: the new tokens' normed latents, then rotary keys
    cache: torch.Tensor,  # [slots, 1, R + P], holding rows / k_scale
    meta: AttentionMetadata,
    scale: float,
    rank: int,  # R, kv_lora_rank: the values are a row's first R
    k_scale: float = 1.0,
) -> torch.Tensor:
    """[T, H, R]: each head's attention output in the latent space (before W_UV)."""
    if cache.numel():
        _write(cache, meta.slot_mapping, kv[:, None], k_scale)
    if meta.paged is not None:
        from backend_gpu.layers import triton_mla  # triton: CUDA builds of torch only

        paged = meta.paged
        out = triton_mla.mla_paged_attention(
            q,
            cache.view(-1, meta.block_size, cache.shape[-1]),
            paged.block_tables,
            paged.context_lens,
            paged.query_start_loc,
            paged.max_query_len,
            scale * k_scale,
            rank,
        )
        return out if k_scale == 1.0 else out * k_scale
    out = q.new_empty(*q.shape[:2], rank)
    cached_scale = scale * k_scale
    bs = meta.block_size
    for g, group in enumerate(meta.decode_groups):
        batch = group.rows.numel()
        kd = _gather(cache, group.block_ids, meta.k_workspace, bs)  # [B * L, 1, R + P]
        kd = kd.view(batch, -1, *kd.shape[1:]).transpose(1, 2)  # [B, 1, L, R + P]
        qd = q.index_select(0, group.rows).unsqueeze(2)  # [B, H, 1, R + P]
        mask = meta.decode_mask(g, None)
        od = F.scaled_dot_product_attention(
            qd, kd, kd[..., :rank], attn_mask=mask, scale=cached_scale, enable_gqa=True
        )
        out.index_copy_(0, group.rows, _unscale(od.squeeze(2), k_scale))
    for d in meta.decodes:
        kd = _gather(cache, d.block_ids, meta.k_workspace, bs)[: d.ctx_len, 0]  # [L, R + P]
        probs = (q[d.row] @ kd.t() * cached_scale).float().softmax(-1).to(kd.dtype)
        out[d.row] = _unscale(probs @ kd[:, :rank], k_scale)
    for i, span in enumerate(meta.prefills):
        if span.start_pos == 0:  # the whole context is this chunk: its fresh rows
            kp, span_scale, span_k_scale = kv[span.q_start : span.q_end, None], scale, 1.0
        else:
            ctx_len = span.start_pos + span.q_end - span.q_start
            kp = _gather(cache, span.block_ids, meta.k_workspace, bs)[:ctx_len]
            span_scale, span_k_scale = cached_scale, k_scale
        qp = q[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q, R + P]
        kp = kp.transpose(0, 1).unsqueeze(0)  # [1, 1, L, R + P]
        mask = meta.prefill_mask(i, None)
        op = F.scaled_dot_product_attention(
            qp,
            kp,
            kp[..., :rank],
            attn_mask=mask,
            is_causal=mask is None,
            scale=span_scale,
            enable_gqa=True,
        )
        out[span.q_start : span.q_end] = _unscale(op[0].transpose(0, 1), span_k_scale)
    return out
