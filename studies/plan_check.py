"""`kvgate plan` against the engine on a GPU: the KV blocks a plan computes from the
model's config and the device's free memory, beside the blocks the engine allocates
(its measured weights and activations) for the same settings.

Usage: python -m studies.plan_check --out DIR [--device cuda]

A random Llama (bench.tiny_model) at two sizes, bfloat16, CUDA graphs on; for each, the
plan first (in the same process, so the CUDA context it sees in use is the engine's),
then the engine. Writes DIR/plan_check.json; prints one line per model with the ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path

import torch

from backend_gpu import LLM
from backend_gpu.memory_plan import PlanDevice, PlanSettings, plan_memory
from bench.tiny_model import build_tiny_llama

SHAPES = {
    "llama-52m": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4},
    "llama-140m": {"hidden_size": 1024, "num_layers": 8, "num_heads": 16, "num_kv_heads": 4},
}
MAX_MODEL_LEN = 4096
UTILIZATION = 0.5  # leave the rest of a shared GPU alone


def check(name: str, model: Path, device: str) -> dict:
    free, total = torch.cuda.mem_get_info(device)
    settings = PlanSettings(
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=UTILIZATION,
        dtype="bfloat16",
        tensor_parallel_size=1,
    )
    planned = plan_memory(str(model), PlanDevice(device, total, total - free), settings).ranks[0]
    llm = LLM(
        str(model),
        device=device,
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=UTILIZATION,
    )
    runner = llm.engine.runner
    row = {
        "model": name,
        "planned_blocks": planned.kv.num_blocks,
        "engine_blocks": runner.num_blocks,
        "ratio": planned.kv.num_blocks / runner.num_blocks,
        "planned_weight_bytes": planned.weight_bytes,
        "engine_weight_bytes": runner.weight_bytes,
        "planned_activation_bytes": planned.activation_bytes,
        "graph_pool_bytes": planned.graph_pool_bytes,
    }
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="plan-check-") as work:
        for name, shape in SHAPES.items():
            model = build_tiny_llama(Path(work) / name, vocab_size=32000, **shape)
            row = check(name, model, args.device)
            print(
                f"{name}: plan {row['planned_blocks']} blocks, engine {row['engine_blocks']} "
                f"(ratio {row['ratio']:.3f}); weights {row['planned_weight_bytes']} vs "
                f"{row['engine_weight_bytes']} bytes",
                flush=True,
            )
            rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_check.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
