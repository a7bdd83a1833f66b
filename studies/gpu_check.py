"""kvgate's engine on one GPU, in numbers: the throughput half of the GPU check.

    python -m studies.gpu_check --out OUTDIR [--budget-s 250]

studies/gpu_check.sh runs it after the CUDA-marked tests. A random-weight model shaped
like Llama 3 8B (load_format "dummy": nothing is read from disk, nothing written) and
one seeded workload (prompts and outputs of random lengths, greedy, ignore_eos) are run
by kvgate in bfloat16, kvgate with FP8 weights (W8A8 on FP8 tensor cores), and
transformers' continuous batching in bfloat16 on the same GPU. Then one request alone
(batch 1) on each kvgate engine: every decode step reads the weights (all but the input
embedding table, a lookup) and the request's KV cache, so decode tokens/s x those bytes
per token / the GPU's memory bandwidth is the share of the bandwidth a decode uses.

Each run gets a share of --budget-s; one that runs out stops there, says so, and its
rate counts what it finished. OUTDIR/gpu_check.json is rewritten after each run, so a
run cut short keeps what came before.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.options import DefaultsHelpFormatter
from engine_api.records import GenRequest

# Llama 3 8B's shape; "tiny" runs the whole check on a CPU in seconds (a smoke test)
SHAPES = {
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
    ),
}
PARTS = ["kvgate_bf16", "kvgate_fp8", "transformers_cb"]
# each part's share of the time budget (what one leaves unused goes to the next)
WEIGHTS = {"kvgate_bf16": 3, "kvgate_fp8": 3, "transformers_cb": 4}
H200_BANDWIDTH = 4.8e12  # bytes/s, the datasheet's HBM3e figure


@dataclass
class Throughput:
    requests: int  # finished
    output_tokens: int
    seconds: float
    cut: bool  # stopped at its deadline

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def decode_bytes_per_token(
    weight_bytes: int, lookup_bytes: int, kv_bytes_per_position: int, mean_context: float
) -> float:
    """Bytes one batch-1 decode step reads: the weights but the ones only looked up (an
    untied input embedding table), and the request's KV cache."""
    return weight_bytes - lookup_bytes + kv_bytes_per_position * mean_context


def bandwidth_share(tokens_per_s: float, bytes_per_token: float, peak_bytes_per_s: float) -> float:
    return tokens_per_s * bytes_per_token / peak_bytes_per_s


def workload(
    n: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], vocab: int, seed: int
):
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_lens))],
            rng.randint(*output_lens),
        )
        for _ in range(n)
    ]


def write_model_dir(shape: dict, directory: Path) -> None:
    """config.json and a word-level tokenizer covering the vocabulary; no weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, shape["vocab_size"])}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    config = LlamaConfig(
        **shape,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def run_engine(engine, requests, deadline: float) -> Throughput:
    """All requests at once through the engine's step loop, until done or the deadline."""
    from backend_gpu import SamplingParams

    for i, (prompt, n) in enumerate(requests):
        engine.add_request(
            GenRequest(
                str(i), "", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            )
        )
    start = time.perf_counter()
    generated = finished = 0
    while engine.has_unfinished_requests() and time.perf_counter() < deadline:
        for out in engine.step():
            generated += len(out.new_token_ids)
            finished += out.finished
    seconds = time.perf_counter() - start
    cut = engine.has_unfinished_requests()
    for request_id in list(engine.seqs):
        engine.abort_request(request_id)
    return Throughput(finished, generated, seconds, cut)


def batch1_decode(engine, prompt_len: int, tokens: int, deadline: float) -> dict:
    """One request alone; its decode rate from its first token to its last."""
    from backend_gpu import SamplingParams

    engine.add_request(
        GenRequest(
            "b1",
            "",
            [5] * prompt_len,
            SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
        )
    )
    stamps: list[tuple[float, int]] = []
    while engine.has_unfinished_requests() and time.perf_counter() < deadline:
        for out in engine.step():
            stamps.append((time.perf_counter(), len(out.new_token_ids)))
    if engine.has_unfinished_requests():
        engine.abort_request("b1")
    decoded = sum(n for _, n in stamps[1:])
    seconds = stamps[-1][0] - stamps[0][0] if len(stamps) > 1 else 0.0
    return {
        "decode_tokens": decoded,
        "seconds": seconds,
        "tokens_per_s": decoded / seconds if seconds else 0.0,
        "mean_context": prompt_len + (decoded + 1) / 2,
    }


