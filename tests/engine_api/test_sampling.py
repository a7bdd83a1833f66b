"""SamplingParams: one validate() for every engine and the wire. Each bad field is
refused with a message naming it; whatever validate() accepts crosses JSON unchanged;
whatever the gateway's HTTP schema accepts, validate() accepts too."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st
from pydantic import ValidationError

from engine_api.errors import BadRequestError
from engine_api.sampling import MAX_LOGIT_BIAS_TOKENS, MAX_LOGPROBS, SamplingParams
from gateway.schemas.inference import CompletionRequest
from gateway.serving.sampling import sampling, structured_output

BAD = [
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", "0.7"),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("top_k", 2**31),
    ("top_k", 1.5),
    ("min_p", -0.1),
    ("min_p", 1.01),
    ("seed", 2**64),
    ("seed", 1.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3),
    ("repetition_penalty", 0),
    ("repetition_penalty", float("inf")),
    ("max_tokens", 0),
    ("max_tokens", None),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("min_tokens", 17),  # more than max_tokens (16)
    ("stop", [None]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["7"]),
    ("ignore_eos", 1),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", False),
    ("logit_bias", [(5, 100.5)]),
    ("logit_bias", [(5, -100.5)]),
    ("logit_bias", [(5, float("nan"))]),
    ("logit_bias", [(5, True)]),
    ("logit_bias", [(5, 1.0), (5, -1.0)]),  # one token biased twice
    ("logit_bias", [(-1, 1.0)]),
    ("logit_bias", [(2**31, 1.0)]),
    ("logit_bias", [(i, 1.0) for i in range(MAX_LOGIT_BIAS_TOKENS + 1)]),
    ("logit_bias", [("7", 1.0)]),  # a JSON object's key: the gateway turns it to an int
    ("logit_bias", [(7.0, 1.0)]),
    ("logit_bias", [(7, 1.0, 2.0)]),
    ("logit_bias", [7]),  # not a pair
    ("logit_bias", "7"),
]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_validate_refuses_each_bad_field_by_name(name, value):
    params = SamplingParams(**{name: value})
    with pytest.raises(BadRequestError, match=rf"^{name}\b") as info:
        params.validate()
    assert isinstance(info.value, ValueError)  # engines' callers catch ValueError
    wire = SamplingParams().to_dict() | {name: value}
    with pytest.raises(BadRequestError, match=rf"^{name}\b"):
        SamplingParams.from_dict(wire)


def test_the_limits_are_inclusive():
    edges = {
        "temperature": 0,
        "top_p": 1,
        "top_k": 2**31 - 1,
        "min_p": 1,
        "presence_penalty": -2,
        "frequency_penalty": 2,
        "max_tokens": 2**31 - 1,
        "min_tokens": 2**31 - 1,
        "logprobs": MAX_LOGPROBS,
        "seed": 2**64 - 1,
        "stop_token_ids": [0, 2**31 - 1],
        "logit_bias": [[0, -100], [2**31 - 1, 100]],
    }
    assert SamplingParams.from_dict(edges) == SamplingParams(**edges)
    most = [[i, 100.0] for i in range(MAX_LOGIT_BIAS_TOKENS)]
    assert len(SamplingParams.from_dict({"logit_bias": most}).logit_bias) == len(most)
    SamplingParams(top_k=0, min_p=0, seed=-(2**63), logprobs=0).validate()


def test_from_dict_refuses_unknown_and_non_object_input():
    with pytest.raises(BadRequestError, match="unknown SamplingParams field.*'best_of'"):
        SamplingParams.from_dict({"temperature": 0.5, "best_of": 2})
    with pytest.raises(BadRequestError, match="must be a JSON object"):
        SamplingParams.from_dict([("temperature", 0.5)])
    # left out: the default, as in SamplingParams(); on the wire, stop is always a list
    assert SamplingParams.from_dict({"stop": ["\n"]}) == SamplingParams(stop="\n")
    with pytest.raises(BadRequestError, match="stop must be a list"):
        SamplingParams.from_dict({"stop": "\n"})


def test_logit_bias_is_pairs_from_a_dict_too_and_crosses_json_unchanged():
    params = SamplingParams(logit_bias={5: 1.5, 2**31 - 1: -100, 0: 100})
    assert params.logit_bias == [(5, 1.5), (2**31 - 1, -100), (0, 100)]
    assert SamplingParams(logit_bias=[[5, 1.5], (0, 100)]).logit_bias == [(5, 1.5), (0, 100)]
    params.validate()
    wire = json.loads(json.dumps(params.to_dict(), allow_nan=False))
    assert wire["logit_bias"] == [[5, 1.5], [2**31 - 1, -100], [0, 100]]
    assert SamplingParams.from_dict(wire) == params
    with pytest.raises(BadRequestError, match="logit_bias must be a list"):
        SamplingParams.from_dict({"logit_bias": {"5": 1.5}})  # pairs on the wire, not a map


def test_check_vocab_refuses_a_biased_token_past_the_vocabulary():
    SamplingParams(logit_bias={0: 1, 383: -1}).check_vocab(384)
    SamplingParams().check_vocab(1)
    with pytest.raises(BadRequestError, match=r"^logit_bias .*\[0, 384\).*\[384\]") as info:
        SamplingParams(logit_bias={5: 1, 384: -1}).check_vocab(384)
    assert isinstance(info.value, ValueError)


def test_engine_properties():
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.5, top_k=0).greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties


# the largest values gateway/schemas/inference.py accepts, written out here, not imported
SCHEMA_EDGES = {
    "model": "m",
    "prompt": "hi",
    "temperature": 2,
    "top_k": 2**31 - 1,
    "presence_penalty": -2,
    "frequency_penalty": 2,
    "repetition_penalty": 10,
    "max_tokens": 2**31 - 1,
    "min_tokens": 2**31 - 1,
    "seed": 2**53 - 1,
    "stop_token_ids": [2**31 - 1],
    "logprobs": 20,
    "logit_bias": {str(i): (-100, 100)[i % 2] for i in range(2**31 - 1024, 2**31)},
}


def numbers(lo: float, hi: float):
    return st.floats(lo, hi, allow_nan=False) | st.integers(int(lo), int(hi))


any_params = st.builds(
    SamplingParams,
    temperature=numbers(-1, 5),
    top_p=numbers(-0.5, 1.5),
    top_k=st.integers(-3, 2**32),
    min_p=numbers(-0.5, 1.5),
    seed=st.none() | st.integers(-(2**65), 2**65),
    presence_penalty=numbers(-3, 3),
    frequency_penalty=numbers(-3, 3),
    repetition_penalty=numbers(-1, 100),
    max_tokens=st.integers(-1, 2**32),
    min_tokens=st.integers(-1, 64),
    stop=st.lists(st.text(max_size=4), max_size=4),
    stop_token_ids=st.lists(st.integers(-2, 2**32), max_size=4),
    ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(-2, 30),
    logit_bias=st.lists(st.tuples(st.integers(-2, 2**32), numbers(-150, 150)), max_size=4)
    | st.dictionaries(st.integers(-2, 2**32), numbers(-150, 150), max_size=4),
)


@given(any_params)
def test_what_validate_accepts_crosses_json_unchanged_and_the_rest_is_refused(params):
    wire = json.loads(json.dumps(params.to_dict(), allow_nan=False))
    try:
        params.validate()
    except BadRequestError:
        with pytest.raises(BadRequestError):
            SamplingParams.from_dict(wire)
        return
    assert SamplingParams.from_dict(wire) == params


@given(
    st.fixed_dictionaries(
        {"model": st.just("m"), "prompt": st.just("hi")},
        optional={
            "temperature": numbers(-1, 5),
            "top_p": numbers(-0.5, 1.5),
            "top_k": st.integers(-3, 2**32),
            "min_p": numbers(-0.5, 1.5),
            "seed": st.integers(-(2**60), 2**60),
            "presence_penalty": numbers(-3, 3),
            "frequency_penalty": numbers(-3, 3),
            "repetition_penalty": numbers(-1, 100),
            "max_tokens": st.integers(-1, 2**32),
            "min_tokens": st.integers(-1, 2**32),
            "stop": st.lists(st.text(max_size=4), max_size=6),
            "stop_token_ids": st.lists(st.integers(-2, 2**32), max_size=4),
            "ignore_eos": st.booleans(),
            "logprobs": st.integers(-2, 30),
            "logit_bias": st.dictionaries(
                st.integers(-2, 2**32).map(str) | st.text("0123456789+- x", max_size=4),
                numbers(-150, 150),
                max_size=4,
            ),
        },
    ),
    st.integers(0, 127),
)
@example(SCHEMA_EDGES | {"presence_penalty": 2, "frequency_penalty": -2, "top_k": 1}, 0)
@example(SCHEMA_EDGES | {"top_p": 1e-9, "min_p": 1, "seed": -(2**53) + 1, "logprobs": 0}, 127)
@example(SCHEMA_EDGES | {"logit_bias": {"5": 1, "05": -1}}, 0)  # one token, two spellings
def test_what_the_http_schema_accepts_every_engine_accepts(body, choice):
    try:
        request = CompletionRequest.model_validate(body)
    except ValidationError:
        assume(False)
    max_tokens = request.max_tokens or 16  # the gateway fills it in from the context
    # the schema does not compare min_tokens with max_tokens: the engine refuses that (400)
    assume(request.min_tokens <= max_tokens)
    sampling(request, max_tokens, choice, structured_output(request)).validate()
