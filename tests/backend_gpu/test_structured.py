"""Structured outputs in the engine, on a tiny random model whose free output is noise:
whatever it samples under a grammar parses and validates; constrained and free requests
share batches; a schema the library cannot compile is refused before admission."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from backend_gpu import LLM, SamplingParams
from engine_api.structured import StructuredOutput
from tests.backend_gpu.byte_tokens import save_byte_token_model

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {"zip": {"type": "integer", "minimum": 1000, "maximum": 9999}},
                "required": ["zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "ok"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": -5, "maximum": 5},
            "level": {"enum": [1, 2, 3]},
        },
        "required": ["n", "level"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_byte_token_model("llama", str(tmp_path_factory.mktemp("tiny")))
    return LLM(path, max_num_batched_tokens=64, seed=3)


def sampled(structured: StructuredOutput, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=120, structured=structured, **kw)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_output_always_validates(llm, name):
    schema = SCHEMAS[name]
    params = [sampled(StructuredOutput.from_schema(schema), seed=s) for s in range(6)]
    for out in llm.generate([[5, 6, 7]] * 6, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_and_choice_and_regex(llm):
    prompts = [[9, 10, 11]] * 3
    # any object: the noise may write one string until max_tokens, so only the outputs
    # that ended are complete (most end, seeded)
    any_object = StructuredOutput(json_object=True)
    objects = llm.generate([[20, 21]] * 3, [sampled(any_object, seed=s) for s in range(3)])
    ended = [o for o in objects if o.finish_reason == "stop"]
    assert ended and all(o.finish_reason == "length" for o in objects if o not in ended)
    assert all(isinstance(json.loads(o.text), dict) for o in ended)
    choices = ["yes", "no", "maybe not"]
    picked = llm.generate(prompts, sampled(StructuredOutput(choice=choices)))
    assert all(o.text in choices for o in picked)
    dates = llm.generate(prompts, sampled(StructuredOutput(regex=r"\d{4}-\d{2}-\d{2}")))
    assert all(re.fullmatch(r"\d{4}-\d{2}-\d{2}", o.text) for o in dates)
    answers = llm.generate(prompts, sampled(StructuredOutput(grammar='root ::= "a" [0-9] "b"')))
    assert all(re.fullmatch(r"a[0-9]b", o.text) for o in answers)


def test_constrained_and_free_requests_share_a_batch(llm):
    schema = SCHEMAS["bounded_numbers"]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], free)[0].token_ids
    params = [free, sampled(StructuredOutput.from_schema(schema), seed=1)] * 2
    outs = llm.generate([[5, 6, 7]] * 4, params)
    assert outs[0].token_ids == outs[2].token_ids == alone  # the mask stays in its rows
    for out in outs[1::2]:
        jsonschema.validate(json.loads(out.text), schema)
    assert llm.stats().num_steps > 0


def test_a_schema_that_does_not_compile_changes_nothing(llm):
    before = llm.stats().num_free_blocks
    bad = StructuredOutput.from_schema({"type": "string", "format": "no-such-format"})
    with pytest.raises(ValueError, match="no-such-format"):
        llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(), sampled(bad)])
    assert not llm.engine.seqs and llm.stats().num_free_blocks == before
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate([[5, 6]], sampled(StructuredOutput(json_object=True), min_tokens=2))


def test_compiled_grammars_are_cached_per_constraint(llm):
    structured = StructuredOutput.from_schema(SCHEMAS["nested"])
    first = llm.engine.grammars.compile(structured)
    again = StructuredOutput.from_schema(json.loads(json.dumps(SCHEMAS["nested"])))
    assert llm.engine.grammars.compile(again) is first
    assert llm.engine.grammars.matcher(structured) is not first


def test_prefix_caching_keeps_working_for_constrained_requests(llm):
    params = sampled(StructuredOutput.from_schema(SCHEMAS["bounded_numbers"]), seed=4)
    prompt = list(range(5, 60))  # more than two full blocks
    first, again = (llm.generate([prompt], params)[0] for _ in range(2))
    assert again.num_cached_tokens >= 32 and again.text == first.text


def test_speculation_is_off_for_constrained_requests_and_on_for_others(tmp_path_factory):
    path = save_byte_token_model("llama", str(tmp_path_factory.mktemp("spec")))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(path, max_num_batched_tokens=64, seed=3, speculative_config=spec)
    schema = SCHEMAS["array_enum"]
    repetitive = [5, 6, 7, 8] * 8  # n-gram lookup finds proposals in it
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([repetitive] * 2, [free, sampled(StructuredOutput.from_schema(schema))])
    jsonschema.validate(json.loads(outs[1].text), schema)
    assert llm.stats().num_drafts > 0  # the free request speculated beside it
