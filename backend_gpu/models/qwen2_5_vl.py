"""Qwen2.5-VL on the paged KV cache: a ViT over 14x14 patches (two frames to a temporal
patch) with 2D rotary positions, windowed attention in most blocks and full attention in
a few, a 2x2 patch merger into the language model's width; and Qwen2's decoder with
multimodal rotary positions (M-RoPE).

M-RoPE gives each token three positions, (temporal, height, width), and splits the
rotary frequencies into three sections, one per component (mrope_section). A text token
has the same three, so it rotates exactly as in a 1D rope at that position; an image's
tokens share one temporal position and take their row and column in the merged grid. The
text after an image continues from the image's largest position plus one, so a
sequence's rope position lags its index by a fixed `delta` from its last image on
(backend_gpu.multimodal computes the positions; the runner passes a [3, T] tensor where a
step holds image tokens, and otherwise 1D positions already shifted by the delta, which
decodes and their CUDA graphs take as they are).

The engine gives the model a step's image rows (`StepImages`): the vision tower's output
for those placeholder tokens replaces their embeddings. The tower runs one image at a
time (`encode_image`): attention never crosses images, so this equals transformers'
batched tower, and the engine caches its output per image (backend_gpu.encoder_cache).

Not supported: videos (the temporal grid beyond one frame), tensor and pipeline
parallelism, LoRA.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.layers import vocab_parallel
from backend_gpu.layers.attention import AttentionMetadata
from backend_gpu.layers.linear import LMHead, PackedLinear
from backend_gpu.layers.norm import RMSNorm
from backend_gpu.layers.rotary import RotaryEmbedding, rope_settings
from backend_gpu.models.llama import LlamaDecoderLayer, LlamaModel, head_dim_of


@dataclass
class StepImages:
    """A step's image rows: `embeds[i]` replaces the embedding of flat row `rows[i]`."""

    rows: torch.Tensor  # int64 [n]
    embeds: torch.Tensor  # [n, hidden]


def mrope_section(config) -> list[int]:
    """The rotary half-dimensions given to (t, h, w), from a v4 or v5 config."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None) or {}
        if params.get("mrope_section"):
            return list(params["mrope_section"])
    raise ValueError("config has no mrope_section (rope_scaling / rope_parameters)")


class MRotaryEmbedding(RotaryEmbedding):
    """The 1D table; positions [T] rotate as plain rope, positions [3, T] per section."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, section: list[int]):
        if 2 * sum(section) != head_dim:
            raise ValueError(f"mrope_section {section} does not cover head_dim {head_dim}")
        super().__init__(head_dim, max_positions, theta, None)
        self.section = list(section)
        self.register_buffer("component", torch.empty(0, dtype=torch.long), persistent=False)
        self.compute_tables()

    def compute_tables(self) -> None:
        """The tables, and which component (t, h, w) each rotary channel reads."""
        super().compute_tables()
        if hasattr(self, "section"):
            parts = [torch.full((s,), i % 3) for i, s in enumerate(self.section * 2)]
            self.component = torch.cat(parts).to(self.cos.device)

    def forward(self, positions, q, k):
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        index = self.component.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, index)[0].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].gather(0, index)[0].unsqueeze(1).to(q.dtype)
        half = q.shape[-1] // 2

        def rotate(x):
            return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos, sin) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate_vision(q, cos, sin), _rotate_vision(k, cos, sin)
        out = torch.empty_like(q)
        # windows of one length one after another (a row of windows but its last) go
        # through attention as one batch; no mask within a window (or the whole image)
        for start, length, count in _runs(cu_seqlens):
            end = start + length * count
            qs, ks, vs = (t[start:end].view(count, length, *t.shape[1:]) for t in (q, k, v))
            o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qs, ks, vs)))
            out[start:end] = o.transpose(1, 2).reshape(end - start, *q.shape[1:])
        return self.proj(out.reshape(n, -1))


def _runs(bounds: list[int]) -> list[tuple[int, int, int]]:
    """(start, length, count): the consecutive segments of equal length between bounds."""
    runs: list[tuple[int, int, int]] = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        length = end - start
        if length == 0:
            continue
        if runs and runs[-1][1] == length and runs[-1][0] + length * runs[-1][2] == start:
            runs[-1] = (runs[-1][0], length, runs[-1][2] + 1)
        else:
            runs.append((start, length, 1))
    return runs


