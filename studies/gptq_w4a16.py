"""The quantization step of studies/int4_quality.py, a process of its own: llm-compressor's
GPTQ to W4A16 (symmetric 4-bit weights, one scale per group of 128 inputs) of an HF
model directory on the CPU, saved as compressed-tensors (pack-quantized).

    PYTHON -m studies.gptq_w4a16 SOURCE_DIR OUT_DIR --calibration FILE.json [--max-tokens 256]

Its own process because llm-compressor 0.14 pins transformers <= 5.17 and
compressed-tensors 0.19, older than the project's; it runs under an interpreter that has
them (a venv whose site-packages add the project's, see docs/PERF.md). FILE.json is a
list of calibration texts. Every linear layer of the decoder is quantized; the LM head
(Gemma's tied token table) stays as it is, as llm-compressor's examples leave it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

SCHEME = "W4A16"


def transformers_dir(source: str, staging: str) -> str:
    """`source` as transformers opens it: the engine's GGUF conversion writes
    model-00001.safetensors, ... with no index, so `staging` gets links to its files and
    the index that names them."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(source) if f.endswith(".safetensors"))
    if "model.safetensors" in files or any(f.endswith(".index.json") for f in os.listdir(source)):
        return source
    weight_map = {}
    for name in files:
        with safe_open(os.path.join(source, name), "pt") as f:
            weight_map |= dict.fromkeys(f.keys(), name)
    for name in os.listdir(source):
        os.symlink(os.path.join(source, name), os.path.join(staging, name))
    with open(os.path.join(staging, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return staging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--calibration", required=True, help="a JSON list of texts")
    parser.add_argument("--max-tokens", type=int, default=256, help="per calibration text")
    args = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(args.calibration) as f:
        texts = json.load(f)
    staging = tempfile.mkdtemp()
    source = transformers_dir(args.source, staging)
    tokenizer = AutoTokenizer.from_pretrained(source)
    # bfloat16 scales, as W4A16 checkpoints are published; GPTQ's Hessian is float32
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    ids = [tokenizer(t, truncation=True, max_length=args.max_tokens)["input_ids"] for t in texts]
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})
    print(f"GPTQ {SCHEME}: {len(ids)} texts, {sum(map(len, ids))} tokens", flush=True)
    start = time.perf_counter()
    oneshot(
        model=model,
        processor=tokenizer,
        dataset=data,
        recipe=GPTQModifier(targets="Linear", scheme=SCHEME, ignore=["lm_head"]),
        max_seq_length=args.max_tokens,
        num_calibration_samples=len(ids),
    )
    print(f"quantized in {time.perf_counter() - start:.0f} s", flush=True)
    tmp = args.out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, save_compressed=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, args.out)
    shutil.rmtree(staging)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
