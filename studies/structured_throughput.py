"""Output tokens/s with a JSON schema against without, same prompts and output lengths,
in one run, on the gpu engine and on the llama.cpp engine (default model: Gemma 3 270M).

    flock /tmp/bench.lock python -m studies.structured_throughput [--engines gpu,local]

A batch of prompts asking for a JSON record runs constrained by a schema (greedy) once
to learn each output's length and warm the grammar cache; then, `--rounds` times in
alternation, the batch without a schema (each request as long as its constrained output:
ignore_eos, max_tokens set to it) and the batch with the schema again. The ratio is the
constrained output tokens/s over the free one (the goal: at least 0.9x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from bench.options import DefaultsHelpFormatter
from engine_api.records import GenRequest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "born": {"type": "integer", "minimum": 1000, "maximum": 2030},
        "field": {"enum": ["physics", "chemistry", "biology", "mathematics", "computing"]},
        "city": {"type": "string", "maxLength": 30},
        "known_for": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["name", "born", "field", "city", "known_for"],
    "additionalProperties": False,
}
PEOPLE = [
    "Marie Curie",
    "Alan Turing",
    "Ada Lovelace",
    "Isaac Newton",
    "Rosalind Franklin",
    "Charles Darwin",
    "Emmy Noether",
    "Niels Bohr",
]


def prompts() -> list[str]:
    return [
        f"A JSON record about {who}, with name, born, field, city, known_for:\n" for who in PEOPLE
    ]


def run_gpu(texts: list[str], max_tokens: int, device: str, threads: int, rounds: int) -> dict:
    import torch

    from backend_gpu import LLM, SamplingParams
    from engine_api.structured import StructuredOutput
    from gateway.backends.default_model import default_model_path

    torch.set_num_threads(threads)  # on a shared CPU, fewer threads wait less for each other
    llm = LLM(str(default_model_path()), device=device, max_num_seqs=len(texts), max_model_len=1024)
    ids = [llm.tokenizer.encode(t) for t in texts]
    schema = SamplingParams(
        temperature=0, max_tokens=max_tokens, structured=StructuredOutput.from_schema(SCHEMA)
    )

    def batch(params) -> tuple[list[list[int]], float]:
        start = time.perf_counter()
        outs = llm.generate(ids, params)
        return [o.token_ids for o in outs], time.perf_counter() - start

    def free(lengths: list[int]) -> list[SamplingParams]:
        return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]

    decode = llm.tokenizer.batch_decode
    return _alternate(
        batch, schema, free, lambda outs: decode(outs, skip_special_tokens=True), rounds
    )


def run_local(texts: list[str], max_tokens: int, threads: int, rounds: int) -> dict:
    from backend_local import EngineConfig, LocalEngine, SamplingParams
    from engine_api.structured import StructuredOutput
    from gateway.backends.default_model import default_model_path

    n = len(texts)
    engine = LocalEngine(
        EngineConfig(
            str(default_model_path()), n_ctx=512 * n, n_parallel=n, n_batch=512, n_threads=threads
        )
    )
    ids = [engine.tokenize(t) for t in texts]
    schema = SamplingParams(
        temperature=0, max_tokens=max_tokens, structured=StructuredOutput.from_schema(SCHEMA)
    )

    async def one(i: int, prompt: list[int], params) -> list[int]:
        tokens: list[int] = []
        req = GenRequest(f"r{i}-{time.monotonic_ns()}", "", prompt, params)
        async for out in engine.generate(req):
            tokens += out.token_ids
        return tokens

    def batch(params) -> tuple[list[list[int]], float]:
        each = params if isinstance(params, list) else [params] * n

        async def all_of() -> list[list[int]]:
            return await asyncio.gather(
                *(one(i, p, s) for i, (p, s) in enumerate(zip(ids, each, strict=True)))
            )

        start = time.perf_counter()
        outs = asyncio.run(all_of())
        return outs, time.perf_counter() - start

    def free(lengths: list[int]) -> list[SamplingParams]:
        return [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]

    try:
        return _alternate(
            batch,
            schema,
            free,
            lambda outs: [engine.detokenize(o, skip_special_tokens=True) for o in outs],
            rounds,
        )
    finally:
        engine.shutdown()


def _alternate(batch, schema, free, decode, rounds: int) -> dict:
    """The constrained batch once (lengths, warm), then free and constrained `rounds`
    times each, alternating; tokens/s of each over all its runs, and each round's ratio
    (how much a shared machine moved them)."""
    outs, cold = batch(schema)
    lengths = [len(o) for o in outs]
    texts = decode(outs)
    valid = sum(_valid(t) for t in texts)
    seconds = {"free": 0.0, "schema": 0.0}
    ratios = []
    for _ in range(rounds):
        free_outs, t_free = batch(free(lengths))
        assert [len(o) for o in free_outs] == lengths
        again, t_schema = batch(schema)
        assert [len(o) for o in again] == lengths
        seconds["free"] += t_free
        seconds["schema"] += t_schema
        ratios.append(round(t_free / t_schema, 2))
    tokens = rounds * sum(lengths)
    return {
        "requests": len(lengths),
        "output_tokens_per_run": sum(lengths),
        "valid_json": f"{valid}/{len(texts)}",
        "first_schema_run_s": cold,
        "free_tok_s": tokens / seconds["free"],
        "schema_tok_s": tokens / seconds["schema"],
        "ratio": seconds["free"] / seconds["schema"],
        "round_ratios": ratios,
        "example": texts[0],
    }


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--engines", default="gpu,local", help="which of gpu, local")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="free and schema runs, alternating")
    p.add_argument("--device", default="cpu", help="the gpu engine's device")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    p.add_argument("--torch-threads", type=int, default=1, help="the gpu engine's on a CPU")
    args = p.parse_args(argv)
    results = {}
    for name in args.engines.split(","):
        if name == "gpu":
            results[name] = run_gpu(
                prompts(), args.max_tokens, args.device, args.torch_threads, args.rounds
            )
        else:
            results[name] = run_local(prompts(), args.max_tokens, args.threads, args.rounds)
    print("| engine | requests | output tokens | free tok/s | schema tok/s | ratio | valid |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['requests']} | {r['output_tokens_per_run']} | {r['free_tok_s']:.1f} "
            f"| {r['schema_tok_s']:.1f} | {r['ratio']:.2f}x | {r['valid_json']} |"
        )
    for name, r in results.items():
        print(
            f"{name}: ratio per round {r['round_ratios']}; first schema run "
            f"{r['first_schema_run_s']:.1f} s; e.g. {r['example']}"
        )


if __name__ == "__main__":
    main()
