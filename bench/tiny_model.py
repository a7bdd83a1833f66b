"""A small random Llama with a word-level tokenizer, built locally from a transformers
config and seeded weights: the ladder's "engine on a small random model" (no downloads).

The weights are written straight to safetensors under the HF Llama names, normal(0, 0.02)
like HF's initializer, which spares importing the transformers model code."""

from __future__ import annotations

import math
from pathlib import Path

from bench.datasets import WORDS

SPECIALS = ["<unk>", "<s>", "</s>"]


def build_tiny_llama(
    out_dir: str | Path,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    vocab_size: int | None = None,
    max_position_embeddings: int = 4096,
) -> Path:
    """Write config, safetensors weights and tokenizer into out_dir; returns it. The vocabulary
    is the dataset's words, padded with `w<i>` tokens up to `vocab_size` when given."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    tokens = [*SPECIALS, *WORDS]
    tokens += [f"w{i}" for i in range(len(tokens), vocab_size or len(tokens))]
    vocab = {token: i for i, token in enumerate(tokens)}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    generator = torch.Generator().manual_seed(seed)
    head_dim = hidden_size // num_heads
    shapes = {
        "model.embed_tokens.weight": (len(vocab), hidden_size),
        "model.norm.weight": (hidden_size,),
        "lm_head.weight": (len(vocab), hidden_size),
    }
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden_size,),
            f"{layer}.post_attention_layernorm.weight": (hidden_size,),
            f"{layer}.self_attn.q_proj.weight": (num_heads * head_dim, hidden_size),
            f"{layer}.self_attn.k_proj.weight": (num_kv_heads * head_dim, hidden_size),
            f"{layer}.self_attn.v_proj.weight": (num_kv_heads * head_dim, hidden_size),
            f"{layer}.self_attn.o_proj.weight": (hidden_size, num_heads * head_dim),
            f"{layer}.mlp.gate_proj.weight": (2 * hidden_size, hidden_size),
            f"{layer}.mlp.up_proj.weight": (2 * hidden_size, hidden_size),
            f"{layer}.mlp.down_proj.weight": (hidden_size, 2 * hidden_size),
        }
    weights = {
        name: torch.ones(shape)
        if len(shape) == 1
        else torch.randn(shape, generator=generator) * 0.02
        for name, shape in shapes.items()
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def parameter_count(model_dir: str | Path) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
