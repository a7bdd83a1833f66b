"""Where a batch-1 decoding step's time goes, plain against speculative (an EAGLE-3 head
or n-gram), on the engine as it runs: the parts are the engine's own methods, timed by
wrapping them for this process only.

    python -m studies.spec_profile --model smollm2-135m-instruct --eagle3 HEAD --threads 1

The same chat prompts (studies/spec_decode.py's) run one at a time on a plain engine
and a speculating one, in turn, greedy with ignore_eos; per engine step (prefills
included) it prints the milliseconds of, in wall time and in this thread's CPU time
(the engine runs in the caller's thread; with one torch thread its CPU time is what the
step costs without the waits a loaded machine adds): the proposal (for a head: its passes' step
rows and metadata, its layer, its draw; the rest is the proposer's bookkeeping), the
target's step rows and metadata, its model, its LM head, the sampler or the
verification, and the rest of the engine's step (the scheduler, appending tokens,
outputs).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import time

from bench.options import DefaultsHelpFormatter

# (module, class, method) timed, with its label by whose it is (a runner's methods
# serve the target's and the head's); a runner's _forward includes its LM head
PARTS = [
    ("backend_gpu.engine", "LLMEngine", "step", {"any": "engine step"}),
    ("backend_gpu.spec_decode.speculator", "Speculator", "propose", {"any": "propose"}),
    (
        "backend_gpu.model_runner",
        "ModelRunner",
        "prepare",
        {"head": "head: step rows", "target": "target: step rows"},
    ),
    ("backend_gpu.spec_decode.eagle3_head", "Eagle3Head", "layer_out", {"any": "head: layer"}),
    ("backend_gpu.spec_decode.eagle3", "Eagle3Proposer", "_draw", {"any": "head: draw"}),
    ("backend_gpu.model_runner", "ModelRunner", "_forward", {"target": "target: model"}),
    ("backend_gpu.model_runner", "ModelRunner", "head", {"target": "target: LM head"}),
    ("backend_gpu.engine", "LLMEngine", "_sample", {"any": "sample / verify"}),
]


def wrap(sink: dict, module: str, cls: str, method: str, labels: dict):
    """Time `cls.method` into `sink["to"]` (the engine running now's wall and CPU
    seconds by label), the label by whose runner it is; returns what puts the method
    back."""
    owner = getattr(importlib.import_module(module), cls)
    inner = getattr(owner, method)

    def timed(obj, *args, **kwargs):
        model = getattr(obj, "model", None)
        role = "head" if type(model).__name__ == "Eagle3Head" else "target"
        label = labels.get("any") or labels.get(role)
        if label is None or sink["to"] is None:
            return inner(obj, *args, **kwargs)
        wall, cpu = sink["to"]
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            return inner(obj, *args, **kwargs)
        finally:
            wall[label] += time.perf_counter() - start
            cpu[label] += time.thread_time() - start_cpu

    setattr(owner, method, timed)
    return lambda: setattr(owner, method, inner)


def measure(engines: dict, prompts: list[list[int]], max_tokens: int, sink: dict) -> dict:
    """Each prompt on every engine in turn (alternating which goes first); per engine
    its tokens/s, steps, acceptance length and milliseconds per step by part."""
    from backend_gpu import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    seconds = {name: collections.defaultdict(float) for name in engines}
    cpu = {name: collections.defaultdict(float) for name in engines}
    wall = dict.fromkeys(engines, 0.0)
    was = {name: llm.stats() for name, llm in engines.items()}
    for i, prompt in enumerate(prompts):
        order = list(engines.items())
        for name, llm in order if i % 2 == 0 else order[::-1]:
            sink["to"] = seconds[name], cpu[name]
            start = time.perf_counter()
            llm.generate([prompt], params)
            wall[name] += time.perf_counter() - start
    sink["to"] = None
    tokens = len(prompts) * max_tokens
    return {
        name: summary(llm.stats(), was[name], seconds[name], cpu[name], wall[name], tokens)
        for name, llm in engines.items()
    }


def per_step(seconds: dict[str, float], steps: int) -> dict[str, float]:
    """Milliseconds per engine step by part, the parts' remainders named."""
    ms = {label: 0.0 for *_, labels in PARTS for label in labels.values()}
    ms.update({k: 1000 * s / steps for k, s in seconds.items()})
    ms["target: model"] -= ms["target: LM head"]
    head = sum(v for k, v in ms.items() if k.startswith("head"))
    ms["propose: the rest"] = ms["propose"] - head
    target = sum(v for k, v in ms.items() if k.startswith("target"))
    ms["engine: the rest"] = ms["engine step"] - ms["propose"] - target - ms["sample / verify"]
    return {k: round(v, 2) for k, v in ms.items()}


def summary(now, was, seconds: dict, cpu: dict, wall: float, tokens: int) -> dict:
    steps = now.num_steps - was.num_steps
    drafts = now.num_drafts - was.num_drafts
    accepted = now.num_accepted_tokens - was.num_accepted_tokens
    return {
        "tok_s": tokens / wall,
        "steps": steps,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "ms_per_step": per_step(seconds, steps),
        "cpu_ms_per_step": per_step(cpu, steps),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--eagle3", help="an EAGLE-3 head's directory (else n-gram)")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4, help="chat prompts, one at a time")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="the engines' (bfloat16: AMX on a CPU)")
    p.add_argument("--save-result", help="write the figures to this JSON file")
    args = p.parse_args(argv)
    import torch

    from backend_gpu import LLM, SamplingParams
    from studies.spec_decode import model_path, prompt_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    path = model_path(args.model)
    spec = {"method": "eagle3", "model": args.eagle3} if args.eagle3 else {"method": "ngram"}
    spec["num_speculative_tokens"] = args.k
    # a short context and a set cache: the free memory of a shared machine varies
    opts = {"max_model_len": 1024, "kv_cache_memory_bytes": 96 << 20, "dtype": args.dtype}
    engines = {
        "plain": LLM(path, **opts),
        spec["method"]: LLM(path, **opts, speculative_config=spec),
    }
    prompts = prompt_ids(engines["plain"].tokenizer, "chat")[: args.prompts]
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts[:1], warm)
    sink: dict = {"to": None}
    restores = [wrap(sink, *part) for part in PARTS]
    try:
        result = measure(engines, prompts, args.max_tokens, sink)
    finally:
        for restore in restores[::-1]:
            restore()
    labels = sorted({k for r in result.values() for k in r["ms_per_step"]})
    names = [f"{n} {kind}" for kind in ("wall", "CPU") for n in result]
    print("| ms per engine step | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for label in labels:
        row = [
            f"{r[key].get(label, 0.0):.2f}"
            for key in ("ms_per_step", "cpu_ms_per_step")
            for r in result.values()
        ]
        print(f"| {label} | " + " | ".join(row) + " |")
    for name, r in result.items():
        length = r["acceptance_length"]
        extra = "" if length is None else f", acceptance length {length:.2f}"
        print(f"{name}: {r['tok_s']:.2f} tok/s, {r['steps']} steps{extra}")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({"args": vars(args), "engines": result}, f, indent=2)
    return result


if __name__ == "__main__":
    main()
