"""The grammar of a constraint with reasoning before it (issue 48.4, engine_api.grammar):
llguidance's matcher, over a real (tiny, byte-level) tokenizer, takes the token ids of
whole replies. Qwen3's form ("think"): an optional `<think>...</think>` block, then the
constraint; DeepSeek-R1's ("open_think", its prompt opened `<think>`): reasoning up to
`</think>` first. Whatever follows `</think>` is held to the constraint, of every kind."""

from __future__ import annotations

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from engine_api.errors import BadRequestError
from engine_api.grammar import GrammarCache
from engine_api.structured import StructuredOutput
from tests.backend_gpu.byte_tokens import save_byte_token_model

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
JSON = '{"city": "Oslo"}'
BLOCK = "<think>\nThe user asks for Oslo.\n</think>\n\n"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> GrammarCache:
    tok = AutoTokenizer.from_pretrained(
        save_byte_token_model("qwen3", str(tmp_path_factory.mktemp("g")))
    )
    return GrammarCache(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=len(tok)))


def accepts(cache: GrammarCache, structured: StructuredOutput, text: str) -> bool:
    """Whether the whole of `text`, as token ids, is a reply the grammar ends on."""
    matcher = cache.matcher(structured)
    ids = cache._llg_tokenizer().tokenize_str(text)
    if matcher.validate_tokens(ids) != len(ids):
        return False
    matcher.consume_tokens(ids)
    return matcher.is_accepting()


def schema(reasoning: str | None) -> StructuredOutput:
    out = StructuredOutput.from_schema(SCHEMA)
    out.reasoning = reasoning
    return out


@pytest.mark.parametrize(
    ("reasoning", "text", "ok"),
    [
        (None, JSON, True),
        (None, BLOCK + JSON, False),  # no reasoning form: the JSON from the first token
        ("think", JSON, True),  # Qwen3 may not think
        ("think", BLOCK + JSON, True),
        ("think", "<think></think>" + JSON, True),
        ("think", "The user asks.</think>" + JSON, False),  # its block opens with <think>
        ("think", "<think>x</think> Oslo", False),  # after the block, the constraint holds
        ("think", "<think>a</think>b</think>" + JSON, False),  # the first </think> ends it
        ("think", BLOCK + '{"town": "Oslo"}', False),
        ("open_think", "The user asks for Oslo.\n</think>\n\n" + JSON, True),
        ("open_think", JSON, False),  # the reasoning's </think> comes first
        ("open_think", "a</think>{}", False),
    ],
)
def test_the_reasoning_comes_first_and_the_constraint_after(cache, reasoning, text, ok):
    assert accepts(cache, schema(reasoning), text) is ok


def test_every_kind_of_constraint_follows_the_reasoning(cache):
    regex = StructuredOutput(regex="[0-9]{3}", reasoning="think")
    assert accepts(cache, regex, BLOCK + "123") and accepts(cache, regex, "123")
    assert not accepts(cache, regex, BLOCK + "12a")
    choice = StructuredOutput(choice=["yes", "no"], reasoning="open_think")
    assert accepts(cache, choice, "Sure.</think>no") and not accepts(cache, choice, "no")
    gbnf = StructuredOutput(grammar='root ::= "a" "b"+', reasoning="think")
    assert accepts(cache, gbnf, BLOCK + "abb") and not accepts(cache, gbnf, BLOCK + "ba")
    anything = StructuredOutput(json_object=True, reasoning="think")
    assert accepts(cache, anything, BLOCK + '{"a": 1}')


def test_the_cache_keeps_a_grammar_per_reasoning_form(cache):
    assert cache.compile(schema(None)) is not cache.compile(schema("think"))
    assert cache.compile(schema("think")) is cache.compile(schema("think"))


def test_an_unknown_reasoning_form_is_refused_by_name():
    with pytest.raises(BadRequestError, match="reasoning must be one of think, open_think"):
        StructuredOutput(json_object=True, reasoning="harmony").validate()
