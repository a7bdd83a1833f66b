"""The gateway adapter over the real default model."""

import contextlib

import pytest

from gateway.backends import (
    BackendError,
    BackendSpec,
    BadRequestError,
    GenRequest,
    PromptTooLongError,
    SamplingParams,
    build_backend,
)
from gateway.backends.default_model import DEFAULT_MODEL_ID
from gateway.backends.local import LocalBackend
from gateway.routing.fair_queue import SPARE_SEATS
from tests.backend_local.helpers import wait_for

pytestmark = pytest.mark.slow

OPTIONS = {"n_ctx": 1024, "n_parallel": 2, "n_batch": 128, "n_threads": 1}


@pytest.fixture(scope="module")
def backend(model_path):
    backend = build_backend(BackendSpec(name="local", type="local", options=OPTIONS))
    yield backend
    with contextlib.suppress(BackendError):
        backend.engine.shutdown()


async def started(backend: LocalBackend) -> LocalBackend:
    await backend.start()  # idempotent: the module shares one engine
    return backend


async def test_chat_request_gets_a_real_reply(backend):
    b = await started(backend)
    assert [(m.id, m.context_length) for m in b.models()] == [(DEFAULT_MODEL_ID, 512)]
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
    ]
    ids = await b.render(DEFAULT_MODEL_ID, messages)
    bos = b.engine.model.bos_id
    assert ids[0] == bos and ids.count(bos) == 1  # the template's BOS, not a second one
    turn = b.engine.tokenize("<start_of_turn>model\n", add_special=False)
    assert len(turn) == 3 and ids[-3:] == turn  # the turn marker is one special token
    request = GenRequest(
        "chat-1", DEFAULT_MODEL_ID, ids, SamplingParams(temperature=0, max_tokens=32), "t1", "s1"
    )
    chunks = [c async for c in b.generate(request)]
    text = "".join(c.text for c in chunks)
    assert text.strip()
    assert "<end_of_turn>" not in text
    last = chunks[-1]
    assert last.finish_reason in ("stop", "length")
    assert last.usage.prompt_tokens == len(ids)
    assert last.usage.completion_tokens == sum(len(c.token_ids) for c in chunks)


async def test_usage_reports_cached_prompt_tokens(backend):
    b = await started(backend)
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    ids = await b.render(DEFAULT_MODEL_ID, messages)
    options = SamplingParams(temperature=0, max_tokens=2)
    for attempt, salt in enumerate(["s-cache", "s-cache", "s-other"]):
        request = GenRequest(f"cache-{attempt}", DEFAULT_MODEL_ID, ids, options, "t", salt)
        chunks = [c async for c in b.generate(request)]
        cached = chunks[-1].usage.cached_tokens
        assert cached == (len(ids) - 1 if attempt == 1 else 0)


async def test_bad_requests_map_to_gateway_errors(backend):
    b = await started(backend)
    ok = SamplingParams(max_tokens=4)
    with pytest.raises(PromptTooLongError, match="maximum context length is 512"):
        await anext(b.generate(GenRequest("long", DEFAULT_MODEL_ID, [2] * 510, ok)))
    with pytest.raises(BadRequestError, match="top_p"):
        await anext(b.generate(GenRequest("x", DEFAULT_MODEL_ID, [2, 3], SamplingParams(top_p=0))))
    with pytest.raises(BadRequestError, match="not served"):
        await b.render("gpt-4", "hello")
    with pytest.raises(BadRequestError, match="alternate"):
        await b.render(DEFAULT_MODEL_ID, [{"role": "assistant", "content": "hi"}])
    assert b.stats().healthy and b.stats().running == 0


async def test_logprobs_carry_token_text(backend):
    b = await started(backend)
    ids = await b.render(DEFAULT_MODEL_ID, "The sky is")
    options = SamplingParams(temperature=0, max_tokens=3, logprobs=2)
    chunks = [c async for c in b.generate(GenRequest("lp", DEFAULT_MODEL_ID, ids, options))]
    for chunk in chunks:
        (lp,) = chunk.logprobs
        assert lp.top[0][0] == lp.token and len(lp.top) == 2


async def test_closing_the_stream_aborts_and_stats_follow(backend):
    b = await started(backend)
    ids = await b.render(DEFAULT_MODEL_ID, "Count: one, two,")
    options = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    stream = b.generate(GenRequest("abort-me", DEFAULT_MODEL_ID, ids, options))
    await anext(stream)
    assert b.stats().running == 1
    await stream.aclose()
    await wait_for(lambda: b.stats().running == 0)
    stats = b.stats()
    # every sequence is free again: n_parallel, plus the fair queue's spare seat
    assert stats.extra["free_sequences"] == OPTIONS["n_parallel"] + SPARE_SEATS
    assert stats.prefix_queries > 0 and stats.extra["gen_tokens_total"] > 0


async def test_stopped_backend_refuses_with_backend_error(model_path):
    b = LocalBackend(
        BackendSpec(name="other", type="local", options={"n_ctx": 256, "n_parallel": 1})
    )
    with pytest.raises(BackendError, match="not running"):
        await b.render(DEFAULT_MODEL_ID, "hi")
    assert not b.stats().healthy


async def test_missing_model_file_is_a_backend_error_at_start(tmp_path):
    b = LocalBackend(BackendSpec(name="x", type="local", model=str(tmp_path / "missing.gguf")))
    assert b.models()[0].id == "missing"
    with pytest.raises(BackendError, match="not found"):
        await b.start()
