"""The sampler's logits processors on one decode step's batch, on the CPU:

    python -m studies.sampler_step [--rows 64] [--vocab 32000] [--steps 20]

Every row asks for a logit bias and repetition, presence and frequency penalties over a
300-token prompt and 200 outputs: the case where a per-row loop costs most. Prints the
milliseconds a step spends in the processors (median of 3 rounds of --steps steps).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from backend_gpu.sampler import Sampler
from backend_gpu.sequence import Sequence
from engine_api.records import GenRequest
from engine_api.sampling import SamplingParams


def batch(rows: int, vocab: int) -> tuple[torch.Tensor, list[Sequence]]:
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(rows):
        params = SamplingParams(
            max_tokens=400,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.1,
            logit_bias={5: 2.0, 9: -1.0},
        )
        seq = Sequence(
            GenRequest(f"r{i}", "", torch.randint(0, vocab, (300,), generator=gen).tolist(), params)
        )
        seq.token_ids.extend(torch.randint(0, vocab, (200,), generator=gen).tolist())  # outputs
        seqs.append(seq)
    return torch.randn(rows, vocab, generator=gen), seqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    logits, seqs = batch(args.rows, args.vocab)
    sampler = Sampler(torch.device("cpu"), 0, {1})
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(args.steps):
            x = logits.clone()
            sampler._apply_logit_bias(x, seqs)
            sampler._apply_penalties(x, seqs)
            sampler._block_stops_before_min_tokens(x, seqs)
        rounds.append((time.perf_counter() - start) / args.steps * 1000)
    print(f"processors: {statistics.median(rounds):.2f} ms a step ({args.rows} rows)")


if __name__ == "__main__":
    main()
