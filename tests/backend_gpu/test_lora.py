"""LoRA adapters per request (backend_gpu/lora): each adapter's greedy output equals
transformers with PEFT's on tiny random models, a mixed batch equals each request alone,
more adapters than slots are all served, and the prefix cache never shares a block
between adapters."""

from __future__ import annotations

import pytest
import torch

from backend_gpu.engine import LLMEngine
from backend_gpu.llm import LLM
from engine_api.records import AdapterRef, GenRequest
from engine_api.sampling import SamplingParams
from tests.backend_gpu.lora_adapters import peft_greedy, save_random_adapter
from tests.backend_gpu.reference import assert_greedy_matches

PROMPTS = [[1, *range(40, 62)], [1, 70, 71, 72, 73], [1, *range(100, 137)]]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

# (arch, adapter settings): ranks, targets (packed and plain, attention and MLP, a subset
# or PEFT's "all-linear") and scalings (alpha / r, rsLoRA's alpha / sqrt(r)) differ
ADAPTERS = {
    "llama": [
        dict(r=8, alpha=16, targets=["q_proj", "v_proj", "down_proj"]),
        dict(r=4, alpha=4, targets="all-linear", rslora=True, seed=2),
    ],
    "qwen3": [dict(r=16, alpha=8, targets=["k_proj", "o_proj", "gate_proj", "up_proj"])],
    "gemma3": [dict(r=6, alpha=12, targets="all-linear", rslora=True)],
}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """adapter(arch, i) -> (model dir, AdapterRef) of ADAPTERS[arch][i], made once."""
    root = tmp_path_factory.mktemp("lora")

    def make(arch: str, i: int) -> tuple[str, AdapterRef]:
        model = tiny_model_dir(arch)
        name = f"{arch}-{i}"
        path = save_random_adapter(model, str(root / name), **ADAPTERS[arch][i])
        return model, AdapterRef(name, path)

    return make


def run(engine: LLMEngine, requests: list[GenRequest]) -> dict[str, list[int]]:
    """Add all of `requests` at once and step until they finish: their output ids."""
    for req in requests:
        engine.add_request(req)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
    return outs


def request(rid: str, prompt: list[int], adapter: AdapterRef | None) -> GenRequest:
    return GenRequest(rid, "", prompt, GREEDY, adapter=adapter)


def lora_engine(model: str, **kwargs) -> LLMEngine:
    kwargs = {"kv_cache_memory_bytes": 1 << 23, "enable_lora": True, **kwargs}
    return LLM(model, **kwargs).engine


@pytest.mark.parametrize(("arch", "i"), [("llama", 0), ("llama", 1), ("qwen3", 0), ("gemma3", 0)])
def test_adapter_greedy_equals_peft(adapters, arch, i):
    model, ref = adapters(arch, i)
    expected = peft_greedy(model, ref.path, PROMPTS, MAX_TOKENS)
    base = peft_greedy(model, None, PROMPTS, MAX_TOKENS)
    engine = lora_engine(model)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    for j, prompt in enumerate(PROMPTS):
        engine.add_request(GenRequest(str(j), "", prompt, params, adapter=ref))
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {out.request_id: out for out in engine.step() if out.finished}
    for j, ((ids, logits), (_, base_logits)) in enumerate(zip(expected, base, strict=True)):
        assert_greedy_matches(outs[str(j)].token_ids, ids, logits)
        # the chosen tokens' logprobs are PEFT's, and not the base model's (else this
        # test would pass with the adapter ignored: tiny Gemma repeats its last token)
        ours = torch.tensor([lp.logprob for lp in outs[str(j)].logprobs])
        theirs = logits.log_softmax(-1)[torch.arange(MAX_TOKENS), ids]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
        assert (logits[0] - base_logits[0]).abs().max() > 0.05


def test_mixed_batch_equals_each_alone(adapters):
    model, a = adapters("llama", 0)
    _, b = adapters("llama", 1)
    _, c = adapters("qwen3", 0)  # the same shapes as the tiny llama: it fits as a third
    mix = [None, a, b, c]
    engine = lora_engine(model)
    alone = {}
    for k, adapter in enumerate(mix):
        alone |= run(engine, [request(f"{k}-{j}", p, adapter) for j, p in enumerate(PROMPTS)])
    together = run(
        engine,
        [request(f"{k}-{j}", p, ad) for j, p in enumerate(PROMPTS) for k, ad in enumerate(mix)],
    )
    assert together == alone
    assert len({tuple(alone[f"{k}-0"]) for k in range(len(mix))}) == len(mix)


def test_more_adapters_than_slots_all_served(adapters):
    model, a = adapters("llama", 0)
    _, b = adapters("llama", 1)
    _, c = adapters("qwen3", 0)
    mix = [a, b, c, None]
    wide = lora_engine(model)
    expected = run(wide, [request(f"{k}", PROMPTS[0], ad) for k, ad in enumerate(mix)])
    # one slot, one host copy: every adapter waits for the slot and is read again
    narrow = lora_engine(model, max_loras=1, max_cpu_loras=1)
    got = run(narrow, [request(f"{k}", PROMPTS[0], ad) for k, ad in enumerate(mix)])
    assert got == expected
    stats = narrow.stats()
    assert stats.lora_loads == 3 and len(stats.adapters_loaded) == 1
    assert wide.stats().lora_loads == 3 and sorted(wide.stats().adapters_loaded) == sorted(
        ad.name for ad in (a, b, c)
    )


def test_prefix_cache_is_salted_by_adapter(adapters):
    model, a = adapters("llama", 0)
    _, b = adapters("llama", 1)
    engine = lora_engine(model, block_size=4)
    prompt = PROMPTS[2]
    whole = (len(prompt) - 1) // 4 * 4  # its full blocks, leaving one token to compute

    def cached_tokens(rid: str, adapter: AdapterRef | None) -> int:
        engine.add_request(request(rid, prompt, adapter))
        cached = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                cached = out.num_cached_tokens
        return cached

    assert cached_tokens("a1", a) == 0
    assert cached_tokens("b1", b) == 0  # the same tokens under another adapter: no hit
    assert cached_tokens("base", None) == 0  # nor for the base model
    assert cached_tokens("a2", a) == whole  # the same adapter again: all of it
    assert cached_tokens("b2", b) == whole


def test_remove_adapter_then_reload(adapters):
    model, a = adapters("llama", 0)
    engine = lora_engine(model)
    first = run(engine, [request("1", PROMPTS[1], a)])
    engine.remove_adapter(a.name)
    assert engine.stats().adapters_loaded == []
    assert run(engine, [request("2", PROMPTS[1], a)])["2"] == first["1"]
    assert engine.stats().lora_loads == 2
    # removed again while its next request waits for its read: read again, served alike
    engine.remove_adapter(a.name)
    engine.add_request(request("3", PROMPTS[1], a))
    engine.remove_adapter(a.name)
    assert run(engine, [])["3"] == first["1"]
    assert engine.stats().lora_loads == 3
