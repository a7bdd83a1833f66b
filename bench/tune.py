"""`kvgate tune`: the engine settings that give the most output tokens/s on a workload
while meeting service goals (p99 TTFT and p99 TPOT), found by benchmarking them.

Each candidate is a real `kvgate serve` (tune_server.py) measured by `kvgate bench
serve`'s code on the workload given with bench serve's options. The search keeps to a
time budget: the engine's defaults first (the baseline), then a coarse grid of
max_num_seqs and max_num_batched_tokens, then the features one at a time on the best
(FP8 KV, 8-bit weights, n-gram speculation of two lengths, no prefix caching), then
the neighbours of the best's batch sizes; a candidate whose goals are already lost (more
requests over a goal than its p99 allows) is stopped there, and none runs past its share
of the budget (the budget over the first two stages' candidates); when the best two are
within the noise, both run again and their medians decide. Every candidate leaves a
history record (history.py); the best is written as the TOML file `kvgate serve
--config` takes, beside a table and a plot of every candidate (tune_report.py). When
none meets the goals, the closest is written, marked with what it misses, and the exit
status is 1.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

from bench.compare import add_results_dir_arg
from bench.options import DefaultsHelpFormatter, add_workload_args
from bench.tune_report import write_report
from bench.tune_run import Goals, Measured, Tuner
from bench.tune_server import Candidate
from gateway.cli.parsing import Parser

DEFAULTS = Candidate()
MIN_SHARE_S = 30.0  # a candidate's requests are sent for at least this long


def parse_duration(text: str) -> float:
    """Seconds of `20m`, `90s`, `1h`, `1h30m` or a plain number of seconds."""
    parts = re.fullmatch(
        r"\s*(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?\s*", text
    )
    if not parts or not any(parts.groups()):
        raise ValueError(f"--budget takes a duration like 20m, 90s or 1h30m, got {text!r}")
    hours, minutes, seconds = (float(p or 0) for p in parts.groups())
    return hours * 3600 + minutes * 60 + seconds


def coarse_grid(max_seqs_useful: int) -> list[Candidate]:
    """max_num_seqs at what the workload can fill (beyond it the engine's default is
    the same), a half and a quarter of it, at two token budgets, the default first."""
    top = min(max_seqs_useful, DEFAULTS.max_num_seqs)
    seqs = list(dict.fromkeys(max(1, top // d) for d in (1, 2, 4)))
    grid = [Candidate(max_num_seqs=s) for s in seqs]
    grid += [Candidate(max_num_seqs=s, max_num_batched_tokens=512) for s in seqs]
    return grid


def feature_steps(best: Candidate) -> list[Candidate]:
    """The best with one feature changed at a time."""
    return [
        replace(best, kv_cache_dtype="fp8"),
        replace(best, quantization="int8"),
        replace(best, quantization="fp8"),
        replace(best, num_speculative_tokens=2),
        replace(best, num_speculative_tokens=4),
        replace(best, enable_prefix_caching=not best.enable_prefix_caching),
    ]


def neighbours(best: Candidate) -> list[Candidate]:
    """Halfway steps around the best's batch sizes."""
    seqs, tokens = best.max_num_seqs, best.max_num_batched_tokens
    out = [replace(best, max_num_seqs=s) for s in (round(seqs * 1.5), seqs // 2) if s >= 1]
    out += [replace(best, max_num_batched_tokens=t) for t in (tokens * 2, tokens // 2) if t >= 64]
    return out


def search(tuner: Tuner, useful_seqs: int) -> Measured | None:
    """Run the stages while the budget lasts; the best candidate meeting the goals."""
    grid = coarse_grid(useful_seqs)
    # each candidate of the first two stages, which every search runs, may send requests
    # for its share of the budget: the first one no longer spends all of it
    tuner.share_s = max(tuner.budget_s / (1 + len(grid)), MIN_SHARE_S)
    tuner.run_stage("defaults", [DEFAULTS])
    tuner.run_stage("coarse", grid)
    if tuner.best() is not None:
        tuner.run_stage("features", feature_steps(tuner.best().candidate))
    if tuner.best() is not None:
        tuner.run_stage("around the best", neighbours(tuner.best().candidate))
    tuner.repeat_close_calls()
    return tuner.best()


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvgate tune", description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--backend", choices=["gpu"], default="gpu", help="the engine tuned")
    p.add_argument("--model", help="GGUF file or HF directory (default: Gemma 3 270M)")
    p.add_argument("--slo-ttft-p99", type=float, required=True, metavar="S", help="seconds")
    p.add_argument("--slo-tpot-p99", type=float, required=True, metavar="S", help="seconds")
    p.add_argument("--budget", default="20m", help="time for the whole search: 20m, 90s, 1h")
    p.add_argument("--output", required=True, metavar="DIR", help="config, report, plot")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], help="the engine's (auto)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--max-model-len", type=int, metavar="N")
    p.add_argument("--gpu-memory-utilization", type=float, metavar="F")
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument(
        "--noise",
        type=float,
        default=0.05,
        help="two candidates closer than this share of throughput run again",
    )
    p.add_argument("--start-timeout", type=float, default=600, metavar="S")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    add_workload_args(p)
    add_results_dir_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        budget = parse_duration(args.budget)
        if args.model is None:
            from gateway.backends.default_model import default_model_path

            args.model = str(default_model_path())
        if min(args.slo_ttft_p99, args.slo_tpot_p99) <= 0:
            raise ValueError("--slo-ttft-p99 and --slo-tpot-p99 must be > 0 seconds")
        goals = Goals(args.slo_ttft_p99, args.slo_tpot_p99)
        if args.model.endswith(".gguf"):
            convert_once(args.model)
        tuner = Tuner(args, goals, budget, Path(args.output), ["kvgate", "tune", *argv])
        useful = args.max_concurrency or args.num_prompts
        if not math.isinf(args.request_rate):
            useful = min(useful, args.num_prompts)
        best = search(tuner, useful)
        chosen = best or tuner.closest()
        write_report(tuner, chosen)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"kvgate tune: error: {e}", file=sys.stderr)
        return 2
    if chosen is None:
        print("kvgate tune: no candidate could be measured; see the report", file=sys.stderr)
        return 1
    return 0 if best else 1


def convert_once(model: str) -> None:
    """Convert a GGUF file for the gpu engine before the search, its progress shown: else
    the first candidate converts it inside its start-up, unseen, and that minute or two
    on a CPU counts as the candidate's (the conversion is cached for every later start)."""
    from backend_gpu.gguf_loader import convert_gguf

    print(
        f"[prepare] {model}: converting it for the gpu engine (once, then cached; not "
        "counted in --budget)",
        flush=True,
    )
    convert_gguf(model)


if __name__ == "__main__":
    sys.exit(main())
