"""`kvgate bench serve | sweep | noisy | ladder` (also `python -m bench ...`)."""

from __future__ import annotations

import argparse
import sys

from bench.ladder import add_ladder_args, run_ladder
from bench.noisy import add_noisy_args, add_target_args, cmd_noisy
from bench.options import (
    DefaultsHelpFormatter,
    add_server_args,
    add_workload_args,
    build_requests,
    serve_config,
    workload_info,
)
from bench.serve import plot_requests, save_json, serve_benchmark
from bench.sweep import add_sweep_args, run_sweep


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = serve_config(args, args.max_concurrency)
    arrivals = "Poisson process" if cfg.burstiness == 1.0 else "gamma distribution"
    print(
        f"Traffic request rate: {cfg.request_rate}; burstiness {cfg.burstiness} ({arrivals}); "
        f"maximum request concurrency: {cfg.max_concurrency}"
    )
    result, report = serve_benchmark(cfg, build_requests(args), workload_info(args))
    errors = [e for e in result["errors"] if e]
    for i, error in enumerate(errors[:5]):
        print(f"error {i}: {error}", file=sys.stderr)
    print(report)
    if args.save_result:
        save_json(result, args.save_result, args.save_detailed)
        print(f"saved {args.save_result}")
    if args.plot:
        plot_requests(result, args.plot)
        print(f"saved {args.plot}")
    return 0 if result["completed"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate bench", description=__doc__, formatter_class=DefaultsHelpFormatter
    )
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"kvgate bench {args.command}: error: {e}", file=sys.stderr)
        return 2
