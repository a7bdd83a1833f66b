"""Incremental detokenization's host time per decode step, on the CPU:

    python -m studies.detokenize_step [--batch 64] [--tokens 200]

Each of --batch sequences takes --tokens generated tokens one at a time through
backend_gpu's IncrementalDetokenizer (tests' tiny sentencepiece-style tokenizer, with
byte fallback): the work the engine does on the host for every sequence of every step,
while a GPU waits. Prints milliseconds a step (one token for each sequence).
"""

from __future__ import annotations

import argparse
import random
import time

from backend_gpu.detokenizer import IncrementalDetokenizer
from tests.backend_gpu.tiny_models import build_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    text = "The quick brown fox jumps over the lazy dog; naïve café, 日本語 テキスト. " * 40
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    streams = []
    for _ in range(args.batch):
        start = rng.randrange(len(ids) - args.tokens - 8)
        prompt, out = ids[start : start + 8], ids[start + 8 : start + 8 + args.tokens]
        streams.append((IncrementalDetokenizer(tokenizer, prompt, stop=[]), out))
    begin = time.perf_counter()
    for step in range(args.tokens):
        for detok, out in streams:
            detok.add([out[step]])
            detok.take_delta(finished=False)
    per_step = (time.perf_counter() - begin) / args.tokens * 1000
    print(f"batch {args.batch}: {per_step:.3f} ms a step")


if __name__ == "__main__":
    main()
