"""An EAGLE-3 head as plain torch modules, trained the way EAGLE-3 trains it: the
training-time test (Li et al. 2025, section 3.2).

The head's parameters carry the published names (fc, midlayer.*, norm, lm_head), so
`save_head` writes the layout SpecForge writes and the engine reads
(backend_gpu/spec_decode/eagle3_head.py; the engine's paged version of the same math).

Training-time test: step 0 reads the target's fused hidden states at every position t
with token t + 1 and predicts what the target predicts at t + 1; step j reads, for the
same anchor t, the head's own output of step j - 1 with token t + j + 1, at position
t + j, and attends to step 0's keys up to t and to its own chain's keys of steps 1..j
(the diagonal), as a chain proposed at t would at inference.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

ROPE_THETA = 10_000.0


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = ROPE_THETA) -> torch.Tensor:
    """Rotary embedding, halves rotated (Llama's, as the engine's RotaryEmbedding)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[..., None] * inv  # [T, d/2], or [B, T, d/2] per row
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    if positions.dim() == 2:  # x [B, heads, T, d]
        cos, sin = cos[:, None], sin[:, None]
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """[B, T, 2H] -> q [B, heads, T, d], k and v [B, heads, T, d] (kv repeated)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        return (rotate(q, positions), *self.kv(x, positions))

    def kv(self, x: torch.Tensor, positions: torch.Tensor):
        """[B, T, 2H] -> k and v [B, heads, T, d] (kv repeated)."""
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return rotate(k, positions), v


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.hidden_norm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.self_attn = Attention(h, heads, kv, cfg["head_dim"])
        self.mlp = MLP(h, cfg["intermediate_size"])


class Eagle3TTT(nn.Module):
    """The head (published names) and its training-time-test forward."""

    def __init__(self, cfg: dict, embed: torch.Tensor) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.cfg = cfg
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = nn.RMSNorm(h, eps=cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)
        self.register_buffer("embed", embed, persistent=False)  # the target's, frozen

    def forward(
        self, ids: torch.Tensor, aux: torch.Tensor, steps: int, rows: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """ids [B, T] tokens, aux [B, T, 3H] the target's hidden states -> per step j the
        draft logits [B, T, draft vocab] at anchor t, predicting the target's choice at
        t + j + 1 (token t + j + 1 read as input; ids past the end are padding). With
        `rows` ([B, T] bool), the logits of those anchors only: [rows.sum(), vocab]; the
        chains are then run from those anchors alone (step 0's keys and values at every
        position), the same figures at a fraction of the cost where few are asked."""
        m = self.midlayer
        b, t = ids.shape
        hidden = self.fc(aux)
        batch = torch.arange(b)[:, None]
        if rows is None:
            anchors = torch.arange(t).expand(b, t)  # [B, A]: every position
            kept = torch.ones(b, t, dtype=torch.bool)
        else:  # each row's anchors first, in order, then filler (left out at the end)
            counts = rows.sum(1)
            a = max(int(counts.max()), 1) if b else 1
            anchors = torch.argsort((~rows).to(torch.int8), dim=1, stable=True)[:, :a]
            kept = torch.arange(a)[None, :] < counts[:, None]
        # step 0's keys and values at every position
        x = torch.cat([m.input_layernorm(self.embed[ids.roll(-1, 1)]), m.hidden_norm(hidden)], -1)
        keys, values = map(list, zip(m.self_attn.kv(x, torch.arange(t)), strict=True))
        x, hidden = x[batch, anchors], hidden[batch, anchors]  # the anchors' own [B, A, .]
        causal = (torch.arange(t)[None, None, :] <= anchors[:, :, None])[:, None]  # step 0's
        scale = m.self_attn.head_dim**-0.5
        out = []
        for j in range(steps):
            if j:  # token t + j + 1 at anchor t (wrapping at the end as a roll would)
                token = ids[batch, (anchors + j + 1) % t]
                x = torch.cat([m.input_layernorm(self.embed[token]), m.hidden_norm(hidden)], -1)
                q, k, v = m.self_attn.qkv(x, anchors + j)
                keys.append(k)
                values.append(v)
            else:
                heads, d = m.self_attn.heads, m.self_attn.head_dim
                q = m.self_attn.q_proj(x).view(b, -1, heads, d).transpose(1, 2)
                q = rotate(q, anchors)
            scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
            scores += [(q * kj).sum(-1, keepdim=True) * scale for kj in keys[1:]]
            probs = torch.cat(scores, dim=-1).softmax(-1)
            o = probs[..., :t] @ values[0]
            for i, vi in enumerate(values[1:]):
                o = o + probs[..., t + i : t + i + 1] * vi
            o = o.transpose(1, 2).reshape(b, anchors.shape[1], -1)
            x = hidden + m.self_attn.o_proj(o)
            hidden = x + m.mlp(m.post_attention_layernorm(x))
            out.append(self.lm_head(self.norm(hidden if rows is None else hidden[kept])))
        return out


def learning_rate(peak: float, done: float, schedule: str) -> float:
    """The optimizer's rate at `done` (0 to 1) of the run: `constant`, or `cosine` from
    `peak` down to 0 at the end (SpecForge's schedule, less its warmup): the last steps
    settle the head at what the data support instead of stepping about it."""
    if schedule == "constant":
        return peak
    return peak * 0.5 * (1 + math.cos(math.pi * min(max(done, 0.0), 1.0)))


def head_config(target_config, draft_vocab: int, aux_layers: list[int], nested: bool) -> dict:
    """config.json of a head for `target_config` (a transformers config)."""
    t = target_config
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    layers = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": ROPE_THETA,
        "max_position_embeddings": t.max_position_embeddings,
        "vocab_size": t.vocab_size,
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **({"eagle_config": layers} if nested else layers),
    }


def save_head(directory: str, head: Eagle3TTT, draft_ids: torch.Tensor, vocab: int) -> None:
    """The published layout: config.json, and model.safetensors with fc, midlayer.*,
    norm, lm_head, d2t (target id - draft id) and t2d (the draft vocabulary's mask);
    no embed_tokens (the engine reads the target's)."""
    os.makedirs(directory, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(head.cfg, f, indent=2)
