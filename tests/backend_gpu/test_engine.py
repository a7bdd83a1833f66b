"""Admission errors, aborts, block accounting, sampling options and detokenization."""

from __future__ import annotations

import pytest
import torch

from backend_gpu import LLM, PromptTooLongError, SamplingParams
from backend_gpu.detokenizer import IncrementalDetokenizer
from tests.backend_gpu.tiny_models import SENTENCES, build_tokenizer
from tests.requests import req


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), max_num_batched_tokens=32)


def all_blocks_free(llm: LLM) -> bool:
    stats = llm.stats()
    return stats.num_free_blocks == stats.num_blocks and stats.running == stats.waiting == 0


@pytest.mark.parametrize(
    ("prompt", "params", "error"),
    [
        ([], SamplingParams(), "empty"),
        ("", SamplingParams(), "empty"),
        ([5] * 300, SamplingParams(), "context"),
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
        ([5, 6], SamplingParams(temperature=-1), "temperature"),
        ([5, 6], SamplingParams(top_p=0), "top_p"),
        ([5, 6], SamplingParams(logprobs=21), "logprobs"),  # as backend_local caps it
        ([5, 10_000], SamplingParams(), "vocabulary"),
    ],
)
def test_bad_input_is_refused_at_admission_and_changes_nothing(llm, prompt, params, error):
    with pytest.raises(ValueError, match=error):
        llm.generate([[7, 8, 9], prompt], params)
    assert all_blocks_free(llm)
    assert not llm.engine.seqs
    # and the engine still serves
    assert len(llm.generate([[7, 8, 9]], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_prompt_too_long_names_the_limit(llm):
    with pytest.raises(PromptTooLongError) as info:
        llm.generate([[5] * 256])
    assert info.value.prompt_tokens == 256 and info.value.context_length == 256


def test_a_pool_smaller_than_one_sequence_is_refused_at_start(tiny_model_dir):
    """40 kB hold 4 blocks of 16 tokens (8 kB each): not one sequence of the model's 256
    positions. An error at start, not an engine that refuses most requests."""
    with pytest.raises(ValueError, match="fewer than the 16 blocks .* max_model_len 256"):
        LLM(tiny_model_dir("llama"), kv_cache_memory_bytes=40_000)
    small = LLM(tiny_model_dir("llama"), kv_cache_memory_bytes=40_000, max_model_len=64)
    assert small.stats().num_blocks == 4
    # the longest request fits the pool alone
    out = small.generate([[5] * 60], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert all_blocks_free(small)


def test_abort_unknown_is_noop_and_abort_frees_blocks(llm):
    engine = llm.engine
    assert engine.abort_request("nope") is None
    engine.add_request(req("a", [5] * 40, SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.add_request(req("b", [6] * 20, SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.add_request(req("c", [7] * 60, SamplingParams(max_tokens=50, ignore_eos=True)))
    for _ in range(4):
        engine.step()
    assert llm.stats().num_free_blocks < llm.stats().num_blocks
    out = engine.abort_request("b")
    assert out is not None and out.finish_reason == "abort"
    assert engine.abort_request("b") is None
    engine.abort_request("c")  # maybe still waiting or mid-prefill
    while engine.has_unfinished_requests():
        engine.step()
    assert all_blocks_free(llm)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=42, max_tokens=10)
    alone = llm.generate([[9, 10, 11]], seeded)[0].token_ids
    noise = SamplingParams(temperature=1.2, max_tokens=10)
    crowd = llm.generate([[20, 21], [9, 10, 11], [30] * 40], [noise, seeded, noise])
    assert crowd[1].token_ids == alone
    other = llm.generate([[9, 10, 11]], SamplingParams(temperature=1.0, seed=43, max_tokens=10))
    assert other[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate([[9, 10, 11]], SamplingParams(temperature=0, max_tokens=8))[0]
    for params in (
        SamplingParams(temperature=1.0, top_k=1, max_tokens=8),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8),
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8),
    ):
        assert llm.generate([[9, 10, 11]], params)[0].token_ids == greedy.token_ids


def test_stop_token_ids_min_tokens_and_max_tokens(llm):
    base = llm.generate([[9, 10, 11]], SamplingParams(temperature=0, max_tokens=8))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 8
    stop_at = base.token_ids[3]
    first = base.token_ids.index(stop_at)
    out = llm.generate(
        [[9, 10, 11]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at])
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == base.token_ids[: first + 1]
    blocked = llm.generate(
        [[9, 10, 11]],
        SamplingParams(temperature=0, max_tokens=8, min_tokens=8, stop_token_ids=[stop_at]),
    )[0]
    assert len(blocked.token_ids) == 8 and stop_at not in blocked.token_ids[: first + 1]


def test_stop_string_ends_and_is_cut_from_text(llm):
    base = llm.generate([[9, 10, 11]], SamplingParams(temperature=0, max_tokens=12))[0]
    assert len(base.text) >= 2
    stop = base.text[1:]
    out = llm.generate([[9, 10, 11]], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]


def test_penalties_change_greedy_output(llm):
    prompt = [[9, 10, 11]]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0].token_ids
    rep = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=16, repetition_penalty=50.0)
    )[0].token_ids
    freq = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=16, frequency_penalty=2.0)
    )[0].token_ids
    assert len(set(rep)) == len(rep)  # with a huge penalty no token repeats
    assert rep != plain or len(set(plain)) == len(plain)
    assert freq is not None


