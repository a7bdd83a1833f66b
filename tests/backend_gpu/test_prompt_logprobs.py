"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' log-softmax of its
own forward over the prompt, whatever the batching: whole or chunked prefill, a repeat
that must not take the prefix cache, preemption, tensor parallelism; requests that did
not ask are untouched; the gateway's adapter hands them on as decoded strings."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from backend_gpu import LLM, SamplingParams
from gateway.backends import BackendSpec, GenRequest, build_backend
from tests.backend_gpu.reference import NEAR_TIE
from tests.backend_gpu.test_correctness import preempting_llm
from tests.backend_gpu.tiny_models import VOCAB

TOL = 1e-4
TOP_N = 5
_references: dict[str, list[torch.Tensor]] = {}


def prompt_ids() -> list[list[int]]:
    rng = random.Random(4321)
    return [[rng.randrange(4, VOCAB) for _ in range(n)] for n in (1, 2, 17, 50, 70)]


def reference(model_dir: str) -> list[torch.Tensor]:
    """Per prompt: transformers' log-softmax over the vocabulary at each prompt position
    but the last, [len - 1, V] (float32)."""
    if model_dir not in _references:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval()
        refs = []
        with torch.inference_mode():
            for prompt in prompt_ids():
                logits = model(torch.tensor([prompt])).logits[0].float()
                refs.append(logits[:-1].log_softmax(-1))
        _references[model_dir] = refs
    return _references[model_dir]


def params(n: int | None = TOP_N, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 3)
    return SamplingParams(temperature=0, ignore_eos=True, prompt_logprobs=n, **kwargs)


def assert_matches(out, prompt: list[int], ref: torch.Tensor, n: int = TOP_N) -> None:
    """One entry per prompt token, None first; each the reference's logprob of the next
    prompt token and its top n (ids equal unless their values are near-tied)."""
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for position, lp in enumerate(lps[1:]):
        token = prompt[position + 1]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(ref[position, token].item(), abs=TOL), position
        want = ref[position].topk(n) if n else None
        assert len(lp.top) == n
        if not n:
            continue
        got_ids, got_values = zip(*lp.top, strict=True)
        assert list(got_values) == pytest.approx(want.values.tolist(), abs=TOL), position
        for rank, (got, wanted) in enumerate(zip(got_ids, want.indices.tolist(), strict=True)):
            if got != wanted:  # allowed only where the reference's value is near-tied
                assert abs(ref[position, got] - ref[position, wanted]) <= NEAR_TIE, (
                    position,
                    rank,
                )


SETTINGS = {
    "whole-prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=128),
    # chunks of 16 tokens; two seats, so the LM head runs on slices of at most 3 rows
    "chunked": dict(max_num_batched_tokens=16, max_num_seqs=2),
}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_prompt_logprobs_match_transformers(tiny_model_dir, arch, setting):
    model_dir = tiny_model_dir(arch)
    llm = LLM(model_dir, **SETTINGS[setting])
    if setting == "chunked":
        assert llm.engine.runner.logit_rows == 3
        assert max(map(len, prompt_ids())) > 4 * 16
    outs = llm.generate(prompt_ids(), params())
    for out, prompt, ref in zip(outs, prompt_ids(), reference(model_dir), strict=True):
        assert_matches(out, prompt, ref)
    assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_repeat_takes_no_prefix_cache_hit(tiny_model_dir):
    """The same prompt twice: the second computes every position again (no hit) and gets
    the same values; a request without prompt logprobs does hit the blocks they left."""
    model_dir = tiny_model_dir("llama")
    llm = LLM(model_dir, max_num_batched_tokens=32)
    prompt, ref = prompt_ids()[4], reference(model_dir)[4]
    first = llm.generate([prompt], params())[0]
    second = llm.generate([prompt], params())[0]
    assert llm.stats().prefix_hits == 0 and second.num_cached_tokens == 0
    assert_matches(second, prompt, ref)
    assert second.prompt_logprobs == first.prompt_logprobs
    plain = llm.generate([prompt], params(None))[0]
    assert plain.prompt_logprobs is None
    assert llm.stats().prefix_hits > 0 and plain.num_cached_tokens >= 64


