"""Tensor parallelism on the CPU: batch-16 decode of a random Llama whose matmuls
dominate, split over two ranks (one thread each) against one rank with one thread and
with two threads.

    flock /tmp/bench.lock .venv/bin/python -m studies.tensor_parallel [--rounds 3]

The model (hidden 2048, MLP 8192, 4 layers, 16 heads, 8 KV heads, vocabulary 32000:
383M parameters, 1.5 GB in float32) gets random weights (load_format "dummy"), so only
its config and tokenizer are written. Each configuration runs `--rounds` times, the
three interleaved (a shared machine's noise hits each alike); the table gives each
one's best and median round. Decode tokens per second: 16 sequences, after their
prefill and two warm-up steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.options import DefaultsHelpFormatter
from bench.tiny_model import build_tiny_llama
from engine_api.records import GenRequest

BATCH = 16
PROMPT_TOKENS = 16
WARMUP_STEPS = 2
# (name, tensor_parallel_size, threads per rank)
CONFIGS = [("TP=1, 1 thread", 1, 1), ("TP=1, 2 threads", 1, 2), ("TP=2, 1 thread/rank", 2, 1)]
SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
}


def write_model(directory: Path) -> Path:
    """The tokenizer and config of the bench model (its weights are random at load:
    the small checkpoint build_tiny_llama writes beside them is never read)."""
    build_tiny_llama(directory, hidden_size=64, num_layers=1, vocab_size=32000)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text()) | SHAPE
    config_path.write_text(json.dumps(config))
    return directory


def decode_tokens_per_s(model: str, tp: int, threads: int, steps: int, pp: int = 1) -> float:
    """Batch-16 decode tokens per second over `tp` x `pp` ranks (studies.pipeline_parallel
    takes `pp`)."""
    from backend_gpu import LLM, SamplingParams

    torch.set_num_threads(threads)  # the other ranks take the engine's count
    llm = LLM(
        model,
        load_format="dummy",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_num_seqs=BATCH,
        max_model_len=256,
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1 + WARMUP_STEPS + steps, ignore_eos=True)
    for i in range(BATCH):
        engine.add_request(
            GenRequest(str(i), "", [1 + (i * 7 + j) % 30000 for j in range(PROMPT_TOKENS)], params)
        )
    for _ in range(1 + WARMUP_STEPS):  # the prefill of all 16, then warm-up decodes
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        assert len(engine.step()) == BATCH
    seconds = time.perf_counter() - start
    engine.runner.close()
    del llm, engine
    gc.collect()
    return BATCH * steps / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per round")
    args = p.parse_args()
    rates: dict[str, list[float]] = {name: [] for name, _, _ in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_model(Path(tmp)))
        for round_ in range(args.rounds):
            for name, tp, threads in CONFIGS:
                rates[name].append(decode_tokens_per_s(model, tp, threads, args.steps))
                print(f"round {round_ + 1}: {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    base = rates[CONFIGS[0][0]]
    print("\n| configuration | decode tok/s, best | median | vs TP=1 1 thread, best | median |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in rates.items():
        best, median = max(runs), statistics.median(runs)
        print(
            f"| {name} | {best:.1f} | {median:.1f} | {best / max(base):.2f}x "
            f"| {median / statistics.median(base):.2f}x |"
        )


if __name__ == "__main__":
    main()
