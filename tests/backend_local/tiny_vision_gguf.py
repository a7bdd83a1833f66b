"""A tiny seeded random Gemma 3 vision-language model as llama.cpp serves one: its text
model as a GGUF (gguf_families.write_gguf) and its vision tower and projector as an
mmproj GGUF written by llama.cpp's own converter (`convert_hf_to_gguf.py --mmproj`).

The converter lives in llama.cpp's source tree, which the installed wheel does not carry:
it is taken from the llama-cpp-python sdist of the installed version, the one
studies/build_llama_server.sh builds llama-server from (.cache/llama-server/sdist,
fetched with pip once if missing: a package registry, never a model hub), and runs on
the checkpoint with its own gguf-py. The model: gguf_families' Gemma 3 (6 layers, a
SigLIP tower of one block on 32x32 images of 8x8 patches, pooled to 4 tokens), its
vocabulary with Gemma's image tokens as special tokens, and a chat template that writes
each message's text as it is (so a content list and its joined text render alike)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import llama_cpp
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tests.backend_gpu.tiny_models import build_tokenizer
from tests.backend_local.gguf_families import _config, write_gguf

ROOT = Path(__file__).resolve().parents[2]
SDIST_DIR = ROOT / ".cache" / "llama-server" / "sdist"
# Token embeddings 10x smaller than the layers' weights, and a head of its own: a tied
# random Gemma at gguf_families' scale mostly repeats the prompt's last token whatever
# came before it (its own embedding dominates the logits), and a chat's last token is
# the template's, so no picture would change an answer; here the layers' mix of the
# context (the image's tokens among it) decides, with logit gaps wide enough for greedy.
EMBEDDING_SCALE = 0.1
IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py of the installed llama-cpp-python's sdist,
    unpacked (with its conversion package and gguf-py) once into .cache."""
    version = llama_cpp.__version__
    out = ROOT / ".cache" / "llama-server" / f"convert-{version}"
    script = out / "convert_hf_to_gguf.py"
    if script.exists():
        return script
    sdist = SDIST_DIR / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        pip = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}"]
        pip += ["--no-deps", "--no-binary", "llama-cpp-python", "-d", str(SDIST_DIR)]
        subprocess.run(pip, check=True, capture_output=True, timeout=600)
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    partial = out.with_name(out.name + ".partial")
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            rest = member.name.removeprefix(prefix)
            if rest != member.name and rest.startswith(wanted) and member.isfile():
                member.name = rest
                members.append(member)
        tar.extractall(partial, members=members, filter="data")
    partial.rename(out)
    return script


def save_checkpoint(directory: str) -> str:
    """The tiny Gemma 3 checkpoint with its tokenizer, template and processor config."""
    path = os.path.join(directory, "tiny-gemma3-vision")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = TEMPLATE
    ids = [tokenizer.convert_tokens_to_ids(t) for t in IMAGE_TOKENS]
    config = _config("gemma3_mm")
    config.boi_token_index, config.eoi_token_index, config.image_token_index = ids
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # (the tied head reads it too; see EMBEDDING_SCALE)
        model.get_input_embeddings().weight.mul_(EMBEDDING_SCALE)
        # transformers starts the projector at zero (every image the same zero tokens)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.1)
        # and the head at the outer config's 0.02 (logits within a few hundredths)
        model.get_output_embeddings().weight.normal_(0, 0.5)
    model.save_pretrained(path)
    _published_layout(os.path.join(path, "model.safetensors"))
    tokenizer.save_pretrained(path)
    vision = config.vision_config
    processor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"height": vision.image_size, "width": vision.image_size},
        "image_seq_length": config.mm_tokens_per_image,
    }
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f)
    return path


def _published_layout(weights: str) -> None:
    """The vision tower's tensors under the names Google's checkpoints give them (and
    the converter maps): `vision_tower.vision_model.*`, without the SigLIP head that
    transformers' tower has and the published model does not."""
    with safe_open(weights, framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith("vision_tower.head."):
            continue
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        renamed[name] = tensor
    save_file(renamed, weights, metadata={"format": "pt"})


def write_vision_gguf(directory: str) -> tuple[str, str]:
    """(text model GGUF, mmproj GGUF) of the tiny model, made in `directory`."""
    checkpoint = save_checkpoint(directory)
    text = os.path.join(directory, "tiny-gemma3-vision.gguf")
    mmproj = os.path.join(directory, "mmproj-tiny-gemma3-vision.gguf")
    if not os.path.exists(text):
        write_gguf(checkpoint, text, add_bos=True)
    if not os.path.exists(mmproj):
        script = converter()
        # (the script puts its own gguf-py first on the path, not the installed gguf)
        cmd = [sys.executable, str(script), checkpoint, "--mmproj", "--outtype", "f32"]
        cmd += ["--outfile", mmproj]
        subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    return text, mmproj
