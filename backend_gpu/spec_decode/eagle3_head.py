"""An EAGLE-3 head (Li et al. 2025) in the layout SpecForge writes and vLLM reads.

`fc` fuses the target's hidden states at three layers (3H -> H); one decoder layer, the
`midlayer`, reads the next token's embedding and that fused state side by side: each is
normed (input_layernorm, hidden_norm), concatenated (2H), and q/k/v project from 2H;
the residual is the fused state. `norm` and `lm_head` give logits over the draft
vocabulary, `d2t` maps a draft id to the target's (target = draft + d2t[draft]), `t2d`
marks the target ids the draft vocabulary holds. A chain's later steps feed the layer's
own output (before `norm`) back in place of the fused state.

The head runs in a ModelRunner of its own (its KV cache paged like the target's): a
pass takes the runner's (input ids, positions, metadata) with the pass's hidden-state
rows (layer_out); only the rows a pass proposes from go through `norm` and `lm_head`,
and a greedy proposal is the argmax over the draft vocabulary alone.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.layers.linear import LMHead, PackedLinear, embedding
from backend_gpu.layers.norm import RMSNorm
from backend_gpu.layers.rotary import RotaryEmbedding, rope_settings
from backend_gpu.loader import Checkpoint, text_model_name
from backend_gpu.models.llama import GatedMLP, LlamaAttention, head_dim_of
from backend_gpu.spec_decode.eagle3_config import Eagle3Layout

EMBED = "model.embed_tokens.weight"
# the published names every head holds (with or without a `model.` prefix)
REQUIRED = [
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    *(
        f"midlayer.{part}.weight"
        for part in (
            "input_layernorm",
            "hidden_norm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ),
]


class Eagle3Layer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = LlamaAttention(config, 0, rotary, SINGLE)
        qkv = self.self_attn.qkv_proj
        shards = {name: s.stop - s.start for name, s in qkv.shard_slices.items()}
        self.self_attn.qkv_proj = PackedLinear(2 * h, shards, qkv.bias is not None)
        self.mlp = GatedMLP(config, F.silu, SINGLE)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, positions, embeds, hidden, meta) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = hidden + self.self_attn(positions, x, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.embed_tokens = embedding(config.vocab_size, h)
        self.fc = nn.Linear(3 * h, h, bias=False)
        rotary = RotaryEmbedding(
            head_dim_of(config), config.max_position_embeddings, *rope_settings(config)
        )
        self.layers = nn.ModuleList([Eagle3Layer(config, rotary)])
        self.norm = RMSNorm(h, config.rms_norm_eps)


class Eagle3Head(nn.Module):
    supports_lora = False

    def __init__(self, config, tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        assert tp.size == 1, "an EAGLE-3 head runs whole, beside rank 0"
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.model = Eagle3Model(config)
        self.lm_head = LMHead(config.hidden_size, draft_vocab)
        # loaded as parameters so that a missing or misshapen one is named at load
        self.d2t = nn.Parameter(torch.zeros(draft_vocab, dtype=torch.long), requires_grad=False)
        self.t2d = nn.Parameter(torch.zeros(config.vocab_size, dtype=torch.bool), False)
        self._target_ids: torch.Tensor | None = None

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        """The runner's own steps (its memory profile's largest on CUDA) over zero
        hidden rows; the proposer's passes call layer_out with theirs."""
        hidden = self.model.fc.weight.new_zeros(input_ids.shape[0], 3 * self.hidden_size)
        return self.model.norm(self.layer_out(input_ids, positions, meta, hidden))

    def layer_out(self, input_ids, positions, meta, hidden: torch.Tensor) -> torch.Tensor:
        """The midlayer's output before `norm` [tokens, H] over `hidden`: the target's
        rows [tokens, 3H] (fused by fc) or the head's own output of the pass before."""
        m = self.model
        if hidden.shape[-1] != self.hidden_size:
            hidden = m.fc(hidden)
        return m.layers[0](positions, m.embed_tokens(input_ids), hidden, meta)

    def greedy_tokens(self, prenorm: torch.Tensor) -> tuple[list[int], list[float]]:
        """The argmax of each row's logits, as target ids (over the draft vocabulary
        alone: compute_logits' -inf columns never win), and the head's probability of
        it."""
        logits = self.lm_head(self.model.norm(prenorm)).float()
        best, draft = logits.max(dim=-1)
        chance = (best - logits.logsumexp(dim=-1)).exp()
        return (draft + self.d2t[draft]).tolist(), chance.tolist()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: the draft vocabulary's at their target
        ids, -inf elsewhere (a token the head cannot propose)."""
        draft = self.lm_head(hidden)
        if self._target_ids is None:
            self._target_ids = torch.arange(draft.shape[-1], device=draft.device) + self.d2t
        full = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        full[:, self._target_ids] = draft
        return full


def checkpoint_name(stored: str) -> str:
    """A published tensor's name in Eagle3Head: with or without a `model.` prefix."""
    name = stored.removeprefix("model.")
    if name.startswith("midlayer."):
        return "model.layers.0." + name.removeprefix("midlayer.")
    if name in ("fc.weight", "norm.weight", "embed_tokens.weight"):
        return "model." + name
    return name  # lm_head.weight, d2t, t2d; anything else is refused at load


@dataclass(frozen=True)
class HeadCheckpoint:
    """The head's safetensors under Eagle3Head's names; the target's token embedding
    when the head has none of its own; identity d2t/t2d when the draft vocabulary is
    the whole one and the head stores neither."""

    layout: Eagle3Layout
    target: Checkpoint

    @property
    def directory(self) -> str:
        return self.layout.directory

    def tensors(
        self, shards=None, dropped=(), fused=None, vision=False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint.tensors' signature: a head is read whole, and has no tower."""
        assert shards is None and not dropped and fused is None and not vision
        stored = stored_names(self.directory)
        seen = {checkpoint_name(name) for name in stored}
        whole = self.layout.draft_vocab_size == self.layout.vocab_size
        needed = REQUIRED if whole else [*REQUIRED, "d2t", "t2d"]
        missing = [name for name in needed if checkpoint_name(name) not in seen]
        if missing:
            raise ValueError(f"EAGLE-3 head {self.directory!r} lacks {missing}")
        for name, tensor in Checkpoint(self.directory).tensors():
            yield checkpoint_name(name), tensor
        if EMBED not in seen:
            yield EMBED, read_tensor(self.target.directory, EMBED)
        if whole and "d2t" not in seen:
            yield "d2t", torch.zeros(self.layout.vocab_size, dtype=torch.long)
        if whole and "t2d" not in seen:
            yield "t2d", torch.ones(self.layout.vocab_size, dtype=torch.bool)


def _files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.safetensors")))


def stored_names(directory: str) -> list[str]:
    names: list[str] = []
    for path in _files(directory):
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return names


def read_tensor(directory: str, wanted: str) -> torch.Tensor:
    """One tensor of a checkpoint under a text model's name, read alone."""
    for path in _files(directory):
        with safe_open(path, framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if text_model_name(stored) == wanted:
                    return f.get_tensor(stored)
    raise ValueError(f"neither the EAGLE-3 head nor the target {directory!r} holds {wanted}")
