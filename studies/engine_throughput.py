"""Offline engine throughput: kvgate's engine against transformers on one workload.

    python -m studies.engine_throughput [--num-requests 64] [--sequential-requests 16]

A seeded random Llama of about 50M parameters (hidden 512, 8 layers, vocab 32000) and
seeded requests (prompts 32-512 tokens, outputs 16-256 tokens, ignore_eos), run by:
kvgate `LLM.generate` (continuous and static policies), transformers' continuous
batching manager (what `model.generate_batch` drives, here with each request's own
output length), and sequential `model.generate` per request (on the first
`--sequential-requests` requests: its rate does not depend on how many there are).
Writes a table to stdout, docs/perf/engine.md and a PNG plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from bench.options import DefaultsHelpFormatter
from bench.tiny_model import build_tiny_llama, parameter_count
from studies.harness import TINY_LLAMA

VOCAB = 32000


@dataclass
class Run:
    name: str
    requests: int
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def build_model(directory: str, seed: int) -> int:
    """Save the random model and a word-level tokenizer; return the parameter count."""
    shape = TINY_LLAMA | {"vocab_size": VOCAB, "max_position_embeddings": 1024}
    build_tiny_llama(directory, **shape, seed=seed)
    return parameter_count(directory)


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, VOCAB) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
        for _ in range(n)
    ]


def run_kvgate(model_dir: str, requests, policy: str, max_num_seqs: int, args):
    from backend_gpu import LLM, SamplingParams

    llm = LLM(
        model_dir,
        scheduling_policy=policy,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_gib << 30,
    )
    prompts = [p for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == [n for _, n in requests]
    name = f"kvgate {policy}, max_num_seqs {max_num_seqs}"
    return Run(name, len(requests), sum(n for _, n in requests), seconds), llm.stats()


def run_hf_continuous(model_dir: str, requests, cb_config=None) -> Run:
    """`cb_config`: a ContinuousBatchingConfig (None: transformers sizes its cache from
    the free memory)."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    done = 0
    with (
        model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb_config, block=True
        ) as manager,
        tqdm(total=len(requests), desc="transformers CB") as bar,
    ):
        start = time.perf_counter()  # after its set-up and warm-up, like ours after LLM()
        for prompt, n in requests:
            manager.add_request(prompt, max_new_tokens=n)
        generated = 0
        while done < len(requests):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                generated += len(result.generated_tokens)
                done += 1
                bar.update(1)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
    seconds = time.perf_counter() - start
    assert generated == sum(n for _, n in requests), generated
    return Run("transformers continuous batching", len(requests), generated, seconds)


def run_hf_sequential(model_dir: str, requests) -> Run:
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    start = time.perf_counter()
    generated = 0
    with torch.inference_mode():
        for prompt, n in tqdm(requests, desc="transformers sequential"):
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
            generated += out.shape[1] - len(prompt)
    seconds = time.perf_counter() - start
    return Run("transformers sequential generate", len(requests), generated, seconds)


RUN_KEYS = ["continuous", "hf_cb", "hf_seq", "continuous_small", "static_small"]


def static_step_ratio(output_lens: list[int], max_num_seqs: int) -> float:
    """Decode steps of the static policy (each batch of `max_num_seqs` waits for its
    longest output) over those of a continuous batch that is always full: the most
    continuous batching can gain when a step costs the same however full it is."""
    static = sum(
        max(output_lens[i : i + max_num_seqs]) for i in range(0, len(output_lens), max_num_seqs)
    )
    return static / (sum(output_lens) / max_num_seqs)


def goal(what: str, value: float, target: float, unit: str) -> str:
    shown = f"{value:.1%}" if unit == "%" else f"{value:.2f}x"
    wanted = f"{target:.0%}" if unit == "%" else f"{target:g}x"
    return f"- {what}: {shown} (goal >= {wanted}): {'met' if value >= target else 'NOT met'}"


