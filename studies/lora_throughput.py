"""LoRA adapters per request (issue 34): what mixing adapters in one batch costs, and
what it saves over serving fine-tunes as separate merged models.

    python -m studies.lora_throughput --out docs/perf

A seeded random Llama (hidden 512, 4 layers, vocab 8192 by default) and 8 random PEFT
adapters of rank 16 on every attention and MLP projection. 16 streams each send their
requests one after another (closed loop: a stream's next request goes in when its
previous one finishes; prompts 64-128 random tokens, 64 output tokens, greedy,
ignore_eos), each request under a random one of the adapters. Arms, one after another
in one process, on the same requests:

- base: the base model alone, no adapters (enable_lora off);
- mixed: one engine with enable_lora and all 8 adapters resident (max_loras 8), each
  request under its own adapter in the same batches;
- naive: one merged model (peft's merge_and_unload, 8 model dirs saved beforehand)
  loaded at a time. The oldest waiting request picks the model (torn down and loaded
  when it is another); every waiting request for that model runs, and those that
  arrive for it while it runs join; when none is left the oldest waiting picks again;
- cold: on the idle mixed engine, a request (one output token) under an adapter never
  seen before, then one under the same adapter, now resident, with another prompt of
  the same length: the added time to first token, median over --cold-trials adapters.

Every engine gets as many short warm-up requests as there are adapters (mixed: one
under each) before its timing; the naive arm's loads are timed, being its cost.
Progress goes to stdout; OUTDIR/lora_throughput.json holds the figures,
OUTDIR/lora_throughput.png the plot.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.options import DefaultsHelpFormatter
from bench.tiny_model import build_tiny_llama, parameter_count
from studies.lora_throughput_report import plot, print_table

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ARMS = ["base", "mixed", "naive", "cold"]


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    adapter: int  # index into the adapters


@dataclass
class Served:
    """One arm's run: output tokens over wall seconds, the naive arm's swaps."""

    requests: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    swaps: int = 0
    load_seconds: float = 0.0
    tokens_per_s: float = 0.0
    stats: dict = field(default_factory=dict)


def make_streams(args: argparse.Namespace) -> list[list[Request]]:
    rng = random.Random(args.seed)
    lo, hi = args.prompt_lens

    def request() -> Request:
        prompt = [rng.randrange(3, args.vocab) for _ in range(rng.randint(lo, hi))]
        return Request(prompt, rng.randrange(args.adapters))

    return [[request() for _ in range(args.per_stream)] for _ in range(args.streams)]


def save_adapters(model_dir: str, root: Path, count: int, args) -> list[Path]:
    """`count` random PEFT adapters (A as PEFT starts it, B random rather than zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS)
    dirs = []
    for i in range(count):
        torch.manual_seed(args.seed + 1 + i)
        peft_model = get_peft_model(model, config)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.02)
        dirs.append(root / f"adapter-{i}")
        peft_model.save_pretrained(dirs[-1])
        model = peft_model.unload()  # the base model back, its own weights untouched
    return dirs


