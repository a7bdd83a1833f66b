"""The records that cross to a worker process: each survives a JSON round trip as the
same record, and a malformed object is refused with a message naming the field."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_api.errors import BackendError, BadRequestError, EngineDeadError, PromptTooLongError
from engine_api.records import GenChunk, GenRequest, KVEvent, TokenLogprob, Usage
from engine_api.sampling import SamplingParams


def over_json(record):
    return type(record).from_dict(json.loads(json.dumps(record.to_dict(), allow_nan=False)))


finite = st.floats(allow_nan=False, allow_infinity=False)
texts = st.text(max_size=8)
usages = st.builds(Usage, *[st.integers(0, 2**40)] * 3)
logprobs = st.builds(TokenLogprob, texts, finite, st.lists(st.tuples(texts, finite), max_size=3))
chunks = st.builds(
    GenChunk,
    st.lists(st.integers(0, 2**31), max_size=4),
    texts,
    st.sampled_from([None, "stop", "length", "abort"]),
    st.none() | usages,
    st.none() | st.lists(logprobs, max_size=3),
)
events = st.builds(
    KVEvent,
    st.sampled_from(["stored", "removed"]),
    texts,
    st.text("0123456789abcdef", min_size=64, max_size=64),
    st.none() | texts,
    st.none() | texts,
    st.integers(0, 64),
    finite,
)


@given(st.one_of(chunks, events, usages, logprobs))
def test_outputs_cross_json_unchanged(record):
    assert over_json(record) == record


def test_a_request_crosses_json_unchanged_with_its_sampling():
    request = GenRequest(
        "cmpl-1",
        "m",
        [1, 2, 3],
        SamplingParams(temperature=0, stop=["\n"], logprobs=2, seed=7),
        tenant_id="t1",
        cache_salt="salt",
        priority=-3,
        shared_prefix_len=2,
    )
    back = over_json(request)
    assert back == request and isinstance(back.sampling, SamplingParams)


def test_a_malformed_request_is_a_bad_request_naming_the_field():
    good = GenRequest("r", "m", [1], SamplingParams()).to_dict()
    cases = [
        (good | {"extra": 1}, "unknown GenRequest field.*'extra'"),
        ({k: v for k, v in good.items() if k != "model"}, "missing field.*model"),
        (good | {"prompt_token_ids": [1, "2"]}, r"prompt_token_ids\[1\] must be an integer"),
        (good | {"priority": True}, "priority must be an integer"),
        (good | {"sampling": good["sampling"] | {"top_p": 0}}, "top_p must be in"),
        (good | {"sampling": good["sampling"] | {"n": 2}}, "unknown SamplingParams field.*'n'"),
    ]
    for data, message in cases:
        with pytest.raises(BadRequestError, match=message):
            GenRequest.from_dict(data)


def test_a_malformed_output_is_refused_naming_the_field():
    good = GenChunk([5], "hi", "stop", Usage(1, 1, 0), [TokenLogprob("hi", -0.1)]).to_dict()
    cases = [
        (good | {"usage": {"prompt_tokens": 1, "total": 2}}, "unknown Usage field.*'total'"),
        (good | {"logprobs": [{"token": "hi", "logprob": "x"}]}, r"logprob must be a finite"),
        (good | {"logprobs": [{"token": "hi", "logprob": 0, "top": [["a"]]}]}, r"top\[0\]"),
        (good | {"text": None}, "text must be a string"),
        ("not an object", "GenChunk must be a JSON object"),
    ]
    for data, message in cases:
        with pytest.raises(ValueError, match=message):
            GenChunk.from_dict(data)


def test_one_hierarchy_maps_to_http_statuses():
    assert issubclass(EngineDeadError, BackendError)  # 503, as the engines' RuntimeError was
    assert issubclass(EngineDeadError, RuntimeError)
    assert not issubclass(BackendError, ValueError)


def test_prompt_too_long_reads_as_openai_writes_it():
    error = PromptTooLongError(600, 16, 512)
    assert str(error) == (
        "This model's maximum context length is 512 tokens, but the prompt has 600 tokens "
        "and 16 were requested for the completion."
    )
    assert isinstance(error, BadRequestError) and isinstance(error, ValueError)
