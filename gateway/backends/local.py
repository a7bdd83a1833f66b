"""Adapter: the gateway's Backend protocol over `backend_local.LocalEngine` (llama.cpp).

The engine takes engine_api's SamplingParams and raises engine_api's errors (DecodeError
is a BackendError), so requests and errors pass through as they are; only outputs are
reshaped into GenChunks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator

from backend_local import EngineConfig, LocalEngine, ModelLoadError, RequestOutput
from backend_local.prefix_blocks import block_hashes
from engine_api.errors import BackendError
from engine_api.records import (
    BackendStats,
    GenChunk,
    GenRequest,
    KVEvent,
    ModelCard,
    PromptInput,
    Usage,
)
from engine_api.structured import StructuredOutput
from gateway.backends.base import SPARE_SEATS
from gateway.backends.common import (
    check_model,
    check_options,
    decode_off_loop,
    named_logprob,
    render_off_loop,
    render_prompt,
    served_model_id,
)
from gateway.backends.default_model import default_model_path
from gateway.backends.spec import BackendSpec

ENGINE_OPTIONS = ("n_ctx", "n_parallel", "n_batch", "n_threads", "verbose")


class LocalBackend:
    def __init__(self, spec: BackendSpec) -> None:
        check_options(spec, ENGINE_OPTIONS)
        self.name = spec.name
        self.spec = spec
        self.model_id = served_model_id(spec)
        self._engine: LocalEngine | None = None
        self._last_events: list[KVEvent] = []  # a stopped engine's last ones ("removed")
        # llama.cpp serves its slots first come, first served: the gateway queues fairly
        # in front of them (gateway/routing/fair_queue.py)
        self.max_in_flight: int | None = None

    async def start(self) -> None:
        if self._engine is not None:
            return
        path = self.spec.model or str(await asyncio.to_thread(default_model_path))
        try:
            config = EngineConfig(model_path=path, enable_kv_events=True, **self.spec.options)
            self.max_in_flight = config.n_parallel
            # one more sequence, with a full share of the context, for the fair queue's
            # spare seat (a tenant with nothing in flight starts at once)
            seqs = config.n_parallel + SPARE_SEATS
            config = dataclasses.replace(config, n_parallel=seqs, n_ctx=config.n_ctx_per_seq * seqs)
            self._engine = await asyncio.to_thread(LocalEngine, config)
        except (ModelLoadError, ValueError) as exc:
            raise BackendError(f"local backend {self.name!r}: {exc}") from exc

    async def stop(self, drain: bool = True) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await engine.stop(drain)
            self._last_events += self._events_of(engine)

    @property
    def engine(self) -> LocalEngine:
        if self._engine is None:
            raise BackendError(f"local backend {self.name!r} is not running")
        return self._engine

    def models(self) -> list[ModelCard]:
        length = self._engine.context_length if self._engine else 0
        return [ModelCard(id=self.model_id, backend=self.name, context_length=length)]

    async def render(
        self, model: str, prompt: PromptInput, tools: list[dict] | None = None
    ) -> list[int]:
        check_model(model, self.model_id)
        engine = self.engine
        llama = engine.model
        return await render_off_loop(
            lambda p: render_prompt(
                p,
                lambda text, add_bos: engine.tokenize(text, add_special=add_bos),
                llama.chat_template,
                llama.architecture,
                bos_token=llama.bos_text,
                eos_token=llama.eos_text,
                tools=tools,
            ),
            prompt,
        )

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        check_model(model, self.model_id)
        engine = self.engine
        return await decode_off_loop(engine.detokenize, token_ids, range(engine.model.n_vocab))

    async def check_structured(self, model: str, structured: StructuredOutput) -> None:
        check_model(model, self.model_id)
        await self.engine.check_structured(structured)

    async def generate(self, req: GenRequest) -> AsyncIterator[GenChunk]:
        """BadRequestError (400) comes from the engine before the first chunk;
        EngineDeadError and DecodeError (BackendErrors, 503) at any chunk."""
        check_model(req.model, self.model_id)
        stream = self.engine.generate(
            req.request_id,
            req.prompt_token_ids,
            req.sampling,
            req.cache_salt,
            req.shared_prefix_len,
        )
        async with contextlib.aclosing(stream):
            async for out in stream:
                if out.prompt_logprobs is None:
                    yield self._chunk(out)
                else:  # a prompt's worth of token texts: off the event loop
                    yield await asyncio.to_thread(self._chunk, out)

    def _chunk(self, out: RequestOutput) -> GenChunk:
        usage = None
        if out.finish_reason is not None:
            usage = Usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
        as_text = functools.partial(named_logprob, self.engine.model.token_text)
        logprobs = prompt_logprobs = None
        if out.logprobs is not None:
            logprobs = [as_text(lp) for lp in out.logprobs]
        if out.prompt_logprobs is not None:  # the first output only; None for the first token
            prompt_logprobs = [None if lp is None else as_text(lp) for lp in out.prompt_logprobs]
        return GenChunk(
            out.token_ids, out.text, out.finish_reason, usage, logprobs, prompt_logprobs
        )

    def block_hashes(
        self, token_ids: list[int], cache_salt: str | None, shared_prefix_len: int = 0
    ) -> list[str]:
        return block_hashes(token_ids, cache_salt, shared_prefix_len)

    def kv_events(self) -> list[KVEvent]:
        events, self._last_events = self._last_events, []
        if self._engine is not None:
            events += self._events_of(self._engine)
        return events

    def _events_of(self, engine: LocalEngine) -> list[KVEvent]:
        return [
            KVEvent(replica=self.name, **dataclasses.asdict(e)) for e in engine.take_kv_events()
        ]

    def stats(self) -> BackendStats:
        if self._engine is None:
            return BackendStats(name=self.name, healthy=False)
        s = self._engine.stats()
        return BackendStats(
            name=self.name,
            healthy=s.healthy,
            running=s.busy,
            waiting=s.waiting,
            kv_usage=s.kv_cells_busy / s.n_ctx,
            prefix_queries=s.prefix_query_tokens,
            prefix_hits=s.prefix_reused_tokens,
            prompt_tokens_per_s=s.prompt_tokens_per_s,
            gen_tokens_per_s=s.gen_tokens_per_s,
            extra={
                "n_parallel": s.n_parallel,
                "free_sequences": s.free,
                "prompt_tokens_total": s.prompt_tokens_total,
                "gen_tokens_total": s.gen_tokens_total,
            },
        )
