"""A tiny random Llama that often has nothing to say: its head's rows for `</s>` and
`<unk>` are scaled up, so for some prompts it stops at once and for others it emits only
special tokens, which decode to no text (issue 45: a reply is not a failure for that)."""

from pathlib import Path

from bench.tiny_model import build_tiny_llama

SILENT_TOKENS = [0, 2]  # <unk>, </s> in the tiny model's vocabulary


def build_silent_llama(out_dir: Path) -> Path:
    """The tune test's tiny model (hidden 64, two layers, seed 0), its special tokens'
    logits tripled: greedy, several of bench's 20 random 8-word prompts (seed 0) stop
    at once and others say only `<unk>`, on either API."""
    from safetensors.torch import load_file, save_file

    model = build_tiny_llama(out_dir, hidden_size=64, num_layers=2)
    weights = load_file(model / "model.safetensors")
    weights["lm_head.weight"][SILENT_TOKENS] *= 3
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    return model
