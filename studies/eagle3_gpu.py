"""EAGLE-3's kernel path on a GPU: the time of a verifying step (the head's k chained
passes and the target over 1 + k positions a sequence) against a plain decode step,
batch 1 to 64.

    python -m studies.eagle3_gpu --out OUTDIR [--shape llama-1b] [--device cuda]

A head trained for random weights means nothing, so acceptance is not measured here:
the target is a random Llama of TinyLlama's 1.1B shape (load_format "dummy", bfloat16)
and the head a random one of its shape (its own token table, the whole vocabulary).
What the step costs decides the speedup a real head's acceptance length L gives:
L x plain step / verifying step. Prints and writes each batch's median step times, their
ratio, and the acceptance length that breaks even. studies/gpu_check.sh runs it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from backend_gpu.spec_decode.eagle3_config import default_aux_layers
from bench.options import DefaultsHelpFormatter
from studies.eagle3_ttt import Eagle3TTT, head_config, save_head
from studies.gpu_check import write_model_dir
from studies.int4_throughput import SHAPES

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def write_head(target: Path, directory: Path) -> None:
    """A random head for the model at `target`, with its own token table."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target)
    torch.manual_seed(0)
    embed = torch.randn(config.vocab_size, config.hidden_size) * 0.02
    num_layers = config.num_hidden_layers
    layers = [min(max(i, 0), num_layers - 1) for i in default_aux_layers(num_layers)]
    head = Eagle3TTT(head_config(config, config.vocab_size, layers, False), embed)
    save_head(str(directory), head, torch.arange(config.vocab_size), config.vocab_size)
    path = directory / "model.safetensors"
    save_file(load_file(path) | {"embed_tokens.weight": embed}, path, metadata={"format": "pt"})


def step_times(llm, batch: int, prompt_len: int, steps: int, vocab: int) -> list[float]:
    """Seconds of each of `steps` engine steps once `batch` requests all decode."""
    from backend_gpu import SamplingParams
    from engine_api.records import GenRequest

    engine = llm.engine
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=4 * steps + 8, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(GenRequest(f"{batch}-{i}", "", prompt, params))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.seqs.values()):
        engine.step()
    times = []
    for _ in range(steps):
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    for request_id in list(engine.seqs):
        engine.abort_request(request_id)
    return times


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens of each request")
    p.add_argument("--steps", type=int, default=20, help="timed steps per batch and engine")
    args = p.parse_args(argv)
    from backend_gpu import LLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    work = Path(tempfile.mkdtemp(prefix="eagle3-gpu-"))
    write_model_dir(shape, work / "target")
    write_head(work / "target", work / "head")
    common = dict(
        device=args.device,
        dtype=args.dtype,
        load_format="dummy",
        max_num_seqs=max(args.batches),
        max_model_len=args.prompt + 4 * args.steps + 64,
    )
    spec = {"method": "eagle3", "model": str(work / "head"), "num_speculative_tokens": args.k}
    engines = {"plain": LLM(str(work / "target"), **common)}
    engines["eagle3"] = LLM(str(work / "target"), **common, speculative_config=spec)
    rows = []
    for batch in args.batches:
        row = {"batch": batch}
        for name, llm in engines.items():
            step_times(llm, batch, args.prompt, 3, shape["vocab_size"])  # warm
            row[f"{name}_step_ms"] = 1000 * statistics.median(
                step_times(llm, batch, args.prompt, args.steps, shape["vocab_size"])
            )
        row["ratio"] = row["eagle3_step_ms"] / row["plain_step_ms"]
        rows.append(row)
        print(
            f"batch {batch}: plain {row['plain_step_ms']:.2f} ms, verifying step (k={args.k}) "
            f"{row['eagle3_step_ms']:.2f} ms, {row['ratio']:.2f}x: breaks even at an "
            f"acceptance length of {row['ratio']:.2f}",
            flush=True,
        )
    result = {"shape": args.shape, "device": args.device, "dtype": args.dtype, "k": args.k}
    result |= {"prompt": args.prompt, "steps": args.steps, "rows": rows}
    with open(out / "eagle3_gpu.json", "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