def write_report(args, runs: dict[str, dict], command: str, output_lens: list[int]) -> str:
    r = {
        k: Run(**{f: v[f] for f in ("name", "requests", "output_tokens", "seconds")})
        for k, v in runs.items()
    }
    cont, stats = r["continuous"], runs["continuous"]["stats"]
    bs = 16
    utilization = stats["peak_tokens_in_blocks"] / (stats["peak_blocks_used"] * bs)
    hf_ratio = cont.tokens_per_s / r["hf_cb"].tokens_per_s
    seq_ratio = cont.tokens_per_s / r["hf_seq"].tokens_per_s
    policy_ratio = r["continuous_small"].tokens_per_s / r["static_small"].tokens_per_s
    ceiling = static_step_ratio(output_lens, args.policy_max_num_seqs)
    steps = {k: (runs[k].get("stats") or {}).get("num_steps") for k in runs}
    lines = [
        "## Engine throughput (offline, CPU)",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs "
        f"(torch threads {args.threads}), torch {torch.__version__}, float32.",
        f"Model: seeded random Llama, hidden 512, 8 layers, vocab 32000, "
        f"{args.params / 1e6:.1f}M parameters.",
        f"Workload: {args.num_requests} requests, prompts 32-512 tokens, outputs 16-256 tokens "
        f"(ignore_eos, greedy), seed {args.seed}, all submitted at once.",
    ]
    if args.num_requests != 64:
        lines.append(
            f"**This run used {args.num_requests} requests instead of the full 64** "
            "(`--num-requests 64` runs the full workload)."
        )
    lines += [
        f"Sequential `generate` ran the first {r['hf_seq'].requests} requests only "
        "(its tokens/s is a per-request rate, so the count does not change it). "
        "transformers' continuous batching is timed after its set-up and warm-up, "
        "kvgate after `LLM(...)` returns.",
        "",
        "| run | requests | output tokens | seconds | output tok/s | kvgate is |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def row(run: Run, ref: Run | None) -> str:
        ratio = f"{ref.tokens_per_s / run.tokens_per_s:.2f}x" if ref else ""
        return (
            f"| {run.name} | {run.requests} | {run.output_tokens} | {run.seconds:.1f} | "
            f"{run.tokens_per_s:.1f} | {ratio} |"
        )

    lines += [row(cont, None), row(r["hf_cb"], cont), row(r["hf_seq"], cont)]
    lines += [
        "",
        f"Scheduling policy, both limited to {args.policy_max_num_seqs} running requests "
        "(with room for all 64 at once the static batch is the whole workload and the two "
        "policies coincide):",
        "",
        "| run | requests | output tokens | seconds | output tok/s | continuous is |",
        "|---|---:|---:|---:|---:|---:|",
        row(r["continuous_small"], None),
        row(r["static_small"], r["continuous_small"]),
        "",
        f"Steps: continuous {steps['continuous_small']}, static {steps['static_small']}. "
        f"The ceiling of this ratio on this workload is **{ceiling:.2f}x**: static batches "
        f"of {args.policy_max_num_seqs} run until their longest output, "
        f"{ceiling:.2f}x the decode steps of an always-full continuous batch, and that "
        "is the whole gain only when a step costs the same however few sequences it "
        "holds (a GPU's memory-bound decode). On this CPU a step's cost grows with its "
        "tokens, so the static policy's emptier tail steps are cheaper and the ratio "
        "lands between 1x and the ceiling. The goal of 2x is out of reach for this "
        "workload whatever the engine (its outputs are uniform in 16-256 tokens; the "
        "ratio approaches 2x only as outputs get more uneven).",
        "",
        f"KV cache (kvgate continuous, max_num_seqs {args.max_num_seqs}): at the peak "
        f"{stats['peak_blocks_used']} blocks of {bs} tokens were in use, holding "
        f"{stats['peak_tokens_in_blocks']} tokens: **{utilization:.1%}** of the allocated "
        f"slots hold tokens. Steps: {stats['num_steps']}, tokens per step: "
        f"{stats['num_batched_tokens_total'] / stats['num_steps']:.1f}, "
        f"preemptions: {stats['preemptions']}.",
        "",
        "Goals from issue 3, in this run:",
        "",
        goal("output tok/s over transformers continuous batching", hf_ratio, 2.0, "x"),
        goal("output tok/s over sequential `generate`", seq_ratio, 8.0, "x"),
        goal("continuous over static policy", policy_ratio, 2.0, "x"),
        goal("KV slots holding tokens at the peak", utilization, 0.9, "%"),
        "",
        "The runs are timed one after another. On a machine shared with other jobs (as "
        "this one was) each run sees a different load, and the ratios carry that noise.",
        "",
        f"![engine throughput]({os.path.basename(args.plot)})",
        "",
    ]
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "continuous": "kvgate\ncontinuous",
        "hf_cb": "transformers\ncontinuous",
        "hf_seq": "transformers\nsequential",
        "continuous_small": "kvgate\ncontinuous\n(16 seqs)",
        "static_small": "kvgate\nstatic\n(16 seqs)",
    }
    values = [runs[k]["output_tokens"] / runs[k]["seconds"] for k in RUN_KEYS]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars = ax.bar(
        [labels[k] for k in RUN_KEYS], values, color=["#2a7", "#79c", "#bbb", "#5b9", "#ac8"]
    )
    ax.bar_label(bars, labels=[f"{v:.0f}" for v in values])
    ax.set_ylabel("output tokens / s")
    ax.set_title("Offline throughput, 50M random Llama, 2-core CPU, float32")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--sequential-requests", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--policy-max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--only", nargs="+", choices=RUN_KEYS, default=RUN_KEYS)
    parser.add_argument(
        "--results",
        default="docs/perf/engine_results.json",
        help="runs are merged into this file; the report uses every run found there",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the report from --results"
    )
    parser.add_argument("--report", default="docs/perf/engine.md")
    parser.add_argument("--plot", default="docs/perf/engine_throughput.png")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python -m studies.engine_throughput " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    requests = workload(args.num_requests, args.seed)
    runs: dict[str, dict] = {}
    if os.path.exists(args.results):
        with open(args.results) as f:
            saved = json.load(f)
        if saved.get("num_requests") == args.num_requests and saved.get("seed") == args.seed:
            runs = saved["runs"]
            if args.report_only:
                command = saved.get("command", command)
    with tempfile.TemporaryDirectory() as model_dir:
        args.params = build_model(model_dir, args.seed)
        for key in [] if args.report_only else args.only:
            stats = None
            if key == "continuous":
                run, stats = run_kvgate(model_dir, requests, "continuous", args.max_num_seqs, args)
            elif key in ("continuous_small", "static_small"):
                policy = key.removesuffix("_small")
                run, stats = run_kvgate(model_dir, requests, policy, args.policy_max_num_seqs, args)
            elif key == "hf_cb":
                run = run_hf_continuous(model_dir, requests)
            else:
                run = run_hf_sequential(model_dir, requests[: args.sequential_requests])
            print(
                f"{run.name}: {run.output_tokens} tokens in {run.seconds:.1f}s = "
                f"{run.tokens_per_s:.1f} tok/s",
                flush=True,
            )
            runs[key] = dataclasses.asdict(run) | {"stats": stats and dataclasses.asdict(stats)}
            os.makedirs(os.path.dirname(args.results) or ".", exist_ok=True)
            with open(args.results, "w") as f:
                saved = {"num_requests": args.num_requests, "seed": args.seed, "runs": runs}
                json.dump(saved | {"command": command}, f)
    if not all(k in runs for k in RUN_KEYS):
        print(f"runs still missing for the report: {[k for k in RUN_KEYS if k not in runs]}")
        return
    report = write_report(args, runs, command, [n for _, n in requests])
    print(report)
    with open(args.report, "w") as f:
        f.write(report)
    plot(runs, args.plot)


if __name__ == "__main__":
    main()
