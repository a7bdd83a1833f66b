"""`kvgate bench sweep`: `bench serve` at rising concurrency, drawn as a latency-throughput curve."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from bench.options import build_requests, serve_config, workload_info
from bench.serve import save_json, serve_benchmark

POINT_FIELDS = (
    "max_concurrency",
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_e2el_ms",
)


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"--concurrency takes positive integers, got {text!r}")
    return levels


def sweep_server(
    args: argparse.Namespace, label: str, levels: Sequence[int], requests
) -> list[dict]:
    """One `bench serve` per level, on the same prompts; the curve's points.
    With --prompts-per-concurrency K, level c sends the first K*c prompts."""
    points = []
    for level in levels:
        cfg = serve_config(args, max_concurrency=level)
        k = args.prompts_per_concurrency
        level_requests = requests[: k * level] if k else requests
        result, report = serve_benchmark(cfg, level_requests, workload_info(args))
        print(f"[{label}] concurrency {level}\n{report}")
        points.append({field: result.get(field) for field in POINT_FIELDS})
    return points


def plot_sweep(series: dict[str, list[dict]], path: str, title: str) -> None:
    """Two panels: TTFT and TPOT (median, p99 dashed) against output throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        for label, points in series.items():
            x = [p["output_throughput"] for p in points]
            line = ax.plot(x, [p[f"median_{metric}_ms"] for p in points], "o-", label=label)[0]
            ax.plot(
                x, [p[f"p99_{metric}_ms"] for p in points], "--", color=line.get_color(), alpha=0.6
            )
            for p in points:
                ax.annotate(
                    f"c={p['max_concurrency']}",
                    (p["output_throughput"], p[f"median_{metric}_ms"]),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                )
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{metric.upper()} (ms): median, p99 dashed")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(series: dict[str, list[dict]]) -> str:
    lines = [
        "| server | concurrency | req/s | output tok/s | median TTFT ms | p99 TTFT ms "
        "| median TPOT ms | p99 TPOT ms | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, points in series.items():
        for p in points:
            lines.append(
                f"| {label} | {p['max_concurrency']} | {p['request_throughput']:.2f} "
                f"| {p['output_throughput']:.1f} | {p['median_ttft_ms']:.1f} "
                f"| {p['p99_ttft_ms']:.1f} | {p['median_tpot_ms']:.2f} "
                f"| {p['p99_tpot_ms']:.2f} | {p['failed']} |"
            )
    return "\n".join(lines)


def run_sweep(args: argparse.Namespace) -> int:
    # The points need these whatever was asked for the printed blocks.
    args.percentile_metrics = "ttft,tpot,itl,e2el"
    if "99" not in args.metric_percentiles.split(","):
        args.metric_percentiles += ",99"
    levels = parse_levels(args.concurrency)
    if args.prompts_per_concurrency:
        if args.prompts_per_concurrency < 1:
            raise ValueError("--prompts-per-concurrency must be >= 1")
        args.num_prompts = args.prompts_per_concurrency * max(levels)
    requests = build_requests(args)
    series = {args.label: sweep_server(args, args.label, levels, requests)}
    if args.url2:
        second = argparse.Namespace(**vars(args))
        second.url, second.model = args.url2, args.model2
        second.api_key, second.api_key_file = args.api_key2, args.api_key_file2
        series[args.label2] = sweep_server(second, args.label2, levels, requests)
    table = markdown_table(series)
    print(table)
    save_json({"levels": levels, "series": series, "table": table}, args.save_result)
    plot_sweep(series, args.plot, f"latency vs throughput ({args.dataset}, {args.endpoint})")
    print(f"saved {args.save_result} and {args.plot}")
    return 0 if all(p["completed"] for points in series.values() for p in points) else 1


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated levels")
    p.add_argument(
        "--prompts-per-concurrency", type=int, help="level c sends K*c prompts (default: all)"
    )
    p.add_argument("--label", default="kvgate")
    p.add_argument("--url2", help="a second server on the same plot")
    p.add_argument("--model2")
    p.add_argument("--api-key2", help="key(s) for the second server")
    p.add_argument("--api-key-file2", help="key file for the second server")
    p.add_argument("--label2", default="other")
    p.add_argument("--save-result", metavar="FILE", default="sweep.json")
    p.add_argument("--plot", metavar="PNG", default="sweep.png")
