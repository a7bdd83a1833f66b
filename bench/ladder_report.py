"""The ladder's markdown table and PNG."""

from __future__ import annotations

from collections.abc import Sequence


def engine_label(args: dict) -> str:
    parts = []
    for key, value in args.items():
        if key == "speculative_config" and value:
            value = value.get("method", "on")
        parts.append(f"{key}={value}")
    return ", ".join(parts)


def markdown_table(rows: Sequence) -> str:
    lines = [
        "| step | workload | output tok/s | speed-up | mean TTFT ms | mean TPOT ms "
        "| peak MiB (weights + KV) | prefix hit % | engine arguments |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if not r.available:
            lines.append(f"| {r.step} | {r.workload} | not available | | | | | | {r.reason} |")
            continue
        speedup = f"{r.speedup:.2f}x" if r.speedup is not None else ""
        lines.append(
            f"| {r.step} | {r.workload} | {r.output_tok_s:.1f} | {speedup} "
            f"| {r.mean_ttft_ms:.0f} | {r.mean_tpot_ms:.1f} "
            f"| {r.peak_mib:.0f} ({r.weights_mib:.0f} + {r.kv_peak_mib:.0f}) "
            f"| {100 * r.prefix_hit_rate:.0f} | {engine_label(r.engine_args)} |"
        )
    return "\n".join(lines)


def plot_ladder(rows: Sequence, path: str, title: str) -> None:
    """One bar per row in four panels: output tok/s, TTFT, TPOT, peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.step}\n[{r.workload}]" for r in rows]
    y = list(range(len(rows)))[::-1]
    colors = {"base": "tab:blue", "shared-prefix": "tab:orange", "long-output": "tab:green"}
    fig, axes = plt.subplots(1, 4, figsize=(18, 0.7 * len(rows) + 1.8), sharey=True)
    panels = [
        ("output tok/s", lambda r: r.output_tok_s),
        ("mean TTFT (ms)", lambda r: r.mean_ttft_ms),
        ("mean TPOT (ms)", lambda r: r.mean_tpot_ms),
        ("peak MiB (weights + KV)", lambda r: r.peak_mib),
    ]
    for ax, (name, value) in zip(axes, panels, strict=True):
        for yi, r in zip(y, rows, strict=True):
            if not r.available:
                ax.text(0, yi, " not available", va="center", fontsize=8, color="gray")
                continue
            ax.barh(yi, value(r), color=colors.get(r.workload, "tab:gray"))
            ax.text(value(r), yi, f" {value(r):.1f}", va="center", fontsize=8)
        ax.set_xlabel(name)
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.25)
        ax.set_ylim(-0.6, len(rows) - 0.4)
    axes[0].set_yticks(y, labels, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