def save_merged(model_dir: str, adapters: list[Path], root: Path) -> list[Path]:
    """One full model per adapter, the adapter merged into its weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dirs = []
    for i, adapter in enumerate(adapters):
        merged = PeftModel.from_pretrained(copy.deepcopy(base), adapter).merge_and_unload()
        dirs.append(root / f"merged-{i}")
        shutil.copytree(model_dir, dirs[-1], ignore=shutil.ignore_patterns("*.safetensors"))
        merged.save_pretrained(dirs[-1])
    return dirs


def engine_kwargs(args, lora: bool) -> dict:
    kwargs = dict(
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.streams,
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
    )
    if lora:
        kwargs |= dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    return kwargs


def load(model: str, kwargs: dict):
    from backend_gpu import LLM

    return LLM(model, **kwargs).engine


def drop(engine) -> None:
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def warm_up(engine, refs: list) -> None:
    """Short requests at once, one per entry of `refs` (an adapter or None): first-call
    costs out of the timing, the adapters resident."""
    from engine_api.records import GenRequest
    from engine_api.sampling import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for i, ref in enumerate(refs):
        engine.add_request(GenRequest(f"warm-{i}", "", [1, *range(10, 40)], params, adapter=ref))
    while engine.has_unfinished_requests():
        engine.step()


class Streams:
    """The closed loop: each stream's next request is released when its previous one
    finishes; `waiting` holds the released ones not yet handed to an engine, oldest first."""

    def __init__(self, streams: list[list[Request]]) -> None:
        self.pending = [deque(s) for s in streams]
        self.waiting: list[tuple[str, Request]] = []
        self.owner: dict[str, int] = {}
        self.served = Served()
        for s in range(len(streams)):
            self.release(s)

    def release(self, stream: int) -> None:
        if self.pending[stream]:
            rid = f"{stream}-{len(self.pending[stream])}"
            self.owner[rid] = stream
            self.waiting.append((rid, self.pending[stream].popleft()))

    def take(self, adapter: int | None = None) -> list[tuple[str, Request]]:
        """The waiting requests (for `adapter` only, when given), out of `waiting`."""
        taken = [w for w in self.waiting if adapter is None or w[1].adapter == adapter]
        self.waiting = [w for w in self.waiting if w not in taken]
        return taken

    def run(self, engine, refs: list | None, params, adapter: int | None = None) -> None:
        """Step `engine` until it and the waiting requests (for `adapter`) are done."""
        from engine_api.records import GenRequest

        def submit() -> None:
            for rid, req in self.take(adapter):
                ref = refs[req.adapter] if refs else None
                engine.add_request(GenRequest(rid, "", req.prompt, params, adapter=ref))

        submit()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    self.served.requests += 1
                    self.served.output_tokens += len(out.token_ids)
                    self.release(self.owner[out.request_id])
            submit()
        print(f"  {self.served.requests} requests done", flush=True)


def params_for(args):
    from engine_api.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)


def run_one_engine(engine, streams, refs: list | None, args) -> Served:
    """base or mixed: every request to the one engine, 16 streams at once."""
    loop = Streams(streams)
    start = time.perf_counter()
    loop.run(engine, refs, params_for(args))
    loop.served.seconds = time.perf_counter() - start
    loop.served.stats = asdict(engine.stats())
    return loop.served


def run_naive(merged: list[Path], streams, args) -> Served:
    """One merged model at a time, swapped for the oldest waiting request's."""
    loop = Streams(streams)
    kwargs, params = engine_kwargs(args, lora=False), params_for(args)
    engine, loaded = None, None
    start = time.perf_counter()
    while loop.waiting:
        adapter = loop.waiting[0][1].adapter
        if adapter != loaded:
            t = time.perf_counter()
            if engine is not None:
                drop(engine)
            engine, loaded = load(str(merged[adapter]), kwargs), adapter
            loop.served.load_seconds += time.perf_counter() - t
            loop.served.swaps += 1
        loop.run(engine, None, params, adapter)
    loop.served.seconds = time.perf_counter() - start
    drop(engine)
    return loop.served


def time_to_first_token(engine, req) -> float:
    start = time.perf_counter()
    engine.add_request(req)
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.request_id == req.request_id and out.token_ids:
                ttft = time.perf_counter() - start
    return ttft


