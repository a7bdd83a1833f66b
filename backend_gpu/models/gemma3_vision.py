"""Gemma 3's vision (4B-27B as published, Gemma3ForConditionalGeneration): a SigLIP tower
over one square image (896x896 in 14x14 patches), the projector that average-pools its
patches to mm_tokens_per_image soft tokens (4x4 pools: 256), norms them (Gemma's RMS
norm) and projects them to the text model's width, and Gemma 3's text model, whose
embeddings at a step's image rows are those soft tokens (unscaled, as transformers puts
them after the embedding's scale).

The text model attends causally except among one image's soft tokens, which see each
other both ways (transformers builds this mask from token_type_ids; in the sliding
layers the window still applies to earlier keys). The engine does the same inside its
paged attention: a step's image rows see up to their image's last token
(AttentionMetadata.key_last, backend_gpu.multimodal), and an image's tokens are always
computed in one prefill chunk (a chunk never ends inside an image), so the keys they
see ahead exist in that chunk.

Settings the vision path does not take (tensor or pipeline parallelism, speculative
decoding, LoRA) serve the text model alone, as before (`text_model`,
multimodal.check_vision_settings), rather than being refused.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from backend_gpu.distributed import SINGLE, ParallelGroup
from backend_gpu.layers.attention import AttentionMetadata
from backend_gpu.layers.linear import PackedLinear, embedding
from backend_gpu.layers.norm import RMSNorm
from backend_gpu.models.gemma3 import Gemma3ForCausalLM
from backend_gpu.models.qwen2_5_vl import StepImages

# checkpoint prefixes of the tower -> ours: the hub's, transformers 4's and 5's layouts
TOWER_PREFIXES = (
    "model.vision_tower.vision_model.",
    "vision_tower.vision_model.",
    "model.vision_tower.",
    "vision_tower.",
)
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class SiglipAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv_proj = PackedLinear(dim, {"q": dim, "k": dim, "v": dim}, True)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (
            t.view(n, self.num_heads, -1).transpose(0, 1)
            for t in self.qkv_proj.split(self.qkv_proj(x))
        )
        out = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]  # no mask
        return self.out_proj(out.transpose(0, 1).reshape(n, -1))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        dim = vc.hidden_size
        self.layer_norm1 = nn.LayerNorm(dim, eps=vc.layer_norm_eps)
        self.self_attn = SiglipAttention(dim, vc.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(dim, eps=vc.layer_norm_eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, vc.intermediate_size)
        self.mlp.fc2 = nn.Linear(vc.intermediate_size, dim)
        if vc.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise NotImplementedError(f"SigLIP activation {vc.hidden_act!r} is not supported")
        self.act = partial(F.gelu, approximate="tanh" if vc.hidden_act.endswith("tanh") else "none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class SiglipVisionTower(nn.Module):
    """Patches (a strided convolution) plus learned positions, the encoder, a layer norm."""

    def __init__(self, vc) -> None:
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(
            vc.num_channels, vc.hidden_size, vc.patch_size, vc.patch_size
        )
        patches = (vc.image_size // vc.patch_size) ** 2
        self.embeddings.position_embedding = embedding(patches, vc.hidden_size)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            SiglipEncoderLayer(vc) for _ in range(vc.num_hidden_layers)
        )
        self.post_layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image [3, S, S] -> its patches' states [(S / patch)^2, hidden]."""
        conv = self.embeddings.patch_embedding
        x = conv(pixels[None].to(conv.weight.dtype)).flatten(2)[0].t()
        x = x + self.embeddings.position_embedding.weight
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3MultiModalProjector(nn.Module):
    """Average pools of kernel x kernel patches, Gemma's RMS norm, a projection."""

    def __init__(self, config) -> None:
        super().__init__()
        vc = config.vision_config
        self.side = vc.image_size // vc.patch_size
        tokens_side = int(config.mm_tokens_per_image**0.5)
        if tokens_side**2 != config.mm_tokens_per_image or self.side % tokens_side:
            raise ValueError(
                f"mm_tokens_per_image {config.mm_tokens_per_image} is not a square that "
                f"divides the tower's {self.side}x{self.side} patches"
            )
        self.kernel = self.side // tokens_side
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vc.hidden_size, config.hidden_size)
        )
        self.mm_soft_emb_norm = RMSNorm(vc.hidden_size, vc.layer_norm_eps, offset=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[side^2, vision hidden] -> [mm_tokens_per_image, text hidden]."""
        grid = x.t().reshape(1, x.shape[1], self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2)[0].t()
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3VisionForConditionalGeneration(Gemma3ForCausalLM):
    """`config`: the text model's config, with the whole model's vision_config,
    mm_tokens_per_image and image token ids beside it (loader.text_config_of)."""

    vision = True
    mrope = False
    bidirectional_images = True  # an image's tokens see each other (module docstring)
    reads_vision_tower = True  # loader: the checkpoint's tower and projector are read
    supports_lora = False
    text_model = "Gemma3ForCausalLM"  # what serves the text where images cannot go

    def __init__(self, config, tp: ParallelGroup = SINGLE) -> None:
        if tp.size > 1:
            raise ValueError("Gemma 3's vision under tensor parallelism is not supported yet")
        super().__init__(config, tp)
        self.vision_tower = SiglipVisionTower(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.image_token_id = config.image_token_id
        self.step_images: StepImages | None = None  # set by the runner around a step

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The tower's and projector's tensors under our names, in any known layout;
        None for the SigLIP pooling head (Gemma 3 reads the patches, never the head)."""
        for prefixes, ours in (
            (TOWER_PREFIXES, "vision_tower."),
            (PROJECTOR_PREFIXES, "multi_modal_projector."),
        ):
            for prefix in prefixes:
                if name.startswith(prefix):
                    name = ours + name[len(prefix) :]
                    return None if name.startswith("vision_tower.head.") else name
        return name

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        images = self.step_images
        if images is None:
            return self.model(input_ids, positions, meta)
        x = self.model.embed(input_ids)
        x = x.index_copy(0, images.rows, images.embeds.to(x.dtype))
        for layer in self.model.layers:
            x = layer(positions, x, meta)
        return self.model.norm(x)

    def encode_image(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's soft tokens [mm_tokens_per_image, hidden] from its pixels [3, S, S]
        (`grid`: the tower's (1, S / patch, S / patch), which every image has)."""
        weight = self.vision_tower.embeddings.patch_embedding.weight
        states = self.vision_tower(pixels.to(weight.device, weight.dtype))
        return self.multi_modal_projector(states)

    def image_input_like(self, grid: tuple[int, int, int], device) -> torch.Tensor:
        """Random pixels of the tower's input shape (the memory profile encodes one)."""
        side = grid[1] * self.vision_tower.embeddings.patch_embedding.kernel_size[0]
        return torch.randn(3, side, side, device=device)
