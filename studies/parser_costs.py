"""What a chat's output layer costs a reply, without the HTTP around it (issue 48): the
per-chunk work of a plain streamed chat before its body, and a reply's path with the
parsers on against off, whole and streamed.

    python -m studies.parser_costs

The reply is studies.gateway_parsers' (81 tokens of the fake backend's cutting:
reasoning, a sentence, a `<tool_call>`). Per chunk: the chat route's loop up to the
chunk's body (ChoiceOutput.feed, the checks on its Piece), less the bare loop, for a
plain chat (no parser, no tools) through its own path and through the general one.
Per reply: the route's loop as it runs it (feed or take, finish, the chunk bodies or
the whole body, encoded), "on" with qwen3 and hermes asked tool_choice auto, "off" with
none asked none, as the gateway-overhead study serves them. CPU time (process_time), the
best of 9 sets; the figures say where the study's difference comes from, the study says
what a request costs.

The streamed reply's "on" over "off" taken apart: the parsers alone (fed the reply a
token at a time, as the stream feeds them), the output layer (ChoiceOutput's feed and
finish, the parsers within, nothing encoded), and the encoding of the events each side
sends (their bodies, made and encoded; "on" sends fewer: the text the parser holds goes
out with what completes it), with each side's events and bytes.
"""

from __future__ import annotations

import functools
import time
import timeit
from collections.abc import Callable
from typing import Any

from engine_api.records import Usage
from gateway.backends import GenChunk
from gateway.backends.fake import _mock_tokens
from gateway.http.util import json_bytes, sse
from gateway.parsers import output_parser
from gateway.routes.openai import _choice
from gateway.schemas.inference import ChatCompletionRequest
from gateway.schemas.openai_format import chunk_body, response_body, usage_chunk
from gateway.serving.outcome import LARGE_CALL_CHARS
from gateway.serving.parsed_output import ChoiceOutput, Whole, reasoning_tokens
from gateway.serving.parser_choice import Parsers
from gateway.serving.tool_calls import ToolPlan
from studies.gateway_parsers import MOCK, body

TOKENS = _mock_tokens(MOCK)
CHUNKS = [GenChunk([t], p) for p, t in TOKENS[:-1]]
LAST = GenChunk([TOKENS[-1][1]], TOKENS[-1][0], "stop", Usage(20, len(TOKENS)))
SIDES = {
    "off": (ToolPlan.of(ChatCompletionRequest.model_validate(body(False, True))), Parsers()),
    "on": (
        ToolPlan.of(ChatCompletionRequest.model_validate(body(True, True))),
        Parsers("qwen3", "hermes", "configured"),
    ),
}


def best(f: Callable[[], Any], n: int) -> float:
    """Seconds of CPU a call, the best of 9 sets of n."""
    return min(timeit.Timer(f, timer=time.process_time).repeat(9, n)) / n


def bare_loop() -> None:
    first = [True]
    for chunk in CHUNKS:
        i = 0
        finish, piece, large = chunk.finish_reason, None, False  # noqa: F841
        first[i] = False


def plain_chunks(general: bool) -> None:
    """The stream's per-chunk work before each body, for a plain chat's output as a stream
    has it (refilling its Piece); `general`: through ChoiceOutput's general feed (its
    plain binding removed)."""
    first = [True]
    outputs = [ChoiceOutput(*SIDES["off"], refill=True)]
    if general:
        del outputs[0].feed
    for chunk in CHUNKS:
        i = 0
        finish, piece, large = chunk.finish_reason, None, False
        out = outputs[i]
        piece = out.feed(chunk)
        large = out.chars > LARGE_CALL_CHARS  # noqa: F841
        if not finish and not (
            piece.content or piece.reasoning or piece.calls or first[i] or chunk.logprobs
        ):
            continue
        first[i] = False