def run_cold(engine, cold: list[Path], args) -> dict:
    """Per never-seen adapter: TTFT of its first request, then of one while resident."""
    from engine_api.records import AdapterRef, GenRequest
    from engine_api.sampling import SamplingParams

    rng = random.Random(args.seed + 1000)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    length = sum(args.prompt_lens) // 2
    trials = []
    for i, path in enumerate(cold):
        ref = AdapterRef(f"cold-{i}", str(path))
        ttft = {}
        for kind in ("cold", "resident"):
            prompt = [rng.randrange(3, args.vocab) for _ in range(length)]
            req = GenRequest(f"{kind}-{i}", "", prompt, params, adapter=ref)
            ttft[kind] = time_to_first_token(engine, req)
        trials.append(ttft)
        print(f"  cold {ttft['cold'] * 1e3:.1f} ms, resident {ttft['resident'] * 1e3:.1f} ms")
    added = [t["cold"] - t["resident"] for t in trials]
    return {
        "prompt_len": length,
        "trials": trials,
        "median_cold_s": statistics.median(t["cold"] for t in trials),
        "median_resident_s": statistics.median(t["resident"] for t in trials),
        "median_added_s": statistics.median(added),
    }


def run_arms(args, streams, model_dir: str, root: Path) -> dict:
    arms: dict = {}
    adapters = save_adapters(model_dir, root, args.adapters + args.cold_trials, args)
    cold, adapters = adapters[args.adapters :], adapters[: args.adapters]
    from engine_api.records import AdapterRef

    refs = [AdapterRef(f"adapter-{i}", str(p)) for i, p in enumerate(adapters)]
    if "base" in args.arms:
        print("base model alone", flush=True)
        engine = load(model_dir, engine_kwargs(args, lora=False))
        warm_up(engine, [None] * args.adapters)
        arms["base"] = run_one_engine(engine, streams, None, args)
        drop(engine)
    if "mixed" in args.arms or "cold" in args.arms:
        engine = load(model_dir, engine_kwargs(args, lora=True))
        warm_up(engine, refs)
        if "mixed" in args.arms:
            print(f"{args.adapters} adapters mixed", flush=True)
            arms["mixed"] = run_one_engine(engine, streams, refs, args)
        if "cold" in args.arms:
            print("first request to an adapter not yet loaded", flush=True)
            arms["cold"] = run_cold(engine, cold, args)
        drop(engine)
    if "naive" in args.arms:
        print("merged models, swapped on demand", flush=True)
        merged = save_merged(model_dir, adapters, root)
        arms["naive"] = run_naive(merged, streams, args)
    for served in arms.values():
        if isinstance(served, Served):
            served.tokens_per_s = served.output_tokens / served.seconds
    return {k: asdict(v) if isinstance(v, Served) else v for k, v in arms.items()}


def ratios(arms: dict) -> dict:
    rate = {k: v["tokens_per_s"] for k, v in arms.items() if "tokens_per_s" in v}
    out = {}
    if "mixed" in rate and "base" in rate:
        out["mixed_over_base"] = rate["mixed"] / rate["base"]
    if "mixed" in rate and "naive" in rate:
        out["mixed_over_naive"] = rate["mixed"] / rate["naive"]
    return out


def environment(args) -> dict:
    def git(*cmd: str) -> str:
        run = subprocess.run(["git", *cmd], capture_output=True, text=True, check=False)
        return run.stdout.strip()

    env = {
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--", "studies", "backend_gpu")),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_average_start": os.getloadavg(),
        "device": args.device,
    }
    if args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--out", required=True, help="directory for lora_throughput.json and .png")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=ARMS)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--per-stream", type=int, default=4, help="requests each stream sends")
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[64, 128], metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--cold-trials", type=int, default=5, help="adapters never seen before")
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python -m studies.lora_throughput " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    streams = make_streams(args)
    env = environment(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(
            build_tiny_llama(
                Path(tmp) / "base",
                args.hidden,
                args.layers,
                args.heads,
                args.heads // 2,
                seed=args.seed,
                vocab_size=args.vocab,
                max_position_embeddings=1024,
            )
        )
        config = vars(args) | {"parameters": parameter_count(model_dir)}
        arms = run_arms(args, streams, model_dir, Path(tmp))
    env["load_average_end"] = os.getloadavg()
    result = {"command": command, "env": env, "config": config, "arms": arms}
    result["ratios"] = ratios(arms)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_throughput.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "lora_throughput.png")
    print_table(result)
    return result


if __name__ == "__main__":
    main()