def test_zero_alternatives(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    llm = LLM(model_dir, max_num_batched_tokens=32)
    prompt, ref = prompt_ids()[3], reference(model_dir)[3]
    out = llm.generate([prompt], params(0))[0]
    assert_matches(out, prompt, ref, n=0)
    assert all(lp.top == [] for lp in out.prompt_logprobs[1:])


def test_others_in_the_batch_are_unchanged(tiny_model_dir):
    """Requests with and without prompt logprobs share steps (chunked): the others'
    tokens and sampled logprobs are those of a batch where nobody asked."""
    llm = LLM(tiny_model_dir("llama"), max_num_batched_tokens=24)
    prompts = prompt_ids()[2:] * 2
    plain = [params(None, max_tokens=6, logprobs=3)] * len(prompts)
    mixed = [params(n, max_tokens=6, logprobs=3) for n in (2, None, 4, None, 0, None)]
    want = llm.generate(prompts, plain)
    got = llm.generate(prompts, mixed)
    for p, w, g in zip(mixed, want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert [lp.logprob for lp in g.logprobs] == pytest.approx(
            [lp.logprob for lp in w.logprobs], abs=1e-5
        )
        assert [[t for t, _ in lp.top] for lp in g.logprobs] == [
            [t for t, _ in lp.top] for lp in w.logprobs
        ]
        assert (g.prompt_logprobs is None) == (p.prompt_logprobs is None)


def test_each_position_once_under_preemption(tiny_model_dir):
    """A pool too small for the batch: preempted requests are computed again, and each
    prompt position is still recorded once."""
    model_dir = tiny_model_dir("llama")
    llm = preempting_llm(model_dir)
    prompts = prompt_ids()[2:]
    outs = llm.generate(prompts, params(max_tokens=40))
    assert llm.stats().preemptions > 0
    for out, prompt, ref in zip(outs, prompts, reference(model_dir)[2:], strict=True):
        assert_matches(out, prompt, ref)


def test_two_ranks_score_what_one_does(tiny_model_dir):
    """Tensor parallelism: the prompt rows' logits are gathered over the ranks like the
    sampled ones, slice by slice on every rank."""
    model_dir = tiny_model_dir("llama")
    llm = LLM(model_dir, tensor_parallel_size=2, max_num_batched_tokens=16, max_num_seqs=2)
    outs = llm.generate(prompt_ids(), params())
    for out, prompt, ref in zip(outs, prompt_ids(), reference(model_dir), strict=True):
        assert_matches(out, prompt, ref)


async def test_gateway_adapter_first_chunk_carries_them(tiny_model_dir):
    spec = BackendSpec(
        name="gpu0",
        type="gpu",
        model=tiny_model_dir("llama"),
        options={"max_num_batched_tokens": 32},
    )
    backend = build_backend(spec)
    await backend.start()
    try:
        prompt = prompt_ids()[2]
        request = GenRequest(
            request_id="r1", model="tiny-llama", prompt_token_ids=prompt, sampling=params(2)
        )
        chunks = [c async for c in backend.generate(request)]
        decode = backend.engine.tokenizer.decode
        want = LLM(spec.model).generate([prompt], params(2))[0].prompt_logprobs
    finally:
        await backend.stop(drain=False)
    assert len(chunks) == 3 and all(c.prompt_logprobs is None for c in chunks[1:])
    lps = chunks[0].prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for token, lp, engine_lp in zip(prompt[1:], lps[1:], want[1:], strict=True):
        assert lp.token == decode([token])
        assert lp.logprob == pytest.approx(engine_lp.logprob, abs=1e-5)
        assert [t for t, _ in lp.top] == [decode([t]) for t, _ in engine_lp.top]
