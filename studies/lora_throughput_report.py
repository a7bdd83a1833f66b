"""studies.lora_throughput's output: its table on stdout and its plot (throughput of
the arms side by side, and the first request's time to first token under an adapter not
yet loaded against one resident)."""

from __future__ import annotations

from pathlib import Path


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = result["arms"]
    names = [k for k in ("base", "mixed", "naive") if k in arms]
    labels = {
        "base": "base model alone",
        "mixed": f"{result['config']['adapters']} adapters mixed",
        "naive": "merged models,\nswapped on demand",
    }
    panels = 2 if "cold" in arms else 1
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels + 2, 4.2), squeeze=False)
    ax = axes[0][0]
    values = [arms[k]["tokens_per_s"] for k in names]
    bars = ax.bar([labels[k] for k in names], values, color=["#bbb", "#2a7", "#c75"][: len(names)])
    ax.bar_label(bars, labels=[f"{v:.0f}" for v in values])
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{result['config']['streams']} streams, {result['env']['device']}")
    if panels == 2:
        cold = arms["cold"]
        ms = [cold["median_resident_s"] * 1e3, cold["median_cold_s"] * 1e3]
        bars = axes[0][1].bar(
            ["resident adapter", "adapter not loaded"], ms, color=["#2a7", "#79c"]
        )
        axes[0][1].bar_label(bars, labels=[f"{v:.0f} ms" for v in ms])
        axes[0][1].set_ylabel("time to first token, median (ms)")
        axes[0][1].set_title(f"one request, prompt {cold['prompt_len']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(result: dict) -> None:
    arms = result["arms"]
    print("| arm | requests | output tokens | seconds | output tok/s | swaps | load s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for k in ("base", "mixed", "naive"):
        if k in arms:
            a = arms[k]
            print(
                f"| {k} | {a['requests']} | {a['output_tokens']} | {a['seconds']:.1f} | "
                f"{a['tokens_per_s']:.1f} | {a['swaps']} | {a['load_seconds']:.1f} |"
            )
    for name, value in result["ratios"].items():
        print(f"{name}: {value:.2f}x")
    if "cold" in arms:
        c = arms["cold"]
        print(
            f"TTFT median: cold {c['median_cold_s'] * 1e3:.1f} ms, resident "
            f"{c['median_resident_s'] * 1e3:.1f} ms, added {c['median_added_s'] * 1e3:.1f} ms"
        )