def kvgate_part(model_dir: str, args, requests, deadline: float, quantization: str | None) -> dict:
    from backend_gpu import LLM

    built = time.perf_counter()
    llm = LLM(
        model_dir,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        quantization=quantization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine, runner = llm.engine, llm.engine.runner
    result: dict = {"build_s": time.perf_counter() - built, "dtype": engine.config.dtype}
    # compiles the kernels of every shape the runs meet, outside the timing
    warm = workload(8, (1, 300), (2, 8), args.vocab, args.seed + 1)
    run_engine(engine, warm, deadline)
    graph_steps = runner.num_graph_steps
    run = run_engine(engine, requests, deadline)
    result |= asdict(run) | {"tokens_per_s": run.tokens_per_s}
    result["graph_steps"] = runner.num_graph_steps - graph_steps
    result["num_steps"] = engine.stats().num_steps
    result |= {"weight_bytes": runner.weight_bytes, "kv_cache_bytes": runner.kv_cache_bytes}
    b1 = batch1_decode(engine, args.batch1_prompt, args.batch1_tokens, deadline)
    lookup = 0 if _tied(runner.model) else _bytes(runner.model.model.embed_tokens)
    kv_per_position = 2 * len(runner.attention_layers) * runner.kv_row * runner.kv_dtype.itemsize
    per_token = decode_bytes_per_token(
        runner.weight_bytes, lookup, kv_per_position, b1["mean_context"]
    )
    b1 |= {
        "bytes_per_token": per_token,
        "bytes_per_s": b1["tokens_per_s"] * per_token,
        "bandwidth_share": bandwidth_share(b1["tokens_per_s"], per_token, args.peak_bandwidth),
    }
    result["batch1"] = b1
    return result


def _tied(model) -> bool:
    """Whether the LM head reads the input embedding table (bfloat16 or 8-bit)."""
    table, head = model.model.embed_tokens, model.lm_head
    return getattr(head, "weight", None) is table.weight or getattr(head, "table", None) is table


def _bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def transformers_part(model_dir: str, args, requests, deadline: float, record) -> None:
    """transformers' continuous batching manager (what `generate_batch` drives), each
    request with its own output length, timed after its set-up and warm-up. The result
    is recorded before the manager stops: stopping flushes what is left."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    built = time.perf_counter()
    config = AutoConfig.from_pretrained(model_dir)
    dtype_name = args.dtype
    if dtype_name == "auto":  # as kvgate's engine resolves it
        dtype_name = "bfloat16" if args.device == "cuda" else "float32"
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, dtype_name), attn_implementation="sdpa"
        )
    model.eval()
    generation = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    with model.continuous_batching_context_manager(
        generation_config=generation,
        block=True,
        continuous_batching_config=cpu_batching_config(requests) if args.device == "cpu" else None,
    ) as manager:
        build_s = time.perf_counter() - built
        start = time.perf_counter()
        pending = {manager.add_request(prompt, max_new_tokens=n) for prompt, n in requests}
        generated = 0
        while pending and time.perf_counter() < deadline:
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                generated += len(out.generated_tokens)
                pending.discard(out.request_id)
            elif out is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
        seconds = time.perf_counter() - start
        run = Throughput(len(requests) - len(pending), generated, seconds, bool(pending))
        record({"build_s": build_s} | asdict(run) | {"tokens_per_s": run.tokens_per_s})
        for request_id in pending:
            manager.cancel_request(request_id)


def cpu_batching_config(requests: list[tuple[list[int], int]]):
    """transformers' manager on a CPU, sized to the requests. Left to itself it sizes its
    KV cache as on a GPU, to 90% of the device's free memory, which on a CPU is the
    host's: gigabytes of cache, zero-filled at start (gigabytes of RSS on a shared machine), and batches of 8,192 tokens whose
    attention masks span all of it, for a run of a few dozen tokens (most of the smoke
    test's CPU time). On CUDA its own sizing stays, as the measurement is made."""
    from transformers import ContinuousBatchingConfig

    longest = max(len(prompt) + n for prompt, n in requests)
    pages = -(-longest // ContinuousBatchingConfig.page_size)  # a request's, rounded up
    return ContinuousBatchingConfig(
        num_blocks=pages * len(requests),  # every request at once, whole
        max_batch_tokens=sum(len(prompt) for prompt, _ in requests),  # one prefill of all
    )


def environment(args) -> dict:
    import transformers

    env = {
        "machine": platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": args.device,
    }
    if args.device == "cuda":
        import triton

        props = torch.cuda.get_device_properties(0)
        env |= {
            "gpu": props.name,
            "gpu_memory_bytes": props.total_memory,
            "triton": triton.__version__,
        }
    return env


def ratios(parts: dict) -> dict:
    rate = {k: v.get("tokens_per_s") for k, v in parts.items() if "tokens_per_s" in v}
    out = {}
    if rate.get("kvgate_bf16") and rate.get("transformers_cb"):
        out["kvgate_bf16_over_transformers_cb"] = rate["kvgate_bf16"] / rate["transformers_cb"]
    if rate.get("kvgate_bf16") and rate.get("kvgate_fp8"):
        out["kvgate_fp8_over_bf16"] = rate["kvgate_fp8"] / rate["kvgate_bf16"]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--out", required=True, help="directory for gpu_check.json")
    p.add_argument("--budget-s", type=float, default=250.0, help="seconds for all runs together")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    p.add_argument("--only", nargs="+", choices=PARTS, default=PARTS)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-lens", type=_span, default=(64, 512), help="min,max tokens")
    p.add_argument("--output-lens", type=_span, default=(64, 256), help="min,max tokens")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--batch1-prompt", type=int, default=128)
    p.add_argument("--batch1-tokens", type=int, default=256)
    p.add_argument("--peak-bandwidth", type=float, default=H200_BANDWIDTH, help="bytes/s")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.vocab = SHAPES[args.shape]["vocab_size"]
    return args


def _span(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}") from None
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"expected 0 < MIN <= MAX, got {text!r}")
    return low, high


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"args": vars(args), "env": environment(args), "parts": {}}
    requests = workload(
        args.num_requests, args.prompt_lens, args.output_lens, args.vocab, args.seed
    )
    end = time.perf_counter() + args.budget_s
    with tempfile.TemporaryDirectory() as model_dir:
        write_model_dir(SHAPES[args.shape], Path(model_dir))
        for i, part in enumerate(args.only):
            left = sum(WEIGHTS[p] for p in args.only[i:])
            deadline = time.perf_counter() + (end - time.perf_counter()) * WEIGHTS[part] / left
            print(f"gpu_check: {part} ({deadline - time.perf_counter():.0f} s)", flush=True)

            def record(result: dict, part: str = part) -> None:
                results["parts"][part] = result
                results["ratios"] = ratios(results["parts"])
                print(f"gpu_check: {part}: {json.dumps(result)}", flush=True)
                (out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")

            try:
                if part == "transformers_cb":
                    transformers_part(model_dir, args, requests, deadline, record)
                else:
                    quantization = "fp8" if part == "kvgate_fp8" else None
                    record(kvgate_part(model_dir, args, requests, deadline, quantization))
            except Exception as e:  # one part failing must not lose the others' numbers
                record(results["parts"].get(part, {}) | {"error": f"{type(e).__name__}: {e}"})
            gc.collect()  # the engine and its GPU memory go before the next part
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print(json.dumps(results["ratios"]), flush=True)


if __name__ == "__main__":
    main()
