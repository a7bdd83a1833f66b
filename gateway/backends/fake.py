"""A deterministic backend for testing and measuring the gateway alone.

It tokenizes by words, "generates" words chosen by a hash of the prompt, the seed and
the position, at a configurable pace, and can be told to fail. It never stands in
for an engine feature; it exists so the gateway can be tested and measured without one.

Options: tokens_per_second (0: as fast as possible), ttft_ms, fail_rate (0..1 of
requests fail with BackendError), down (every request fails), context_length,
max_running (only for the KV-usage figure), max_in_flight (the gateway queues fairly in
front of it, as it does for llama.cpp's slots: to measure that queue alone).

task = "embed" makes its model an embedding model (embedding_size, default 32;
truncatable, default false: whether `dimensions` may shorten its vectors): each input's
vector is a deterministic unit vector drawn from its token ids, so the gateway's
admission, quotas, usage and prices for embeddings can be tested and measured alone.
The vectors mean nothing; real ones are the engine's, tested against it.

LoRA adapters: it accepts any adapter whose path exists (check_adapter), "loads" one when
a request names it (stats' adapters_loaded; `adapter_requests` counts requests per
adapter; a path gone since is the engines' AdapterLoadError) and words its output by the adapter's name too, so the gateway's registry,
visibility, routing and metering of adapters can be tested alone.

A request's `mock_response` (LiteLLM's field) is the text it "generates" instead: cut into
word and punctuation tokens and streamed as its words are (max_tokens, stop strings and
pace apply; the text's end is a "stop"), so that the output parsers, the clients and the
three APIs can be tested end to end on a model's real output formats.

vision = true lets its generating model take images, as a test double for the APIs'
image handling alone: each image is IMAGE_ID placeholder tokens (one per 32x32 tile of
it), counted as the usage's image_tokens. It never looks at the pixels: its output is
the same words for any picture of the same size, so no test can mistake it for a model
that sees. A model without it refuses images, as every text-only model does.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import random
import re
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator

from engine_api.block_hash import adapter_root
from engine_api.errors import AdapterLoadError, BackendError, BadRequestError
from engine_api.records import (
    EMBED,
    GENERATE,
    AdapterRef,
    BackendStats,
    EmbedRequest,
    EmbedResult,
    GenChunk,
    GenRequest,
    ModelCard,
    Progress,
    PromptInput,
    TokenLogprob,
    Usage,
)
from engine_api.structured import StructuredOutput
from gateway.backends.common import decode_off_loop, refuse_images, render_off_loop
from gateway.backends.spec import BackendSpec

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "while",
    "seven",
    "bright",
    "stars",
    "watch",
    "silent",
    "rivers",
    "flow",
    "past",
    "green",
    "hills",
    "under",
    "a",
    "pale",
    "moon",
    "and",
    "every",
    "small",
    "bird",
    "sings",
    "its",
    "own",
    "soft",
    "song",
    "to",
    "the",
    "cold",
    "wind",
    "that",
    "carries",
    "old",
    "stories",
    "across",
    "wide",
    "open",
    "plains",
]
EOS_ID = 0
WORD_ID_BASE = 1
PROMPT_ID_BASE = 1000
IMAGE_ID = 999  # an image's placeholder token (below the prompt words' ids)
IMAGE_TILE = 32  # pixels a side of the square an image's placeholder token stands for
BLOCK = 16
_WORD_RE = re.compile(r"\S+")
_MOCK_TOKEN_RE = re.compile(r"\s*(?:\w+|[^\w\s])|\s+")


class FakeBackend:
    takes_mock_response = True  # a request's mock_response is its output (nothing else's)

    def __init__(self, spec: BackendSpec) -> None:
        opts = spec.options
        self.name = spec.name
        self.model_id = spec.served_model_name or spec.model or "fake-model"
        self.tokens_per_second = float(opts.get("tokens_per_second", 0))
        self.ttft_s = float(opts.get("ttft_ms", 0)) / 1000
        self.fail_rate = float(opts.get("fail_rate", 0))
        self.down = bool(opts.get("down", False))
        self.context_length = int(opts.get("context_length", 4096))
        self.sampling_defaults = spec.generation_config  # the entry's, as a model's own
        self.max_running = int(opts.get("max_running", 256))
        in_flight = opts.get("max_in_flight")
        self.max_in_flight = None if in_flight is None else int(in_flight)
        self.rng = random.Random(int(opts.get("seed", 0)))
        self.task = str(opts.get("task", GENERATE))
        if self.task not in (GENERATE, EMBED):
            raise ValueError(f"fake backend {spec.name!r}: task must be generate or embed")
        self.embedding_size = int(opts.get("embedding_size", 32))
        self.truncatable = bool(opts.get("truncatable", False))
        self.vision = bool(opts.get("vision", False)) and self.task == GENERATE
        self.running = 0
        self.started = False
        self.aborted: list[str] = []
        self.cached_blocks: set[bytes] = set()
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._generated_per_s: deque[list[float]] = deque()  # [second, tokens]
        self.adapters_loaded: list[str] = []
        self.adapter_requests: dict[str, int] = {}  # adapter name -> requests run under it
        self.removed_adapters: list[str] = []

    async def start(self) -> None:
        self.started = True

    async def stop(self, drain: bool = True) -> None:
        self.started = False

    def models(self) -> list[ModelCard]:
        if self.task == EMBED:
            return [
                ModelCard(
                    self.model_id,
                    self.name,
                    self.context_length,
                    task=EMBED,
                    embedding_size=self.embedding_size,
                    truncatable=self.truncatable,
                )
            ]
        card = ModelCard(self.model_id, self.name, self.context_length, vision=self.vision)
        card.sampling_defaults = self.sampling_defaults
        return [card]

    async def embed(self, req: EmbedRequest, progress: Progress | None = None) -> EmbedResult:
        if self.down or not self.started:
            raise BackendError(f"backend {self.name} is down")
        if self.fail_rate and self.rng.random() < self.fail_rate:
            raise BackendError(f"backend {self.name} failed the request")
        if self.task != EMBED:
            raise BadRequestError(f"the model {req.model!r} does not embed")
        size = req.dimensions or self.embedding_size
        if req.dimensions is not None and not (self.truncatable and size <= self.embedding_size):
            raise BadRequestError(f"the model {req.model!r} cannot give {size} dimensions")
        self.running += 1
        try:
            if self.ttft_s:
                await asyncio.sleep(self.ttft_s)
            vectors = [_unit_vector(ids, self.embedding_size, size) for ids in req.inputs]
            if progress is not None:  # every input at once, after its "compute" (ttft)
                progress.advance(sum(len(ids) for ids in req.inputs))
        finally:
            self.running -= 1
        return EmbedResult(vectors, sum(len(ids) for ids in req.inputs))

    async def check_structured(self, model: str, structured: StructuredOutput) -> None:
        raise BadRequestError("the fake backend cannot constrain its output (structured outputs)")

    async def render(
        self, model: str, prompt: PromptInput, tools: list[dict] | None = None
    ) -> list[int]:
        if not self.vision:
            refuse_images(model, prompt)
        return await render_off_loop(self._render, prompt)  # no template: tools go unused

    def _render(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            ids = [i for m in prompt for i in _message_ids(m)] + _word_ids("assistant:")
        elif isinstance(prompt, list):
            return list(prompt)
        else:
            ids = _word_ids(prompt)
        if not ids:
            raise BadRequestError("The prompt is empty.")
        return ids

    async def detokenize(
        self, model: str, token_ids: list[int], skip_special_tokens: bool = False
    ) -> str:
        # its prompt ids are hashes of words, not invertible: only its output decodes (and
        # it has no special tokens to skip)
        known = range(WORD_ID_BASE, WORD_ID_BASE + len(WORDS))
        return await decode_off_loop(_words, token_ids, known)

    async def check_adapter(self, ref: AdapterRef) -> None:
        if not await asyncio.to_thread(os.path.exists, ref.path):
            raise BadRequestError(f"LoRA adapter {ref.name!r}: no such path {ref.path!r}")

    async def remove_adapter(self, name: str) -> None:
        self.removed_adapters.append(name)
        if name in self.adapters_loaded:
            self.adapters_loaded.remove(name)

    def generate(
        self, req: GenRequest, progress: Progress | None = None
    ) -> AsyncIterator[GenChunk]:
        return self._generate(req, progress)

    async def _generate(
        self, req: GenRequest, progress: Progress | None
    ) -> AsyncIterator[GenChunk]:
        if self.down or not self.started:
            raise BackendError(f"backend {self.name} is down")
        if self.fail_rate and self.rng.random() < self.fail_rate:
            raise BackendError(f"backend {self.name} failed the request")
        sp = req.sampling
        if sp.prompt_logprobs is not None:  # its prompt ids are hashes of words: no model
            raise BadRequestError("the fake backend has no prompt logprobs (echo with logprobs)")
        if req.adapter is not None:
            try:
                await self.check_adapter(req.adapter)
            except BadRequestError as e:  # checked at registration: the files broke since
                raise AdapterLoadError(req.adapter.name, str(e)) from None
            name = req.adapter.name
            self.adapter_requests[name] = self.adapter_requests.get(name, 0) + 1
            if name not in self.adapters_loaded:
                self.adapters_loaded.append(name)
        cached = self._match_prefix(
            req.prompt_token_ids, req.cache_salt, req.adapter, [i.digest for i in req.images]
        )
        if progress is not None:  # its "prefill" is done: the blocks are stored now
            progress.advance(len(req.prompt_token_ids), cached)
        self.running += 1
        finished = False
        emitted = 0
        try:
            if self.ttft_s:
                await asyncio.sleep(self.ttft_s)
            # the gateway is measured with this backend: what each token costs here is
            # counted against the gateway's core, so the loop does only what was asked
            text = ""
            start, stops, top = self._start(req), sp.stop, sp.logprobs
            pace = 1 / self.tokens_per_second if self.tokens_per_second else 0
            mock = None if req.mock_response is None else _mock_tokens(req.mock_response)
            limit = sp.max_tokens if mock is None else min(sp.max_tokens, len(mock))
            if mock == []:  # nothing to say: the answer ends at once
                finished = True
                yield GenChunk([], "", "stop", self._usage(req, 0, cached))
                return
            for i in range(limit):
                emitted = i + 1
                if i and pace:
                    await asyncio.sleep(pace)
                if mock is None:
                    word_index = (start + i * 2654435761) % 1000003 % len(WORDS)  # by position
                    word, token_id = WORDS[word_index], WORD_ID_BASE + word_index
                    piece = " " + word if i else word
                else:
                    piece, token_id = mock[i]
                    word = piece
                logprobs = None if top is None else _logprobs(word, top)
                if stops:
                    text += piece
                    stop = _first_stop(text, stops)
                    if stop is not None:
                        finished = True
                        keep = len(piece) - (len(text) - stop[0])
                        yield GenChunk(
                            [token_id],
                            piece[: max(keep, 0)],
                            "stop",
                            self._usage(req, i + 1, cached),
                            logprobs,
                            stop_sequence=stop[1],
                        )
                        return
                finished = emitted == limit
                # the mocked text ran out: its end is the model's end of sequence
                ended = "stop" if mock is not None and emitted == len(mock) else "length"
                yield GenChunk(
                    [token_id],
                    piece,
                    ended if finished else None,
                    self._usage(req, emitted, cached) if finished else None,
                    logprobs,
                )
                if not pace and i % 64 == 63:
                    await asyncio.sleep(0)  # be fair to other requests on the loop
        finally:
            self.running -= 1
            self._count_generated(emitted)
            if not finished:
                self.aborted.append(req.request_id)

    def _usage(self, req: GenRequest, generated: int, cached: int) -> Usage:
        images = req.prompt_token_ids.count(IMAGE_ID) if req.images else 0
        return Usage(len(req.prompt_token_ids), generated, cached, image_tokens=images)

    def _count_generated(self, n: int) -> None:
        second = int(time.monotonic())
        if self._generated_per_s and self._generated_per_s[-1][0] == second:
            self._generated_per_s[-1][1] += n
        else:
            self._generated_per_s.append([second, n])
            while self._generated_per_s[0][0] < second - 10:
                self._generated_per_s.popleft()

    def stats(self) -> BackendStats:
        recent = sum(n for _, n in self._generated_per_s)  # trimmed to 10 s as it grows
        return BackendStats(
            name=self.name,
            healthy=self.started and not self.down,
            running=self.running,
            waiting=0,
            kv_usage=min(1.0, self.running / self.max_running),
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            gen_tokens_per_s=recent / 10,
            extra={"adapters_loaded": list(self.adapters_loaded)} if self.adapters_loaded else {},
        )

    def _start(self, req: GenRequest) -> int:
        seed = req.sampling.seed if req.sampling.temperature > 0 else None
        key = f"{req.prompt_token_ids[-8:]}|{seed}"
        return zlib.crc32((key + f"|{req.adapter.name}" if req.adapter else key).encode())

    def _match_prefix(
        self, ids: list[int], salt: str | None, adapter: AdapterRef | None, digests: list[str]
    ) -> int:
        """Full prompt blocks seen before under the same salt, adapter and images count as
        cached (its images' placeholders are one id whatever they show: their digests key
        the whole chain, coarser than an engine's keys but never a hit for another image)."""
        parent = (salt or "").encode() + (adapter_root(adapter) or b"") + "".join(digests).encode()
        cached, hit = 0, True
        for start in range(0, len(ids) - len(ids) % BLOCK, BLOCK):
            parent = hashlib.blake2b(parent + str(ids[start : start + BLOCK]).encode()).digest()
            if hit and parent in self.cached_blocks:
                cached += BLOCK
            else:
                hit = False
                self.cached_blocks.add(parent)
        self.prefix_queries += len(ids)
        self.prefix_hits += cached
        return cached


def _word_ids(text: str) -> list[int]:
    return [PROMPT_ID_BASE + zlib.crc32(w.encode()) % 30000 for w in _WORD_RE.findall(text)]


def _message_ids(message: dict) -> list[int]:
    """A message's ids: its role's word, then its text's words and each image's
    placeholders where they stand."""
    content = message.get("content")
    if not isinstance(content, list):
        return _word_ids(f"{message['role']}: {content}\n")
    ids = _word_ids(f"{message['role']}:")
    for part in content:
        if part.get("type") == "image":
            image = part["image"]
            tiles = math.ceil(image.width / IMAGE_TILE) * math.ceil(image.height / IMAGE_TILE)
            ids += [IMAGE_ID] * tiles
        else:
            ids += _word_ids(part.get("text", ""))
    return ids


def _unit_vector(token_ids: list[int], size: int, keep: int) -> list[float]:
    """A vector drawn from a seed of the ids (the same ids, the same vector), cut to its
    first `keep` values and normalized, as a Matryoshka model's is."""
    rng = random.Random(zlib.crc32(str(token_ids).encode()))
    v = [rng.gauss(0, 1) for _ in range(size)][:keep]
    norm = math.hypot(*v)
    return [x / norm for x in v]


def _mock_tokens(text: str) -> list[tuple[str, int]]:
    """A mock_response cut as a tokenizer would: each word or punctuation mark with the
    whitespace before it, so that markers (`<tool_call>`, `[TOOL_CALLS]`) arrive in
    pieces; the ids are hashes of the pieces, as its prompt's are."""
    return [
        (piece, PROMPT_ID_BASE + zlib.crc32(piece.encode()) % 30000)
        for piece in _MOCK_TOKEN_RE.findall(text)
    ]


def _words(token_ids: list[int]) -> str:
    return " ".join(WORDS[t - WORD_ID_BASE] for t in token_ids)


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Where the earliest stop string in `text` begins, and which it is."""
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(found, key=lambda hit: hit[0]) if found else None


def _logprobs(word: str, n: int | None) -> list[TokenLogprob] | None:
    if n is None:
        return None
    top = [(word, -0.1)] + [(w, -3.0 - k) for k, w in enumerate(WORDS[: max(n - 1, 0)])]
    return [TokenLogprob(word, -0.1, top[:n])]
