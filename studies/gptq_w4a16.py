"""The quantization step of studies/int4_quality.py, a process of its own: llm-compressor's
GPTQ to W4A16 (symmetric 4-bit weights, one scale per group of 128 inputs) of an HF
model directory on the CPU, saved as compressed-tensors (pack-quantized).

    PYTHON -m studies.gptq_w4a16 SOURCE_DIR OUT_DIR --calibration FILE.json [--max-tokens 256]
        [--asymmetric] [--observer mse] [--table]

Its own process because llm-compressor 0.14 pins transformers <= 5.17 and
compressed-tensors 0.19, older than the project's; it runs under an interpreter that has
them (a venv whose site-packages add the project's, see docs/PERF.md). FILE.json is a
list of calibration texts. Every linear layer of the decoder is quantized by GPTQ (with
llm-compressor's default act order, "static": the weights are reordered while
quantizing, the groups stay in order). The LM head (Gemma's tied token table) stays as
it is, as llm-compressor's examples leave it, unless `--table`: then the table is
quantized too, to the same 4-bit groups, by rounding (GPTQ is for a linear layer's
inputs, and the table is also the embedding), as both its roles, so that llm-compressor
finds the two equal and saves one table, still tied: in a small model the table is
most of the bytes (Gemma 3 270M: 63 %).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

SCHEME = "W4A16"
TABLE = ["re:.*embed_tokens$", "lm_head"]  # both roles of the tied table
TABLE_MODES = ("none", "round", "gptq")


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


def checkpoint_file(directory: str) -> str:
    """The one safetensors file a model of this size is saved in."""
    files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    assert len(files) == 1, f"{directory}: one safetensors file expected, not {files}"
    return os.path.join(directory, files[0])


def rewrite(directory: str, drop: str, ignore: list[str] | None = None) -> None:
    """Drop the tensors named `drop`... from the checkpoint in `directory` and say in
    its config that the embeddings are tied (and, given, what the quantization ignores)."""
    from safetensors.torch import load_file, save_file

    path = checkpoint_file(directory)
    tensors = load_file(path)
    save_file({n: t for n, t in tensors.items() if not n.startswith(drop)}, path)
    config_path = os.path.join(directory, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tie_word_embeddings"] = True
    if ignore is not None:
        config["quantization_config"]["ignore"] = ignore
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def tie_table(directory: str, mode: str) -> None:
    """Save the quantized table once, tied. "round": llm-compressor re-ties a table
    whose two roles hold equal tensors, but it compares every buffer, and Gemma 3's
    embedding has one the head lacks (embed_scale), so both copies are written: the
    head's is dropped here when it equals the embedding's. "gptq": GPTQ quantized the
    head alone and the embedding stayed 16-bit; the embedding is dropped and reads the
    head's table."""
    import torch
    from safetensors import safe_open

    with safe_open(checkpoint_file(directory), "pt") as f:
        names = f.keys()
        tensors = {n: f.get_tensor(n) for n in names if "layers." not in n}
    head = {n[len("lm_head.") :]: t for n, t in tensors.items() if n.startswith("lm_head.")}
    embed = "model.embed_tokens."
    if mode == "gptq":
        assert "weight_packed" in head, "GPTQ left the head unquantized"
        rewrite(directory, drop=embed)
    elif head and all(torch.equal(t, tensors.get(embed + n, t[:0])) for n, t in head.items()):
        rewrite(directory, drop="lm_head.")
    else:
        raise SystemExit(f"{directory}: the LM head and the token table differ")


def untable(directory: str) -> None:
    """The checkpoint of `directory` (its head quantized by GPTQ, its embedding 16-bit)
    with the head dropped: tied to the 16-bit embedding, ignored by the config."""
    rewrite(directory, drop="lm_head.", ignore=["lm_head"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--calibration", required=True, help="a JSON list of texts")
    parser.add_argument("--max-tokens", type=int, default=256, help="per calibration text")
    parser.add_argument("--asymmetric", action="store_true", help="a zero point per group")
    parser.add_argument("--observer", default="minmax", help="llm-compressor's, for the scales")
    parser.add_argument(
        "--table",
        choices=TABLE_MODES,
        default="none",
        help="the tied token table: left 16-bit; rounded in both roles; GPTQ as the head",
    )
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument(
        "--untabled-out",
        help="with --table gptq: also write the same checkpoint with the table left 16-bit "
        "(the head is GPTQ's last layer, so the decoder's layers are the same)",
    )
    args = parser.parse_args(argv)

    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(args.calibration) as f:
        texts = json.load(f)
    staging = tempfile.mkdtemp()
    source = transformers_dir(args.source, staging)
    tokenizer = AutoTokenizer.from_pretrained(source)
    # calibrated in float32 (this CPU's bfloat16 matmuls are slower, and rounder); the
    # scales stored in bfloat16, as W4A16 checkpoints are published
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    ids = [tokenizer(t, truncation=True, max_length=args.max_tokens)["input_ids"] for t in texts]
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})
    weights = QuantizationArgs(
        num_bits=4,
        strategy="group",
        group_size=args.group_size,
        symmetric=not args.asymmetric,
        observer=args.observer,
        scale_dtype=torch.bfloat16,
    )
    recipe = [
        GPTQModifier(
            config_groups={"linear": QuantizationScheme(targets=["Linear"], weights=weights)},
            ignore=[] if args.table == "gptq" else ["lm_head"],
        )
    ]
    if args.table == "round":  # rounded first, GPTQ's layers then see the quantized embedding
        table = QuantizationScheme(
            targets=TABLE, weights=weights.model_copy(), format="pack-quantized"
        )
        recipe.insert(0, QuantizationModifier(config_groups={"table": table}))
    print(f"GPTQ {SCHEME}: {len(ids)} texts, {sum(map(len, ids))} tokens", flush=True)
    start = time.perf_counter()
    oneshot(
        model=model,
        processor=tokenizer,
        dataset=data,
        recipe=recipe,
        max_seq_length=args.max_tokens,
        num_calibration_samples=len(ids),
    )
    print(f"quantized in {time.perf_counter() - start:.0f} s", flush=True)
    tmp = args.out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, save_compressed=True)
    tokenizer.save_pretrained(tmp)
    if args.untabled_out:
        assert args.table == "gptq", "--untabled-out is for --table gptq"
        untabled = args.untabled_out + ".tmp"
        shutil.rmtree(untabled, ignore_errors=True)
        shutil.copytree(tmp, untabled)
        untable(untabled)
        os.replace(untabled, args.untabled_out)
    if args.table != "none":
        tie_table(tmp, args.table)
    os.replace(tmp, args.out)
    shutil.rmtree(staging)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