def streamed(side: str, encode: bool = True) -> list:
    """The chat route's streamed loop, its bodies encoded; without `encode`, each chunk's
    arguments to chunk_body instead."""
    outputs = [ChoiceOutput(*SIDES[side], refill=True)]
    first, sent = [True], []
    for chunk in [*CHUNKS, LAST]:
        i, finish = 0, chunk.finish_reason
        out = outputs[i]
        piece = out.feed(chunk)
        if finish:
            rest, finish = out.finish(finish)
            piece.extend(rest)
        elif not (piece.content or piece.reasoning or piece.calls or first[i] or chunk.logprobs):
            continue
        args = (piece.content, finish, chunk.logprobs, first[i], piece.calls, piece.reasoning)
        sent.append(
            sse(chunk_body(True, "chatcmpl-1", 1, "fake-model", i, *args)) if encode else args
        )
        first[i] = False
    usage, thought = LAST.usage, reasoning_tokens(outputs, len(TOKENS))
    sent.append(sse(usage_chunk(True, "chatcmpl-1", 1, "fake-model", usage, thought)))
    return sent


def parse(side: str) -> None:
    """The side's parsers alone, fed the reply a token at a time, then finished."""
    if side == "on":
        parser = output_parser("qwen3", "hermes", tool_names=frozenset(SIDES["on"][0].schemas))
        for chunk in [*CHUNKS, LAST]:
            parser.feed(chunk.text)
        parser.finish()


def output(side: str) -> None:
    """The stream's output layer: ChoiceOutput's feed and finish, nothing encoded."""
    out = ChoiceOutput(*SIDES[side], refill=True)
    for chunk in CHUNKS:
        out.feed(chunk)
    out.feed(LAST)
    out.finish("stop")


def encode(events: list) -> None:
    """The events' bodies made and encoded (their usage row's too)."""
    for args in events[:-1]:
        sse(chunk_body(True, "chatcmpl-1", 1, "fake-model", 0, *args))
    sse(usage_chunk(True, "chatcmpl-1", 1, "fake-model", LAST.usage, 0))  # type: ignore[arg-type]


def on_and_off(f: Callable[[str], Any], n: int) -> tuple[float, float]:
    """`f`'s CPU seconds for "off" and "on", alternated (off, on, on, off)."""
    got: dict[str, list[float]] = {"off": [], "on": []}
    for side in ("off", "on", "on", "off"):
        got[side].append(best(functools.partial(f, side), n))
    return min(got["off"]), min(got["on"])


def whole(side: str) -> bytes:
    """The chat route's whole answer: its chunks taken, read at the end, the body encoded."""
    out, answer = ChoiceOutput(*SIDES[side], whole=True), Whole()
    for chunk in [*CHUNKS, LAST]:
        out.take(chunk)
    rest, finish = out.finish("stop")
    answer.add(rest)
    choices = [_choice(None, 0, [[]], answer, finish, None)]  # type: ignore[arg-type]
    thought = reasoning_tokens([out], len(TOKENS))
    assert LAST.usage is not None
    return json_bytes(response_body(True, "x", 1, "fake-model", choices, LAST.usage, thought))


def main() -> None:
    n = len(CHUNKS)
    bare = best(bare_loop, 3000)
    for name, general in (("its own path", False), ("the general path", True)):
        t = best(functools.partial(plain_chunks, general), 3000)
        print(f"plain chat, a chunk before its body, {name}: {(t - bare) / n * 1e9:.0f} ns")
    for name, f in (("whole", whole), ("streamed", streamed)):
        off, on = on_and_off(f, 300)
        gap = (on - off) * 1e6
        print(f"{name}: off {off * 1e6:.1f} us, on {on * 1e6:.1f} us, on - off {gap:.1f} us")
    print("streamed, on - off taken apart:")
    _, parsers = on_and_off(parse, 300)
    off, on = on_and_off(output, 300)
    print(f"  the parsers alone: {parsers * 1e6:.1f} us")
    print(f"  the output layer beyond them: {(on - off - parsers) * 1e6:.1f} us")
    events = {side: streamed(side, encode=False) for side in ("off", "on")}
    off, on = on_and_off(lambda side: encode(events[side]), 300)
    sizes = {side: sum(map(len, streamed(side))) for side in ("off", "on")}
    print(
        f"  the events encoded: {(on - off) * 1e6:.1f} us (off {off * 1e6:.1f} us, "
        f"{len(events['off'])} events, {sizes['off']} bytes; on {on * 1e6:.1f} us, "
        f"{len(events['on'])} events, {sizes['on']} bytes)"
    )


if __name__ == "__main__":
    main()
