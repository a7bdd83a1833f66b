"""studies.scale_out's arithmetic and its outputs: runs pooled per configuration, the
ratios set against issue 14's goals, the printed table and the plot.

Paired figures (the gateway against the worker directly) are medians of per-round
ratios and differences: a round's two arms ran back to back, so a slow minute on the
shared machine shows in one round's pair, not in one arm only.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from bench.metrics import percentile
from studies.scale_out_procs import Run

ARMS = ("direct", "gateway")
GOALS = {  # issue 14's benchmark section
    "scaling_ratio": 1.7,  # 2 workers / 1 worker, aggregate output tokens/s, at least
    "overhead_tokens_ratio": 0.95,  # gateway / direct tokens/s, at least
    "overhead_ttft_ms": 5.0,  # gateway - direct TTFT p50, at most
    "hit_rate": 0.90,  # prefix routing over 2 workers, at least
    "routing_ttft_ratio": 2.0,  # round robin / prefix TTFT p50, at least
}


def pooled(runs: Sequence[Run]) -> dict:
    """Several loads of one configuration as one: tokens over the summed durations,
    percentiles over every request's TTFT."""
    ttfts = [t for r in runs for t in r.ttfts_ms]
    prompt = sum(r.prompt_tokens for r in runs)
    output = sum(r.output_tokens for r in runs)
    cpu: dict[str, float] = {}
    for r in runs:
        for name, seconds in r.cpu_s.items():
            role = "workers" if name.startswith("worker") else name
            cpu[role] = cpu.get(role, 0.0) + seconds
    return {
        "requests": sum(r.requests for r in runs),
        "output_tokens": output,
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in runs),
        "hit_rate": sum(r.cached_tokens for r in runs) / prompt if prompt else 0.0,
        "tokens_per_s": output / sum(r.duration_s for r in runs),
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        # CPU time per output token of the gateway, its workers and the measuring client
        "cpu_ms_per_token": {role: 1000 * s / output for role, s in cpu.items()} if output else {},
    }


def ratios(rows: Sequence[dict]) -> dict:
    """Scaling: each configuration's tokens/s over the first's ("b_over_a", ...)."""
    base = rows[0]["tokens_per_s"]
    return {f"{row['id']}_over_a": row["tokens_per_s"] / base for row in rows[1:]}


def overhead_summary(direct: Sequence[Run], gateway: Sequence[Run]) -> dict:
    """Round by round (the i-th runs of both arms are a pair): gateway / direct tokens/s
    and gateway - direct TTFT p50, with their medians; and each arm pooled."""
    token_ratios = [g.tokens_per_s / d.tokens_per_s for d, g in zip(direct, gateway, strict=True)]
    ttft_diffs = [g.ttft_p50_ms - d.ttft_p50_ms for d, g in zip(direct, gateway, strict=True)]
    return {
        "tokens_per_s_ratio": statistics.median(token_ratios),
        "ttft_p50_diff_ms": statistics.median(ttft_diffs),
        "tokens_per_s_ratios": token_ratios,
        "ttft_p50_diffs_ms": ttft_diffs,
        "direct": pooled(direct),
        "gateway": pooled(gateway),
    }


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def table_lines(report: dict) -> list[str]:
    """The markdown tables docs/PERF.md shows, from a report."""
    lines: list[str] = []
    if "scaling" in report:
        lines += _scaling_lines(report["scaling"])
    if "overhead" in report:
        lines += _overhead_lines(report["overhead"], "gateway overhead, local worker: streams")
    if "overhead_fake" in report:
        title = "the same, fake engine: streams"
        lines += _overhead_lines(report["overhead_fake"], title, judged=False)
    if "prefix_routing" in report:
        lines += _routing_lines(report["prefix_routing"])
    if "approximate_routing" in report:
        lines += _approx_lines(report["approximate_routing"])
    return lines


