"""`kvgate bench serve | sweep | noisy | ladder | history | compare` (also `python -m
bench ...`). Every run leaves a record in the history (history.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench.compare import add_history_commands, add_results_dir_arg, serve_figures
from bench.history import flatten_figures, make_record, save_record
from bench.ladder import add_ladder_args, run_ladder
from bench.noisy import add_noisy_args, add_target_args, cmd_noisy
from bench.options import (
    DefaultsHelpFormatter,
    add_server_args,
    add_workload_args,
    build_requests,
    request_shape,
    serve_config,
    workload_info,
)
from bench.serve import plot_requests, save_json, serve_benchmark
from bench.server_memory import MemorySampler, server_pid
from bench.sweep import add_sweep_args, run_sweep
from gateway.cli.parsing import Parser


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = serve_config(args, args.max_concurrency)
    arrivals = "Poisson process" if cfg.burstiness == 1.0 else "gamma distribution"
    print(
        f"Traffic request rate: {cfg.request_rate}; burstiness {cfg.burstiness} ({arrivals}); "
        f"maximum request concurrency: {cfg.max_concurrency}"
    )
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    requests, info = build_requests(args), workload_info(args)
    results, rounds, peaks = [], [], []
    pid = args.server_pid or server_pid(cfg.url)
    for i in range(args.rounds):
        with MemorySampler(pid) as memory:  # each round's peak: the spread covers it too
            result, report = serve_benchmark(cfg, requests, info)
        if args.rounds > 1:
            print(f"round {i + 1} of {args.rounds}")
        print(report)
        results.append(result)
        rounds.append(serve_figures(result) | memory.figures())
        peaks.append(memory.peak())
    errors = [e for e in result["errors"] if e]
    for i, error in enumerate(errors[:5]):
        print(f"error {i}: {error}", file=sys.stderr)
    if args.save_result:
        save_json(result, args.save_result, args.save_detailed)
        print(f"saved {args.save_result}")
    if args.plot:
        plot_requests(result, args.plot)
        print(f"saved {args.plot}")
    config = {"url": result["url"], "model": result["model"], "num_prompts": len(requests)}
    config |= {"max_concurrency": cfg.max_concurrency} | request_shape(args)
    record = make_record(
        "serve",
        ["kvgate", "bench", *args.argv],
        config | info,
        rounds,
        max(peaks, key=lambda p: p.bytes) if pid is not None else None,
    )
    save_history(record, args)
    return 0 if all(r["completed"] for r in results) else 1


def save_history(record: dict, args: argparse.Namespace) -> None:
    if not args.no_history:
        # on stderr: stdout is the result (`bench noisy` prints JSON there)
        print(f"recorded {save_record(record, args.results_dir)}", file=sys.stderr)


def record_run(args: argparse.Namespace) -> None:
    """The history record of a sweep, noisy or ladder run: the numbers of its saved
    result (one round)."""
    result = getattr(args, "result", None)
    if result is None and getattr(args, "save_result", None) and os.path.isfile(args.save_result):
        with open(args.save_result, encoding="utf-8") as f:
            result = json.load(f)
    figures = flatten_figures(result or {})
    if figures:
        config = {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | None)}
        command = ["kvgate", "bench", *args.argv]
        save_history(make_record(args.command, command, config, [figures], None), args)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvgate bench", description=__doc__, formatter_class=DefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = DefaultsHelpFormatter  # each subcommand's own: they do not inherit it

    serve = sub.add_parser(
        "serve", formatter_class=fmt, help="load-test an OpenAI-compatible server"
    )
    add_server_args(serve)
    add_workload_args(serve)
    serve.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    serve.add_argument("--save-result", metavar="FILE", help="write the JSON result here")
    serve.add_argument(
        "--save-detailed", action="store_true", help="with per-request TTFT, ITL, E2EL, start"
    )
    serve.add_argument(
        "--plot", metavar="PNG", help="draw each request's TTFT and E2E latency over the run"
    )
    serve.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the workload this many times: the history keeps the medians and the "
        "spread that `bench compare` judges changes by",
    )
    serve.add_argument(
        "--server-pid",
        type=int,
        metavar="PID",
        help="the server's process, for its peak memory (default: the one listening on "
        "--url's port, when on this machine)",
    )
    serve.set_defaults(run=cmd_serve)

    sweep = sub.add_parser(
        "sweep", formatter_class=fmt, help="throughput and latency over concurrency levels"
    )
    add_server_args(sweep)
    add_workload_args(sweep)
    add_sweep_args(sweep)
    sweep.set_defaults(run=run_sweep)

    noisy = sub.add_parser(
        "noisy", formatter_class=fmt, help="one tenant floods, another sends a steady trickle"
    )
    add_target_args(noisy)
    add_noisy_args(noisy)
    noisy.set_defaults(run=cmd_noisy)

    ladder = sub.add_parser(
        "ladder", formatter_class=fmt, help="the engine's optimization ladder, offline"
    )
    add_ladder_args(ladder)
    ladder.set_defaults(run=run_ladder)
    for command in (serve, sweep, noisy, ladder):
        add_results_dir_arg(command)
        command.add_argument(
            "--no-history", action="store_true", help="leave no record of this run"
        )
    add_history_commands(sub, fmt)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = list(argv)
    try:
        rc = args.run(args)
        if args.command in ("sweep", "noisy", "ladder"):
            record_run(args)
        return rc
    except (ValueError, RuntimeError, OSError) as e:
        print(f"kvgate bench {args.command}: error: {e}", file=sys.stderr)
        return 2
