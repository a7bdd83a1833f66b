"""Gemma 3 text on the paged KV cache: sliding-window and global layers (each with its
own rope base), RMS norm on q and k, GeGLU, scaled embeddings, tied head."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.layers import vocab_parallel
from backend_gpu.layers.attention import AttentionMetadata
from backend_gpu.layers.linear import Linear, LMHead, PackedLinear, embedding
from backend_gpu.layers.norm import RMSNorm
from backend_gpu.layers.rotary import RotaryEmbedding, rope_settings
from backend_gpu.models.llama import (
    GatedMLP,
    LlamaAttention,
    head_dim_of,
    sliding_window_of,
)
from backend_gpu.tp_shards import VocabShard, local_heads


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer: int, rotary: RotaryEmbedding, tp: ParallelGroup) -> None:
        super().__init__()
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise NotImplementedError("attention logit soft-capping is not supported")
        self.tp = tp
        self.num_heads, self.num_kv_heads = local_heads(config, tp.size)
        self.head_dim = head_dim_of(config)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.qkv_proj = PackedLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias
        )
        # row-parallel: the bias is added once, on rank 0
        self.o_proj = Linear(q_size, config.hidden_size, bias=bias and tp.rank == 0)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=1.0)
        self.qk_norm = True
        self.window = sliding_window_of(config, layer)
        self.rotary = rotary  # one table per layer type, shared by the layers of that type
        self.scale = config.query_pre_attn_scalar**-0.5
        self.k_cache = self.v_cache = torch.empty(0)  # set by the model runner
        self.k_scale = self.v_scale = 1.0  # the FP8 cache's, calibrated by the model runner

    # project, per-head q/k norm, rope, paged attention: the same steps as Llama's
    forward = LlamaAttention.forward


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer: int, rotary: RotaryEmbedding, tp: ParallelGroup) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer, rotary, tp)
        self.mlp = GatedMLP(config, partial(F.gelu, approximate="tanh"), tp)
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(dim, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, offset=1.0)

    def forward(self, positions, x, meta):
        h = self.self_attn(positions, self.input_layernorm(x), meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3Model(nn.Module):
    def __init__(self, config, tp: ParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab = VocabShard.of(config.vocab_size, tp)
        self.embed_tokens = embedding(self.vocab.rows, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        rotaries: dict[str, RotaryEmbedding] = {}
        layers = []
        for i in range(config.num_hidden_layers):
            kind = "sliding_attention" if sliding_window_of(config, i) else "full_attention"
            if kind not in rotaries:
                rotaries[kind] = RotaryEmbedding(
                    head_dim_of(config),
                    config.max_position_embeddings,
                    *rope_settings(config, kind),
                )
            layers.append(Gemma3DecoderLayer(config, i, rotaries[kind], tp))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input (a pipeline's first stage runs it alone)."""
        x = vocab_parallel.embed(self.embed_tokens, input_ids, self.vocab, self.tp)
        # the scale is rounded to the weights' dtype first, as in the reference
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def forward(self, input_ids, positions, meta):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, config, tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        self.model = Gemma3Model(config, tp)
        self.lm_head = LMHead(config.hidden_size, self.model.vocab.rows)
        self.lm_head.weight = self.model.embed_tokens.weight  # always tied
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary on rank 0; None on the other ranks."""
        logits = self.lm_head(hidden)
        if self.softcap is not None:  # elementwise: each rank caps its own shard
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return vocab_parallel.gather_logits(logits, self.model.vocab, self.model.tp)
