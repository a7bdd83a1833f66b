"""gpt-oss checkpoints in MXFP4 as published, written from a 16-bit one: its experts
quantized by the OCP Microscaling rule (each group of 32 values shares the power of two
2^(floor(log2(max |x|)) - 2), E2M1's largest value being 1.5 * 2^2; each value rounded to
the nearest E2M1 value, 6 at most), stored as `*_blocks` [E, rows, groups, 16] (two codes
a byte, low nibble first) and `*_scales` [E, rows, groups] (exponent + 127), rows being
a linear layer's outputs; the rest of the checkpoint as it was, and its config's
`quantization_config` the published one."""

from __future__ import annotations

import glob
import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from backend_gpu.quantization.mxfp4 import E2M1_VALUES, GROUP, SCALE_BIAS

# openai/gpt-oss-20b's and -120b's config.json
PUBLISHED_QUANTIZATION = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of weight [..., rows, cols] (cols a multiple of 32)."""
    groups = weight.float().unflatten(-1, (-1, GROUP))
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, -SCALE_BIAS)
    exponent = exponent.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exponent)[..., None]
    grid = torch.tensor(E2M1_VALUES)
    magnitude = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1)  # nearest, 6 at most
    codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)


def write_mxfp4_checkpoint(source: str, target: str) -> str:
    """`source`'s gpt-oss checkpoint (16-bit experts, transformers' [E, inputs, outputs])
    with its experts in MXFP4, at `target`."""
    os.makedirs(target, exist_ok=True)
    tensors = {}
    for path in sorted(glob.glob(os.path.join(source, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = f.get_tensor(name)
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))
                    tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
                else:
                    tensors[name] = tensor
    save_file(tensors, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(source):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(source, name), target)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = PUBLISHED_QUANTIZATION
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return target
