"""GGUF files: read with the `gguf` package, dequantized, converted once into an HF-style
directory (config, tokenizer, safetensors) cached on disk under the file's hash.

Tensors are dequantized one at a time and written out in files of at most
FILE_BYTES, so the conversion never holds the whole float32 model; a tensor-parallel
rank then reads only its slices of them (loader.py).

The first start shows a progress bar and takes a while (the tokenizer of a large
vocabulary is slow to convert); later starts load the cached directory in seconds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import numpy as np
import torch
from filelock import FileLock
from safetensors.torch import save_file
from tqdm.auto import tqdm

FILE_BYTES = 1 << 30  # float32 bytes per converted safetensors file
# GGUF architecture -> (HF architecture, HF model_type)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# checkpoint names of one decoder layer, relative to "model.layers.{i}."
LAYER_TENSORS = [
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


def cache_root() -> str:
    return os.environ.get(
        "KVGATE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "kvgate")
    )


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(path: str) -> str:
    """The cached HF-style directory of a GGUF file, converting it the first time."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    target = os.path.join(cache_root(), "gguf", file_digest(path))
    if os.path.exists(os.path.join(target, "config.json")):  # renamed into place whole
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    # one conversion of a file at a time: a second process (a tensor-parallel rank, a
    # second engine, a test worker) waits for the first's and loads what it wrote. The OS
    # drops the lock of a process that dies, so a crashed conversion blocks nobody.
    with FileLock(f"{target}.lock"):
        if not os.path.exists(os.path.join(target, "config.json")):
            _convert(path, target)
    return target


def _convert(path: str, target: str) -> None:
    work = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".converting-")
    try:
        with tqdm(total=3, desc=f"converting {os.path.basename(path)}", unit="stage") as bar:
            config = _save_config_and_tokenizer(path, work)
            bar.update(1)
            _save_in_files(_dequantized_tensors(path, config), work)
            bar.update(2)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(work, target)  # atomic: a half-written cache is never found
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _save_config_and_tokenizer(path: str, out_dir: str):
    from transformers import AutoConfig, AutoTokenizer

    directory, name = os.path.split(os.path.abspath(path))
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    gguf_arch = "gemma3" if config.model_type == "gemma3_text" else config.model_type
    if gguf_arch not in ARCHITECTURES:
        raise NotImplementedError(f"GGUF architecture {gguf_arch!r} is not supported")
    config.architectures = [ARCHITECTURES[gguf_arch]]
    config.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out_dir)
    return config


def _save_in_files(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: str) -> None:
    """Write (name, tensor) pairs as model-00001.safetensors, ... of at most FILE_BYTES
    each (a larger tensor alone in its file)."""
    batch: dict[str, torch.Tensor] = {}
    size = files = 0

    def flush() -> None:
        nonlocal size, files
        files += 1
        save_file(batch, os.path.join(out_dir, f"model-{files:05d}.safetensors"))
        batch.clear()
        size = 0

    for name, tensor in tensors:
        if batch and size + tensor.nbytes > FILE_BYTES:
            flush()
        batch[name] = tensor
        size += tensor.nbytes
    if batch:
        flush()


def _dequantized_tensors(path: str, config) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import MODEL_ARCH_NAMES, GGUFReader, dequantize, get_tensor_name_map

    reader = GGUFReader(path)
    gguf_arch = "gemma3" if config.model_type == "gemma3_text" else config.model_type
    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == gguf_arch)
    name_map = get_tensor_name_map(arch, config.num_hidden_layers)
    hf_names = ["model.embed_tokens", "model.norm", "lm_head"] + [
        f"model.layers.{i}.{t}" for i in range(config.num_hidden_layers) for t in LAYER_TENSORS
    ]
    gguf_to_hf = {}
    for hf_name in hf_names:
        gguf_name = name_map.get_name(hf_name)
        if gguf_name is not None:
            gguf_to_hf[gguf_name] = hf_name
    for tensor in tqdm(reader.tensors, desc="dequantizing", leave=False):
        base, _, suffix = tensor.name.rpartition(".")
        if base not in gguf_to_hf:
            raise ValueError(f"unexpected GGUF tensor {tensor.name}")
        hf_name = f"{gguf_to_hf[base]}.{suffix}"
        weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weights = weights.reshape([int(d) for d in reversed(tensor.shape)])
        if gguf_arch == "llama" and base.endswith(("attn_q", "attn_k")):
            heads = (
                config.num_attention_heads
                if base.endswith("attn_q")
                else config.num_key_value_heads
            )
            weights = _unpermute_rotary(weights, heads)
        if gguf_arch == "gemma3" and base.endswith("norm"):
            weights = weights - 1  # llama.cpp stores Gemma's norm weights as 1 + w
        yield hf_name, torch.from_numpy(np.ascontiguousarray(weights))


def _unpermute_rotary(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's rotary halves for Llama; undo it."""
    half = weights.shape[0] // heads // 2
    w = weights.reshape(heads, half, 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)
