"""StructuredOutput: exactly one constraint, bounded, validated once for every engine,
and carried inside SamplingParams across the wire unchanged."""

from __future__ import annotations

import json

import pytest

from engine_api.errors import BadRequestError
from engine_api.records import GenRequest
from engine_api.sampling import SamplingParams
from engine_api.structured import MAX_SCHEMA_CHARS, StructuredOutput


@pytest.mark.parametrize(
    ("structured", "error"),
    [
        (StructuredOutput(), "exactly one"),
        (StructuredOutput(regex="a", choice=["a"]), "exactly one"),
        (StructuredOutput(choice=[]), "choice must hold"),
        (StructuredOutput(choice=[""]), "each choice"),
        (StructuredOutput(regex=""), "regex is empty"),
        (StructuredOutput(grammar="x" * (MAX_SCHEMA_CHARS + 1)), "at most"),
        (StructuredOutput(json="[1, 2]"), "object or a boolean"),
        (StructuredOutput(json="{"), "not valid JSON"),
        (StructuredOutput(json="[" * 40 + "]" * 40), "object or a boolean"),
        (StructuredOutput(json='{"a":' * 40 + "1" + "}" * 40), "deeper than 32"),
        (StructuredOutput(choice=[1]), "choice"),
    ],
)
def test_validate_names_what_is_wrong(structured, error):
    with pytest.raises(BadRequestError, match=error):
        structured.validate()
    with pytest.raises(BadRequestError, match=error):
        SamplingParams(structured=structured).validate()


def test_a_schema_is_canonical_json_text_and_crosses_the_wire():
    a = StructuredOutput.from_schema({"b": 1, "a": {"type": "object"}})
    b = StructuredOutput.from_schema('{"b": 1,  "a": {"type": "object"}}')
    assert a == b and (a.kind, a.source) == ("json", '{"b":1,"a":{"type":"object"}}')
    params = SamplingParams(temperature=0, structured=a)
    req = GenRequest("r", "m", [1, 2], params)
    back = GenRequest.from_dict(json.loads(json.dumps(req.to_dict())))
    assert back.sampling.structured == a
    with pytest.raises(BadRequestError, match="unknown StructuredOutput"):
        SamplingParams.from_dict(params.to_dict() | {"structured": {"schema": "{}"}})


def test_choices_become_an_exact_gbnf_grammar():
    so = StructuredOutput(choice=['say "hi"', "a\\b", "tab\there"])
    assert so.gbnf() == 'root ::= "say \\"hi\\"" | "a\\\\b" | "tab\\x09here"'
    assert StructuredOutput(json_object=True).schema() == {"type": "object"}
