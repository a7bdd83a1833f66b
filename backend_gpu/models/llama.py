"""The Llama family on the paged KV cache: Llama 2/3, Mistral, SmolLM, TinyLlama,
Qwen2 (bias on q/k/v) and Qwen3 (RMS norm on q and k per head); and the same
decoders as embedding models (LlamaEmbeddingModel: Qwen3-Embedding), without a cache.

Under tensor parallelism (tp_shards.py) each rank builds the same model with its share
of the heads, the MLP and the vocabulary; o and down end in an all-reduce."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.layers import vocab_parallel
from backend_gpu.layers.attention import AttentionMetadata, PrefillSpan, paged_attention
from backend_gpu.layers.linear import Linear, LMHead, PackedLinear, embedding
from backend_gpu.layers.norm import RMSNorm
from backend_gpu.layers.rotary import RotaryEmbedding, rope_settings
from backend_gpu.tp_shards import VocabShard, local_heads


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config, layer: int) -> int | None:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return config.sliding_window if layer_types[layer] == "sliding_attention" else None
    if config.model_type in ("mistral", "mixtral", "qwen3_moe", "phi3"):
        return getattr(config, "sliding_window", None)
    return None


class LlamaAttention(nn.Module):
    def __init__(self, config, layer: int, rotary: RotaryEmbedding, tp: ParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = local_heads(config, tp.size)
        self.head_dim = head_dim_of(config)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        bias = bias or getattr(config, "qkv_bias", False)  # Qwen2-MoE names it
        self.qkv_proj = PackedLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias
        )
        # row-parallel: the ranks' partial sums are added, so the bias is rank 0's alone
        o_bias = getattr(config, "attention_bias", False) and config.model_type != "qwen2"
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias and tp.rank == 0)
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary  # the model's one table, shared by every layer
        self.window = sliding_window_of(config, layer)
        self.scale = self.head_dim**-0.5
        self.k_cache = self.v_cache = torch.empty(0)  # set by the model runner
        self.k_scale = self.v_scale = 1.0  # the FP8 cache's, calibrated by the model runner

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata):
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        cache = (self.k_cache, self.v_cache)
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        o = paged_attention(q, k, v, *cache, meta, self.scale, self.window, **scales)
        return self.tp.all_reduce(self.o_proj(o.flatten(1)))


class GatedMLP(nn.Module):
    """down(activation(gate(x)) * up(x)): SwiGLU with silu (Llama), GeGLU with gelu (Gemma)."""

    def __init__(
        self, config, activation: Callable[[torch.Tensor], torch.Tensor], tp: ParallelGroup
    ) -> None:
        super().__init__()
        self.tp = tp
        size = config.intermediate_size // tp.size
        self.gate_up_proj = PackedLinear(config.hidden_size, {"gate": size, "up": size}, False)
        self.down_proj = Linear(size, config.hidden_size, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.tp.all_reduce(self.down_proj(self.activation(gate) * up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer: int, rotary: RotaryEmbedding, tp: ParallelGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer, rotary, tp)
        self.mlp = GatedMLP(config, F.silu, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, meta):
        x = x + self.self_attn(positions, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(
        self, config, tp: ParallelGroup, layer=LlamaDecoderLayer, rotary: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab = VocabShard.of(config.vocab_size, tp)
        self.embed_tokens = embedding(self.vocab.rows, config.hidden_size)
        rotary = rotary or RotaryEmbedding(
            head_dim_of(config), config.max_position_embeddings, *rope_settings(config)
        )
        self.layers = nn.ModuleList(
            layer(config, i, rotary, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input (a pipeline's first stage runs it alone)."""
        return vocab_parallel.embed(self.embed_tokens, input_ids, self.vocab, self.tp)

    def forward(self, input_ids, positions, meta):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """`layer`: the decoder layer's class (config, index, rotary, tp): a mixture of
    experts' (models/moe.py) in place of the dense one. `rotary`: the layers' table, when
    not the config's plain one (Phi-3's, models/phi3.py)."""

    def __init__(
        self,
        config,
        tp: ParallelGroup = SINGLE,
        layer=LlamaDecoderLayer,
        rotary: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.model = LlamaModel(config, tp, layer, rotary)
        self.lm_head = LMHead(config.hidden_size, self.model.vocab.rows)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary on rank 0; None on the other ranks."""
        m = self.model
        return vocab_parallel.gather_logits(self.lm_head(hidden), m.vocab, m.tp)


class LlamaEmbeddingModel(nn.Module):
    """A Llama-family decoder as an embedding model (Qwen3-Embedding): the final norm's
    hidden states, which the engine pools (last token), and no LM head. Each input is
    computed whole in one forward with causal attention over its own fresh keys: the
    layers have no KV cache (paged_attention writes none), so no blocks are taken."""

    def __init__(self, config, tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        self.model = LlamaModel(config, tp)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Checkpoints saved from the bare decoder (Qwen3-Embedding's) name the layers
        without the `model.` prefix; a causal LM's head is not used."""
        if name == "lm_head.weight":
            return None
        return name if name.startswith("model.") else f"model.{name}"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, lens: list[int]):
        """Hidden states [sum(lens), H] of the inputs lying one after another."""
        device = input_ids.device
        none = torch.empty(0, device=device)
        starts = [0, *itertools.accumulate(lens)]
        meta = AttentionMetadata(
            slot_mapping=none.long(),
            block_size=1,
            k_workspace=none,
            v_workspace=none,
            prefills=[
                PrefillSpan(start, end, 0, none.long()) for start, end in itertools.pairwise(starts)
            ],
        )
        return self.model(input_ids, positions, meta)