def _rotate_vision(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary in float32, as the reference rotates the tower's q and k."""
    dtype, x = x.dtype, x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(dim, {"gate": hidden, "up": hidden}, True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)
        self.act = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh, "quick_gelu": _quick_gelu}[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(self.act(gate) * up)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


class VisionBlock(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.norm1 = RMSNorm(vc.hidden_size, 1e-6)
        self.norm2 = RMSNorm(vc.hidden_size, 1e-6)
        self.attn = VisionAttention(vc.hidden_size, vc.num_heads)
        self.mlp = VisionMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """2x2 neighbouring patches (adjacent rows of the tower's order) into one token."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = RMSNorm(dim, 1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel is its stride: a matmul over each flattened patch."""

    def __init__(self, vc) -> None:
        super().__init__()
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.proj = nn.Conv3d(vc.in_channels, vc.hidden_size, kernel, kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return patches.to(weight.dtype) @ weight.view(weight.shape[0], -1).t()


class VisionTransformer(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.window = vc.window_size // vc.spatial_merge_size // vc.patch_size
        self.full_attention = set(vc.fullatt_block_indexes)
        self.head_dim = vc.hidden_size // vc.num_heads
        self.patch_embed = PatchEmbed(vc)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.depth))
        self.merger = PatchMerger(vc.out_hidden_size, vc.hidden_size, vc.spatial_merge_size)

    def rotary(self, h: int, w: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [h*w, head_dim] of each patch's (row, column), in the tower's order
        (merge-units of 2x2 patches, row by row)."""
        m = self.merge
        rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        rows = rows.permute(0, 2, 1, 3).flatten()
        cols = cols.permute(0, 2, 1, 3).flatten()
        dim = self.head_dim // 2
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        freqs = torch.outer(torch.arange(max(h, w), dtype=torch.float), inv_freq)
        emb = torch.cat([freqs[rows], freqs[cols]], dim=-1)
        emb = torch.cat([emb, emb], dim=-1).to(device)
        return emb.cos(), emb.sin()

    def window_order(self, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """The merge-units in window order (windows of `window` x `window` units, row
        by row; edge windows smaller) and the windows' bounds in patches."""
        gh, gw, size = h // self.merge, w // self.merge, self.window
        order: list[torch.Tensor] = []
        bounds = [0]
        index = torch.arange(gh * gw).view(gh, gw)
        unit = self.merge * self.merge
        for r in range(0, gh, size):
            for c in range(0, gw, size):
                cell = index[r : r + size, c : c + size].flatten()
                order.append(cell)
                bounds.append(bounds[-1] + cell.numel() * unit)
        return torch.cat(order), bounds

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t*h*w, C*2*14*14] -> its tokens [t*h*w/4, out_hidden]."""
        t, h, w = grid
        if t != 1:
            raise NotImplementedError("videos are not supported")
        unit = self.merge * self.merge
        x = self.patch_embed(patches)
        order, windows = self.window_order(h, w)
        n = x.shape[0]
        x = x.view(n // unit, unit, -1)[order].reshape(n, -1)
        cos, sin = self.rotary(h, w, x.device)
        cos = cos.view(n // unit, unit, -1)[order].reshape(n, -1)
        sin = sin.view(n // unit, unit, -1)[order].reshape(n, -1)
        whole = [0, n]
        for i, block in enumerate(self.blocks):
            x = block(x, whole if i in self.full_attention else windows, cos, sin)
        return self.merger(x)[torch.argsort(order)]


class Qwen2_5_VLTextModel(LlamaModel):
    """Qwen2's decoder whose embeddings at a step's image rows are the tower's output."""

    def forward(self, input_ids, positions, meta, images: StepImages | None = None):
        x = self.embed(input_ids)
        if images is not None:
            x = x.index_copy(0, images.rows, images.embeds.to(x.dtype))
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)


class Qwen2_5_VLForConditionalGeneration(nn.Module):
    """`config`: the text model's config, with the whole model's vision_config and
    image token ids beside it (loader.open_model puts them there)."""

    vision = True
    mrope = True
    supports_lora = False

    def __init__(self, config, tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError("Qwen2.5-VL under tensor parallelism is not supported yet")
        text = copy.copy(config)
        text.qkv_bias = True  # Qwen2's q, k, v biases (its model type is not "qwen2")
        theta, _ = rope_settings(config)
        rotary = MRotaryEmbedding(
            head_dim_of(config), config.max_position_embeddings, theta, mrope_section(config)
        )
        self.model = Qwen2_5_VLTextModel(text, tp, LlamaDecoderLayer, rotary)
        self.visual = VisionTransformer(config.vision_config)
        self.image_token_id = config.image_token_id
        self.lm_head = LMHead(config.hidden_size, self.model.vocab.rows)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.step_images: StepImages | None = None  # set by the runner around a step

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The hub's `visual.*` and transformers 5's `model.visual.*` are the tower."""
        return name.removeprefix("model.") if name.startswith("model.visual.") else name

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta, self.step_images)

    def encode_image(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's placeholder embeddings [tokens, hidden] from its patches."""
        weight = self.visual.patch_embed.proj.weight
        return self.visual(patches.to(weight.device, weight.dtype), grid)

    def image_input_like(self, grid: tuple[int, int, int], device) -> torch.Tensor:
        """Random patches of an image of `grid` (the memory profile encodes one)."""
        t, h, w = grid
        width = self.visual.patch_embed.proj.weight[0].numel()  # 3 x 2 x 14 x 14
        return torch.randn(t * h * w, width, device=device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return vocab_parallel.gather_logits(self.lm_head(hidden), self.model.vocab, self.model.tp)