def _scaling_lines(scaling: dict) -> list[str]:
    lines = [
        "| scaling: 16 streams | output tok/s | vs a | TTFT p50 | TTFT p99 "
        "| prompt tokens per replica | CPU ms/token: gateway, workers, client |",
        "|---|---|---|---|---|---|---|",
    ]
    base = scaling["configurations"][0]["tokens_per_s"]
    for row in scaling["configurations"]:
        split = " / ".join(
            "+".join(str(n) for n in split.values()) for split in row["prompt_tokens_by_replica"]
        )
        cpu = row["cpu_ms_per_token"]
        cpu_text = ", ".join(f"{cpu[k]:.2f}" for k in ("gateway", "workers", "client") if k in cpu)
        lines.append(
            f"| {row['id']}: {row['label']} | {row['tokens_per_s']:.1f} | "
            f"{row['tokens_per_s'] / base:.2f}x | {row['ttft_p50_ms']:.0f} ms | "
            f"{row['ttft_p99_ms']:.0f} ms | {split} | {cpu_text} |"
        )
    goal = GOALS["scaling_ratio"]
    verdicts = [
        f"{ident}/a = {scaling[f'{ident}_over_a']:.2f}x"
        + (
            f" (goal >= {goal}x: {_met(scaling[f'{ident}_over_a'] >= goal)})"
            if ident[0] == "b"
            else ""
        )
        for ident in (row["id"] for row in scaling["configurations"][1:])
    ]
    return [*lines, "", "; ".join(verdicts), ""]


