"""Pipeline parallelism on the CPU against tensor parallelism and one rank: 16
concurrent streams decoding on the random Llama of studies.tensor_parallel (hidden
2048, MLP 8192, 4 layers, vocabulary 32000), its layers split into two stages of two
layers each (two processes over gloo, one thread each), against the same model over two
tensor-parallel ranks and on one rank with one and with two threads.

    flock /tmp/bench.lock .venv/bin/python -m studies.pipeline_parallel [--rounds 3]

Each configuration runs `--rounds` times, interleaved (a shared machine's noise hits
each alike); the table gives each one's best and median round: output tokens per second
over the 16 streams and TPOT, the time between two tokens of one stream (every decode
step gives each stream one token, so TPOT = 16 / tokens per second).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.options import DefaultsHelpFormatter
from studies.tensor_parallel import BATCH, decode_tokens_per_s, write_model

# (name, tensor_parallel_size, pipeline_parallel_size, threads per rank)
CONFIGS = [
    ("1 rank, 1 thread", 1, 1, 1),
    ("1 rank, 2 threads", 1, 1, 2),
    ("TP=2, 1 thread/rank", 2, 1, 1),
    ("PP=2, 1 thread/rank", 1, 2, 1),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per round")
    args = p.parse_args()
    rates: dict[str, list[float]] = {name: [] for name, *_ in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_model(Path(tmp)))
        for round_ in range(args.rounds):
            for name, tp, pp, threads in CONFIGS:
                rates[name].append(decode_tokens_per_s(model, tp, threads, args.steps, pp))
                print(f"round {round_ + 1}: {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    base = statistics.median(rates[CONFIGS[0][0]])
    print(
        f"\n| configuration | output tok/s ({BATCH} streams), best | median "
        "| TPOT ms, median | vs 1 rank 1 thread, median |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, runs in rates.items():
        median = statistics.median(runs)
        print(
            f"| {name} | {max(runs):.1f} | {median:.1f} | {1000 * BATCH / median:.0f} "
            f"| {median / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