def test_logprobs_of_sampled_and_top_tokens(llm):
    out = llm.generate([[9, 10, 11]], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and len(lp.top) == 3
        assert lp.top[0][0] == token and lp.top[0][1] == pytest.approx(lp.logprob)
        assert lp.logprob <= 0 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_incremental_detokenizer_streams_multibyte_and_spaces_exactly():
    tok = build_tokenizer()
    for text in SENTENCES:
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, [1], stop=[])
        pieces = []
        for token in ids:
            detok.add([token])
            pieces.append(detok.take_delta(finished=False))
        pieces.append(detok.take_delta(finished=True))
        assert "".join(pieces) == tok.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)


def test_stop_string_across_tokens_is_held_back_then_cut():
    tok = build_tokenizer()
    text = SENTENCES[0]
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], stop=["brown f"])
    streamed, found = [], None
    for token in ids:
        found = detok.add([token])
        streamed.append(detok.take_delta(finished=found is not None))
        if found:
            break
    assert found == "brown f"
    assert "".join(streamed) == detok.output_text == "The quick "


def test_static_policy_gives_the_same_greedy_outputs(tiny_model_dir):
    prompts = [[5 + i] * (3 + 7 * i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cont = LLM(tiny_model_dir("llama"), max_num_seqs=3).generate(prompts, params)
    static_llm = LLM(tiny_model_dir("llama"), max_num_seqs=3, scheduling_policy="static")
    static = static_llm.generate(prompts, params)
    assert [o.token_ids for o in cont] == [o.token_ids for o in static]
    assert all_blocks_free(static_llm)
    # a static batch runs to its end before the next one starts
    engine = static_llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(req(f"s{i}", prompt, params))
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        running = {s.request_id for s in engine.scheduler.running}
        assert running <= {"s0", "s1", "s2"} or running <= {"s3", "s4", "s5"}
        seen.append(running)
    assert {"s0", "s1", "s2"} in seen and {"s3", "s4", "s5"} in seen


def test_bfloat16_runs_and_mostly_agrees_with_float32(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[5 + i] * (3 + 11 * i) for i in range(4)]
    fp32 = LLM(tiny_model_dir("llama")).generate(prompts, params)
    bf16_llm = LLM(tiny_model_dir("llama"), dtype="bfloat16")
    bf16 = bf16_llm.generate(prompts, params)
    assert bf16_llm.engine.runner.model.lm_head.weight.dtype == torch.bfloat16
    first_tokens_equal = sum(
        a.token_ids[0] == b.token_ids[0] for a, b in zip(fp32, bf16, strict=True)
    )
    assert first_tokens_equal >= 3
    assert all(len(o.token_ids) == 4 for o in bf16)


def test_special_tokens_are_text_only_when_asked(llm):
    """vLLM's skip_special_tokens: <s>, forced by logit_bias, is no text by default and
    its own text when kept (the output parsers' markers); an end-of-sequence token is
    text in neither case: it ends the output."""
    forced = {"temperature": 0, "max_tokens": 3, "logit_bias": {1: 100.0}}
    skipped = llm.generate([[9, 10, 11]], SamplingParams(**forced))[0]
    kept = llm.generate([[9, 10, 11]], SamplingParams(**forced, skip_special_tokens=False))[0]
    assert skipped.token_ids == kept.token_ids == [1, 1, 1]
    assert skipped.text == "" and kept.text == "<s><s><s>"
    eos = llm.generate(
        [[9, 10, 11]],
        SamplingParams(
            temperature=0, max_tokens=3, logit_bias={2: 100.0}, skip_special_tokens=False
        ),
    )[0]
    assert eos.token_ids == [2] and eos.finish_reason == "stop" and eos.text == ""
