"""The embedding models and texts the engine's and the gateway's embedding tests share,
kept free of sentence-transformers and the MiniLM package so the CUDA check (a machine
with neither) can build them too."""

from __future__ import annotations

import json
import os

import torch
from transformers import AutoModel, Qwen3Config

from tests.backend_gpu.tiny_models import VOCAB, build_tokenizer

TEXTS = [
    "Hello",
    "  The Quick Brown Fox jumps over the lazy dog.  ",
    "Paged attention stores keys and values in fixed-size blocks; continuous batching "
    "lets requests join and leave at every step. " * 6,
    "Un café très chaud, s'il vous plaît. 日本語のテキスト。",
]


def close_to(ours: list[list[float]], reference: torch.Tensor) -> None:
    ours_t = torch.tensor(ours)
    assert ours_t.shape == reference.shape
    assert (ours_t - reference).abs().max().item() <= 1e-4
    cosine = torch.nn.functional.cosine_similarity(ours_t, reference, dim=1)
    assert cosine.min().item() >= 0.9999


def save_tiny_qwen3_embedding(path: str) -> str:
    """A tiny seeded Qwen3 decoder saved at `path` as Qwen3-Embedding is (the bare
    decoder's tensor names, no LM head) with sentence-transformers' last-token pooling."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=3,
        eos_token_id=2,
        initializer_range=0.2,
        architectures=["Qwen3ForCausalLM"],
    )
    AutoModel.from_config(config, dtype=torch.float32).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{kind}"}
        for i, (p, kind) in enumerate(kinds)
    ]
    pooling = {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True}
    os.makedirs(os.path.join(path, "1_Pooling"))
    for name, value in [
        ("modules.json", modules),
        ("1_Pooling/config.json", pooling),
        ("sentence_bert_config.json", {"max_seq_length": 128, "do_lower_case": False}),
    ]:
        with open(os.path.join(path, name), "w") as f:
            json.dump(value, f)
    return path
