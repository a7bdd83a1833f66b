"""The engine of an embedding model: admit embed requests, batch their inputs into one
forward per step up to a token budget, finish each request when its last input is done.

An engine serves one model, and a model either generates or embeds (a generator asked
to embed, or an embedding model asked to generate, is a BadRequestError that says which
it does), so this engine takes AsyncLLM's place for an embedding model: the same
command queue and step thread (async_engine.py), a different step. A generation
engine's requests are never held up by embeddings, nor these by generation: each
engine steps in its own thread.

A step takes inputs round-robin over the waiting requests in arrival order (one input
of each in turn), while their padded size (inputs x longest) fits max_num_batched_tokens
and there are at most max_num_seqs: concurrent requests share one forward, and a
request with many inputs advances beside a small one instead of ahead of it. The request
whose input did not fit goes first in the next step, so a long input is not passed over
step after step by short ones; an input longer than the budget (it is at most
max_model_len) runs alone. Nothing is cached
between steps: an encoder has no KV cache, and a decoder embedding model computes each
input whole and keeps only its vector, so no KV blocks are ever taken.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from backend_gpu.config import EngineConfig
from backend_gpu.embed_runner import EmbeddingRunner
from backend_gpu.loader import open_model
from backend_gpu.outputs import EngineStats
from backend_gpu.pooling import check_dimensions, finish, read_embedding_spec, transformer_path
from engine_api.errors import BadRequestError, PromptTooLongError
from engine_api.records import EmbedRequest, EmbedResult, GenRequest, Progress
from engine_api.throughput import Throughput

NOT_A_GENERATOR = "this is an embedding model: it embeds text and does not generate it"


@dataclass
class EmbedOutput:
    """A finished embed request: its vectors, or None when it was aborted."""

    request_id: str
    result: EmbedResult | None
    finished: bool = True  # as RequestOutput's: AsyncLLM delivers both alike


@dataclass
class _Pending:
    req: EmbedRequest
    vectors: list[torch.Tensor | None] = field(default_factory=list)
    scheduled: int = 0  # inputs handed to a step so far
    done: int = 0
    pooled: int = 0  # tokens of the inputs done
    progress: Progress | None = None  # where its caller reads `pooled`


class EmbeddingEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = os.fspath(config.model)
        self.hf_config, self.tokenizer, checkpoint = open_model(transformer_path(path))
        self.spec = read_embedding_spec(path, self.hf_config)
        self.runner = EmbeddingRunner(config, self.hf_config, checkpoint, self.spec)
        limits = (self.spec.max_seq_length, config.max_model_len)
        self.max_model_len = min(
            [self.hf_config.max_position_embeddings, *(n for n in limits if n)]
        )
        self.vocab_size = self.hf_config.vocab_size
        self.pending: dict[str, _Pending] = {}  # in arrival order
        # the request whose input did not fit the last step: it goes first in the next
        self.first: str | None = None
        self.stats_ = EngineStats(weight_bytes=self.runner.weight_bytes)
        self.throughput = Throughput()

    def tokenize(self, text: str) -> list[int]:
        """The ids sentence-transformers gives `text`: stripped, lowercased where the
        model says so, special tokens added (never truncated: add_embed refuses an
        input longer than max_model_len)."""
        text = text.strip()
        return self.tokenizer(text.lower() if self.spec.lowercase else text)["input_ids"]

    def add_embed(self, req: EmbedRequest, progress: Progress | None = None) -> None:
        """Admit an embed request, or raise BadRequestError (PromptTooLongError for an
        input longer than the model takes) and change nothing. `progress` hears, after
        each step, the tokens of its inputs pooled so far."""
        if req.request_id in self.pending:
            raise BadRequestError(f"request id {req.request_id!r} is already in use")
        if not isinstance(req.inputs, list) or not req.inputs:
            raise BadRequestError("input is empty: give at least one input to embed")
        for i, ids in enumerate(req.inputs):
            self._check_input(i, ids)
        check_dimensions(self.spec, req.dimensions)
        self.pending[req.request_id] = _Pending(req, [None] * len(req.inputs), progress=progress)

    def _check_input(self, i: int, ids: list[int]) -> None:
        if not isinstance(ids, list) or not ids:
            raise BadRequestError(f"input {i} is empty: an input needs at least one token")
        if not all(type(t) is int for t in ids):
            raise BadRequestError(f"input {i} must be a list of integer token ids")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise BadRequestError(
                f"input {i} has token ids outside the vocabulary [0, {self.vocab_size})"
            )
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(len(ids), 0, self.max_model_len)

    def add_request(self, req: GenRequest, progress: Progress | None = None) -> None:
        raise BadRequestError(NOT_A_GENERATOR)

    def abort_request(self, request_id: str) -> EmbedOutput | None:
        """Drop a request (its inputs in flight finish with nothing kept); unknown ids
        are ignored."""
        if self.pending.pop(request_id, None) is None:
            return None
        return EmbedOutput(request_id, None)

    def take_kv_events(self) -> list:
        return []  # no prefix cache

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def _schedule(self) -> list[tuple[_Pending, int]]:
        """(request, input index) pairs of this step: round-robin over the waiting
        requests while the padded batch fits the budget (one input at least)."""
        budget, seats = self.config.max_num_batched_tokens, self.config.max_num_seqs
        order = list(self.pending.values())
        start = next((i for i, p in enumerate(order) if p.req.request_id == self.first), 0)
        order = order[start:] + order[:start]
        self.first = None
        batch: list[tuple[_Pending, int]] = []
        longest = 0
        while True:
            took = False
            for p in order:
                if p.scheduled == len(p.req.inputs):
                    continue
                n = len(p.req.inputs[p.scheduled])
                if batch and (len(batch) >= seats or (len(batch) + 1) * max(longest, n) > budget):
                    self.first = p.req.request_id  # not passed over again by the others
                    return batch
                batch.append((p, p.scheduled))
                p.scheduled += 1
                longest = max(longest, n)
                took = True
            if not took:
                return batch

    @torch.inference_mode()
    def step(self) -> list[EmbedOutput]:
        batch = self._schedule()
        if not batch:
            return []
        vectors = self.runner.run([p.req.inputs[i] for p, i in batch])
        num_tokens = sum(len(p.req.inputs[i]) for p, i in batch)
        outputs = []
        for (p, i), vector in zip(batch, vectors, strict=True):
            p.vectors[i] = vector
            p.done += 1
            p.pooled += len(p.req.inputs[i])
            if p.progress is not None:
                p.progress.advance(p.pooled)
            if p.done == len(p.req.inputs) and self.pending.get(p.req.request_id) is p:
                del self.pending[p.req.request_id]
                outputs.append(EmbedOutput(p.req.request_id, self._result(p)))
        self.stats_.num_steps += 1
        self.stats_.num_batched_tokens_total += num_tokens
        self.throughput.record(num_tokens, 0)
        return outputs

    def _result(self, p: _Pending) -> EmbedResult:
        vectors = finish(torch.stack(p.vectors), self.spec, p.req.dimensions)
        prompt_tokens = sum(len(ids) for ids in p.req.inputs)
        return EmbedResult(vectors.cpu().tolist(), prompt_tokens)

    def stats(self) -> EngineStats:
        s = self.stats_
        s.waiting = len(self.pending)
        s.prompt_tokens_per_s, s.gen_tokens_per_s = self.throughput.rates()
        return EngineStats(**vars(s))

    def close(self) -> None:
        """Let go of the model (AsyncLLM.shutdown closes either engine this way)."""
        self.runner.close()
