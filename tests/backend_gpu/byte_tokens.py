"""A tiny model whose byte-fallback tokens are ordinary tokens.

The shared tiny tokenizer (tiny_models.py) registers its `<0x7B>` tokens as special, so
decoding skips them and a grammar library reads them as specials: JSON's braces and
quotes, which it spells with them, would vanish from the text. Structured-output tests
use this copy, whose byte tokens decode to their bytes, as real tokenizers' do, and
whose context is longer (2048 positions): tool prompts run to hundreds of tokens with a
384-token vocabulary."""

from __future__ import annotations

import json
import os
import re
import shutil

from tests.backend_gpu.tiny_models import save_tiny_model

BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


def save_byte_token_model(arch: str, directory: str) -> str:
    """The tiny `arch` model in `directory`, its byte tokens no longer added tokens."""
    path = os.path.join(directory, f"tiny-{arch}-bytes")
    if os.path.exists(path):
        return path
    shutil.copytree(save_tiny_model(arch, directory), path)
    tok_path = os.path.join(path, "tokenizer.json")
    with open(tok_path) as f:
        tok = json.load(f)
    tok["added_tokens"] = [t for t in tok["added_tokens"] if not BYTE_TOKEN.fullmatch(t["content"])]
    with open(tok_path, "w") as f:
        json.dump(tok, f)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    added = cfg.get("added_tokens_decoder", {})
    cfg["added_tokens_decoder"] = {
        k: v for k, v in added.items() if not BYTE_TOKEN.fullmatch(v["content"])
    }
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["max_position_embeddings"] = 2048
    with open(config_path, "w") as f:
        json.dump(config, f)
    return path
