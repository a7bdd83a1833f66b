"""OpenAI's logit_bias on the tiny Llama: a bias moves what is sampled, only in its own
row of the batch, never the logprobs reported (the model's own), and a request biasing a
token past the vocabulary is refused before it takes anything. With speculation on, a
biased request decodes one token a step and gives what it gives without speculation."""

from __future__ import annotations

import pytest

from backend_gpu import LLM, SamplingParams
from engine_api.errors import BadRequestError

PROMPT = [9, 10, 11]
STEPS = 8


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def plain(llm):
    """The unbiased greedy output, with the top 3 alternatives of each token."""
    return llm.generate([PROMPT], greedy(logprobs=3))[0]


def unused_token(llm: LLM, *outputs) -> int:
    """A token none of `outputs` holds (nor any special one), to be forced."""
    seen = {t for out in outputs for t in out.token_ids}
    return next(t for t in range(100, llm.engine.vocab_size) if t not in seen)


def test_plus_100_forces_a_token_greedy_or_sampled(llm, plain):
    forced = unused_token(llm, plain)
    for params in (
        greedy(logit_bias={forced: 100}),
        SamplingParams(temperature=1.0, seed=7, max_tokens=STEPS, logit_bias={forced: 100}),
        SamplingParams(
            temperature=0.8, top_k=20, top_p=0.9, max_tokens=STEPS, logit_bias=[(forced, 100.0)]
        ),
    ):
        assert llm.generate([PROMPT], params)[0].token_ids == [forced] * STEPS


def test_minus_100_bans_the_greedy_choice_for_the_runner_up(llm, plain):
    first, runner_up = plain.token_ids[0], plain.logprobs[0].top[1][0]
    out = llm.generate([PROMPT], greedy(logit_bias={first: -100}))[0]
    assert out.token_ids[0] == runner_up
    assert first not in out.token_ids


def test_a_bias_changes_only_its_own_row_of_the_batch(llm, plain):
    forced = unused_token(llm, plain)
    outs = llm.generate(
        [PROMPT, PROMPT, PROMPT],
        [greedy(), greedy(logit_bias={forced: 100}), greedy(logprobs=3)],
    )
    assert outs[0].token_ids == outs[2].token_ids == plain.token_ids
    assert outs[1].token_ids == [forced] * STEPS


def test_logprobs_stay_the_models_own(llm, plain):
    """A bias just big enough to make the runner-up win: the logprobs reported for the
    first token are those of the unbiased run (the runner-up ranked second, below the
    token the model prefers), not of the biased distribution."""
    (best, best_lp), (runner_up, runner_up_lp) = plain.logprobs[0].top[:2]
    bias = best_lp - runner_up_lp + 0.5
    out = llm.generate([PROMPT], greedy(logprobs=3, logit_bias={runner_up: bias}))[0]
    lp = out.logprobs[0]
    assert out.token_ids[0] == lp.token_id == runner_up
    assert lp.logprob == pytest.approx(runner_up_lp, abs=1e-5)
    assert [t for t, _ in lp.top] == [t for t, _ in plain.logprobs[0].top]
    assert [v for _, v in lp.top] == pytest.approx([v for _, v in plain.logprobs[0].top], abs=1e-5)
    # forced to the end: each token's logprob is the model's, far from the biased 0
    forced = unused_token(llm, plain)
    out = llm.generate([PROMPT], greedy(logprobs=1, logit_bias={forced: 100}))[0]
    assert all(lp.token_id == forced and lp.logprob < -1 for lp in out.logprobs)


def test_a_token_past_the_vocabulary_is_refused_and_changes_nothing(llm):
    vocab = llm.engine.vocab_size
    free = llm.stats().num_free_blocks
    edge = llm.generate([PROMPT], greedy(logit_bias={vocab - 1: 100}))[0]
    assert edge.token_ids == [vocab - 1] * STEPS  # the last id is in the vocabulary
    with pytest.raises(BadRequestError, match=rf"logit_bias .*\[0, {vocab}\).*\[{vocab}\]"):
        llm.generate([PROMPT, PROMPT], [greedy(), greedy(logit_bias={5: 1, vocab: 1})])
    assert not llm.engine.seqs and not llm.engine.has_unfinished_requests()
    stats = llm.stats()
    assert stats.num_free_blocks == free == stats.num_blocks
    assert stats.running == stats.waiting == 0


def test_speculation_leaves_a_biased_request_as_it_is_without(tiny_model_dir):
    """The draft is the target itself: its unbiased guesses would all stand if a biased
    request speculated. An unbiased request in the same batch still does."""
    path = tiny_model_dir("llama")
    spec_config = {"method": "draft", "num_speculative_tokens": 3, "model": path}
    spec = LLM(path, max_num_batched_tokens=64, speculative_config=spec_config)
    plain = LLM(path, max_num_batched_tokens=64)
    base = plain.generate([PROMPT], greedy())[0]
    forced = unused_token(plain, base)
    params = [
        greedy(),
        greedy(logit_bias={forced: 100}),
        greedy(logit_bias={base.token_ids[1]: -100, base.token_ids[3]: -100}),
        SamplingParams(temperature=1.0, seed=3, max_tokens=STEPS, logit_bias={forced: 5}),
    ]
    assert spec.generate([PROMPT], params[0])[0].token_ids == base.token_ids
    alone = spec.stats().num_draft_tokens  # what the unbiased request proposes
    assert alone > 0
    prompts = [PROMPT] * len(params)
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert want[1].token_ids == [forced] * STEPS
    assert want[2].token_ids != base.token_ids  # the bias mattered
    # only the unbiased request proposed, as much as alone
    assert spec.stats().num_draft_tokens == 2 * alone
