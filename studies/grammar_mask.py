"""Token-mask time per decode step of the two grammar libraries on PyPI with CPU wheels,
xgrammar and llguidance, on the default model's vocabulary (Gemma 3, 262k tokens).

    python -m studies.grammar_mask [--steps-repeat 5]

A moderate JSON schema (nested object, array, enum, bounded integer, required fields)
and a document valid for it: each library compiles the schema (timed, cold), then walks
the document's tokens, each step computing the next-token bitmask (timed) and accepting
the token. This is the work constrained decoding adds to every step of a constrained
row; the engine picks its library by it (docs/PERF.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.options import DefaultsHelpFormatter

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "address": {"city": "London", "zip": "W1J 7NT"},
    "tags": ["mathematics", "engines", "poetry", "analysis"],
    "score": 97.5,
}


def gemma_tokenizer():
    from transformers import AutoTokenizer

    from backend_gpu.gguf_loader import convert_gguf
    from gateway.backends.default_model import default_model_path

    return AutoTokenizer.from_pretrained(convert_gguf(str(default_model_path())))


def run_xgrammar(tokenizer, vocab: int, tokens: list[int]) -> tuple[float, list[float]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - start
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for token in tokens:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - start)
        assert matcher.accept_token(token), token
    return compile_s, times


def run_llguidance(tokenizer, vocab: int, tokens: list[int]) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA),
        defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    )
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - start
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times = []
    for token in tokens:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        times.append(time.perf_counter() - start)
        assert matcher.consume_token(token), (token, matcher.get_error())
    return compile_s, times


def apply_time(vocab: int, repeat: int = 200) -> float:
    """Applying a bitmask to one row of float32 logits on the CPU (xgrammar's kernel)."""
    import xgrammar as xgr

    logits = torch.randn(1, vocab)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    start = time.perf_counter()
    for _ in range(repeat):
        xgr.apply_token_bitmask_inplace(logits, bitmask)
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="walks of the document per library")
    args = parser.parse_args()
    tokenizer = gemma_tokenizer()
    vocab = len(tokenizer)
    text = json.dumps(DOCUMENT)  # separators ", " and ": ", as both libraries are told
    tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    print(f"vocabulary {vocab} tokens; document {len(tokens)} tokens: {text}")
    for name, run in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance)):
        compiles, steps = [], []
        for _ in range(args.repeat):
            compile_s, times = run(tokenizer, vocab, tokens)
            compiles.append(compile_s)
            steps += times
        steps_us = sorted(t * 1e6 for t in steps)
        print(
            f"{name:10s} compile {statistics.median(compiles) * 1e3:7.1f} ms (median) | "
            f"mask per step: mean {statistics.fmean(steps_us):6.1f} us, "
            f"p50 {steps_us[len(steps_us) // 2]:6.1f} us, "
            f"p99 {steps_us[int(len(steps_us) * 0.99)]:6.1f} us, max {steps_us[-1]:7.1f} us"
        )
    print(f"bitmask applied to one row of logits (CPU): {apply_time(vocab) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