def _overhead_lines(overhead: dict, title: str, judged: bool = True) -> list[str]:
    """`judged`: say whether each figure meets its goal (not for the fake engine's)."""
    lines = [
        f"| {title} | direct tok/s | gateway tok/s | ratio | "
        "direct TTFT p50 | gateway TTFT p50 | TTFT p50 diff | CPU ms/token: gateway; "
        "worker direct, via gateway |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for load in overhead["loads"]:
        d, g = load["direct"], load["gateway"]
        tokens_ok = load["tokens_per_s_ratio"] >= GOALS["overhead_tokens_ratio"]
        ttft_ok = load["ttft_p50_diff_ms"] <= GOALS["overhead_ttft_ms"]
        verdicts = [f" ({_met(ok)})" if judged else "" for ok in (tokens_ok, ttft_ok)]
        lines.append(
            f"| {load['concurrency']} | {d['tokens_per_s']:.1f} | {g['tokens_per_s']:.1f} | "
            f"{load['tokens_per_s_ratio']:.3f}x{verdicts[0]} | "
            f"{d['ttft_p50_ms']:.1f} ms | {g['ttft_p50_ms']:.1f} ms | "
            f"{load['ttft_p50_diff_ms']:+.1f} ms{verdicts[1]} | "
            f"{_cpu(g, 'gateway')}; {_cpu(d, 'workers')}, {_cpu(g, 'workers')} |"
        )
    return [*lines, ""]


def _cpu(pooled_runs: dict, role: str) -> str:
    value = pooled_runs["cpu_ms_per_token"].get(role)
    return "-" if value is None else f"{value:.2f}"


def _routing_lines(routing: dict) -> list[str]:
    lines = ["| prefix routing, 2 workers | hit rate | TTFT p50 | TTFT p99 |", "|---|---|---|---|"]
    for policy, row in routing["policies"].items():
        lines.append(
            f"| {policy} | {row['hit_rate']:.1%} | {row['ttft_p50_ms']:.0f} ms | "
            f"{row['ttft_p99_ms']:.0f} ms |"
        )
    hit, ratio = routing["policies"]["prefix"]["hit_rate"], routing["ttft_p50_ratio"]
    return [
        *lines,
        "",
        f"hit rate {hit:.1%} (goal >= 90%: {_met(hit >= GOALS['hit_rate'])}); TTFT p50 "
        f"round robin / prefix = {ratio:.2f}x "
        f"(goal >= 2x: {_met(ratio >= GOALS['routing_ttft_ratio'])})",
    ]


def _approx_lines(approx: dict) -> list[str]:
    probe = approx["server_cache"]
    probe_text = "; ".join(
        f"{label} {statistics.median(row['ttft_ms']):.0f} ms" for label, row in probe.items()
    )
    lines = [
        f"one llama-cpp-python server alone, TTFT p50: {probe_text}",
        "",
        "| approximate routing, 2 llama-cpp-python servers | tenants | TTFT p50 | TTFT p90 "
        f"| TTFT < {approx['hit_bound_ms']:.0f} ms |",
        "|---|---|---|---|---|",
    ]
    for policy, by_tenants in approx["policies"].items():
        for tenants, load in by_tenants.items():
            lines.append(
                f"| {policy} | {tenants} | {load['ttft_p50_ms']:.0f} ms | "
                f"{load['ttft_p90_ms']:.0f} ms | {load['fast_share']:.0%} |"
            )
    ratios = ", ".join(
        f"{tenants} tenants {ratio:.2f}x" for tenants, ratio in approx["ttft_p50_ratio"].items()
    )
    return [*lines, "", f"TTFT p50 round robin / prefix: {ratios}", ""]


def print_table(report: dict) -> None:
    print("\n" + "\n".join(table_lines(report)), flush=True)


def plot(report: dict, path: Path) -> None:
    """Bars per configuration: scaling tokens/s; the gateway against the worker directly,
    tokens/s and TTFT; prefix routing's TTFT and hit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (name, draw)
        for name, draw in (
            ("scaling", _plot_scaling),
            ("overhead", _plot_overhead_tokens),
            ("overhead", _plot_overhead_ttft),
            ("prefix_routing", _plot_routing),
            ("approximate_routing", _plot_approx),
        )
        if name in report
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (_, draw) in zip(axes[0], panels, strict=True):
        draw(ax, report)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_scaling(ax, report: dict) -> None:
    rows = report["scaling"]["configurations"]
    bars = ax.bar([r["id"] for r in rows], [r["tokens_per_s"] for r in rows])
    ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_title("scaling: output tokens/s, 16 streams", fontsize=10)
    ax.set_xlabel("\n".join(f"{r['id']}: {r['label']}" for r in rows), fontsize=7)


def _plot_overhead_tokens(ax, report: dict) -> None:
    loads = report["overhead"]["loads"]
    names = [f"{arm}\n{load['concurrency']} stream(s)" for load in loads for arm in ARMS]
    values = [load[arm]["tokens_per_s"] for load in loads for arm in ARMS]
    ax.bar(names, values, color=["tab:gray", "tab:blue"] * len(loads))
    ax.set_title("local worker: direct vs via gateway, tok/s", fontsize=10)


def _plot_overhead_ttft(ax, report: dict) -> None:
    sets = [("local", load) for load in report["overhead"]["loads"] if load["concurrency"] == 1]
    sets += [("fake", load) for load in report.get("overhead_fake", {}).get("loads", [])]
    names = [f"{arm}\n{engine}, 1 stream" for engine, _ in sets for arm in ARMS]
    values = [load[arm]["ttft_p50_ms"] for _, load in sets for arm in ARMS]
    bars = ax.bar(names, values, color=["tab:gray", "tab:blue"] * len(sets))
    ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_title("direct vs via gateway: TTFT p50 (ms)", fontsize=10)


def _plot_routing(ax, report: dict) -> None:
    policies = report["prefix_routing"]["policies"]
    ax.bar(list(policies), [p["ttft_p50_ms"] for p in policies.values()], color="tab:green")
    for i, p in enumerate(policies.values()):
        ax.annotate(f"hit {p['hit_rate']:.0%}", (i, p["ttft_p50_ms"]), ha="center", va="bottom")
    ax.set_title("prefix routing, 2 workers: TTFT p50 (ms)", fontsize=10)
    ax.margins(y=0.15)


def _plot_approx(ax, report: dict) -> None:
    policies = report["approximate_routing"]["policies"]
    width = 0.4
    for j, (policy, by_tenants) in enumerate(policies.items()):
        tenants = list(by_tenants)
        xs = [i + j * width for i in range(len(tenants))]
        ax.bar(xs, [by_tenants[n]["ttft_p50_ms"] for n in tenants], width, label=policy)
    ax.set_xticks([i + width / 2 for i in range(len(tenants))], [f"{n} tenants" for n in tenants])
    ax.legend(fontsize=7)
    ax.set_title("approximate routing, 2 llama-cpp-python: TTFT p50 (ms)", fontsize=9)
