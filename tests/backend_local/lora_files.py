"""GGUF LoRA adapters for the llama.cpp engine's tests, written with the gguf package as
llama.cpp's convert_lora_to_gguf.py writes them: general.type "adapter", adapter.type
"lora", adapter.lora.alpha, and for each target weight of shape [n_in, n_out] (ggml's
order) a `.lora_a` of [n_in, rank] and a `.lora_b` of [rank, n_out] (numpy arrays the
other way round, as PEFT's lora_A and lora_B)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from backend_local.model import LlamaModel

TARGETS = ("attn_q", "attn_v", "ffn_up")


def model_shapes(model: LlamaModel, targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """{tensor name: (n_in, n_out)} of the model's target weights, every layer, from its
    metadata (gguf's reader takes seconds over a vocabulary)."""
    arch = model.architecture

    def meta(key: str) -> int:
        return int(model.meta(f"{arch}.{key}"))

    embd, ff = meta("embedding_length"), meta("feed_forward_length")
    q = meta("attention.head_count") * meta("attention.key_length")
    k = meta("attention.head_count_kv") * meta("attention.key_length")
    v = meta("attention.head_count_kv") * meta("attention.value_length")
    o = meta("attention.head_count") * meta("attention.value_length")
    shapes = {
        "attn_q": (embd, q),
        "attn_k": (embd, k),
        "attn_v": (embd, v),
        "attn_output": (o, embd),
        "ffn_up": (embd, ff),
        "ffn_gate": (embd, ff),
        "ffn_down": (ff, embd),
    }
    return {f"blk.{i}.{t}.weight": shapes[t] for i in range(meta("block_count")) for t in targets}


def write_lora(
    path: Path,
    model: LlamaModel,
    seed: int,
    rank: int = 8,
    std: float = 0.03,
    targets: tuple[str, ...] = TARGETS,
    architecture: str = "gemma3",
    general_type: str = "adapter",
) -> str:
    """A random GGUF LoRA for `model` (seeded); its path as a str. The default `std`
    changes Gemma 3 270M's greedy text and keeps it text (0.1 makes it noise, where
    near-ties are everywhere)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_string("general.type", general_type)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    for name, (n_in, n_out) in model_shapes(model, targets).items():
        a = rng.standard_normal((rank, n_in)) * std
        b = rng.standard_normal((n_out, rank)) * std
        writer.add_tensor(f"{name}.lora_a", a.astype(np.float32))
        writer.add_tensor(f"{name}.lora_b", b.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def write_peft_dir(path: Path) -> str:
    """A directory in PEFT's layout (its weights left empty: only its form matters)."""
    path.mkdir()
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return str(path)
