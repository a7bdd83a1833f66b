"""BERT encoders (all-MiniLM-L6-v2, BGE, E5, ...), for embedding models: every token
attends to every other token of its input (bidirectional), positions are learned
absolute embeddings, each input is one segment (token type 0), and each sublayer is
followed by its LayerNorm (post-LN), as Hugging Face's BertModel computes.

An encoder keeps no KV cache: an input is computed whole in one forward and only its
pooled vector is kept. The engine hands the batch's inputs one after another (the same
flat rows the decoders take); they are padded into [inputs, longest] here, with a mask
that keeps each input's queries off the others' and off the padding, since SDPA wants
one dense tensor per batch.

Module and parameter names are the checkpoint's, so the loader copies each tensor by
name; a checkpoint saved from BertForMaskedLM (the `bert.` prefix, the MLM head) loads
too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.layers.linear import embedding

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class BertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class BertSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return o.transpose(1, 2).reshape(batch, length, hidden)


class BertSublayerOutput(nn.Module):
    """dense, then LayerNorm of it plus the sublayer's input (post-LN)."""

    def __init__(self, config, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSublayerOutput(config, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.activation = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSublayerOutput(config, config.intermediate_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    def __init__(self, config, tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        if tp.size != 1:
            raise ValueError("BERT encoders run on one device (tensor_parallel_size 1)")
        kind = getattr(config, "position_embedding_type", "absolute")
        if kind != "absolute":
            raise NotImplementedError(f"BERT with {kind!r} position embeddings")
        if config.hidden_act not in ACTIVATIONS:
            raise NotImplementedError(
                f"BERT activation {config.hidden_act!r}; supported: {sorted(ACTIVATIONS)}"
            )
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The parameter a checkpoint tensor fills, or None for one this model does not
        use (the pooler, an MLM head, the position ids buffer)."""
        name = name.removeprefix("bert.")
        if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
            return None
        return name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, lens: list[int]):
        """Hidden states [sum(lens), H] of the inputs lying one after another in
        input_ids [sum(lens)] (positions: each input's 0, 1, ...)."""
        x = self.embeddings(input_ids, positions)
        lengths = torch.tensor(lens, device=x.device)
        valid = torch.arange(max(lens), device=x.device)[None, :] < lengths[:, None]  # [B, L]
        padded = x.new_zeros(len(lens), max(lens), x.shape[-1])
        padded[valid] = x
        mask = valid[:, None, None, :]  # [B, 1, 1, L]: every query sees its input's keys
        for layer in self.encoder.layer:
            padded = layer(padded, mask)
        return padded[valid]
