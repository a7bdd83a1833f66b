"""Structured outputs compiled with llguidance, for both engines: the constraint as the
library's grammar, and compiled grammars cached per constraint.

Both engines constrain with the same library, so a schema means the same, and fails to
compile with the same message, whichever serves it: the gpu engine masks its logits in
torch (backend_gpu.guided), the llama.cpp engine in numpy (backend_local.grammar). Each
engine makes its llguidance tokenizer from its own vocabulary (a Hugging Face tokenizer,
llama.cpp's vocab). Only the engines import this module; the rest of engine_api stays
free of native libraries.

Why llguidance: studies/grammar_mask.py on Gemma 3's 262k-token vocabulary computes a
mask in 44 us a step on average against xgrammar's 24 us (either is far below 1% of a
decode step), but compiles a new schema in 15 ms against xgrammar's 2.1 s, and that
compile is time to first token for every request with a schema not seen before
(docs/PERF.md).

A family that reasons before it answers (StructuredOutput.reasoning) gets a grammar of
two parts: its reasoning (any text up to the first `</think>`, opened by `<think>` where
the model opens it) and then the constraint, a grammar of its own referenced from the
first; so the reasoning is free and the answer after it still constrained.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable

import llguidance
import llguidance.gbnf_to_lark

from engine_api.errors import BadRequestError
from engine_api.structured import StructuredOutput

CACHED_GRAMMARS = 256
# JSON the way models write it (", " and ": "), and no free whitespace, which a model
# could emit without end
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# the reasoning before the constraint, as Lark (@{ref}: the constraint's grammar): any text
# without `</think>`, closed by it and the blank lines the models write after it
_REASONING = r"""
THOUGHT: /(?s:.*)/ & ~/(?s:.*)<\/think>(?s:.*)/
CLOSE: "</think>" /[ \n]*/
"""
REASONING_FIRST = {
    "think": 'start: THINK? @{ref}\nTHINK: "<think>" THOUGHT CLOSE' + _REASONING,
    "open_think": "start: REASONED @{ref}\nREASONED: THOUGHT CLOSE" + _REASONING,
}


def grammar_spec(structured: StructuredOutput) -> str:
    """The constraint as llguidance's grammar (GBNF grammars become Lark), after the
    reasoning its `reasoning` lets come first; BadRequestError for a grammar it cannot
    read."""
    spec = _constraint_spec(structured)
    if structured.reasoning is None:
        return spec
    return reasoning_first(spec, structured.reasoning)


def reasoning_first(spec: str, form: str) -> str:
    """`spec` (llguidance's JSON of grammars, or a Lark grammar) after the reasoning of
    `form` (a key of REASONING_FIRST)."""
    if spec.lstrip().startswith("{"):
        grammars = json.loads(spec)["grammars"]
    else:
        grammars = [{"name": "constraint", "lark_grammar": spec}]
    ref = grammars[0]["name"]
    top = {"name": "reasoning_first", "lark_grammar": REASONING_FIRST[form].format(ref=ref)}
    return json.dumps({"grammars": [top, *grammars]})


def _constraint_spec(structured: StructuredOutput) -> str:
    kind = structured.kind
    if kind in ("json", "json_object"):
        schema = structured.schema()
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(structured.regex or "")
    try:
        lark = llguidance.gbnf_to_lark.gbnf_to_lark(structured.gbnf())
    except Exception as exc:  # the converter raises bare Exceptions for bad grammars
        raise BadRequestError(f"the grammar is not valid GBNF: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarCache:
    """Compiled grammars of one engine's vocabulary. Thread-safe: the gateway's threads
    compile ahead of admission while the engine's thread takes copies."""

    def __init__(self, make_tokenizer: Callable[[], llguidance.LLTokenizer]) -> None:
        self._make_tokenizer = make_tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str, str | None], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        # made on first use: seconds for a large vocabulary, which engines serving no
        # structured output need not spend
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    def compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """The constraint's matcher in its initial state (cached), or BadRequestError
        naming what the library cannot compile."""
        key = (structured.kind, structured.source, structured.reasoning)
        with self._lock:
            if (cached := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return cached
        tokenizer = self._llg_tokenizer()
        spec = grammar_spec(structured)
        error = llguidance.LLMatcher.validate_grammar(spec, tokenizer)
        if not error:
            matcher = llguidance.LLMatcher(tokenizer, spec)
            error = matcher.get_error() if matcher.is_error() else ""
        if error:
            raise BadRequestError(f"the structured output cannot be compiled: {error}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A request's own matcher: a copy of the compiled one."""
        return self.compile(structured).deep_copy()
