"""Adapter: the gateway's Backend protocol over `backend_gpu.AsyncLLM` (in-process engine).

The engine takes engine_api's SamplingParams and raises engine_api's errors, so requests
and errors pass through as they are; only outputs are reshaped into GenChunks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator

from backend_gpu import AsyncLLM, RequestOutput
from backend_gpu.config import EngineConfig
from engine_api.block_hash import hash_blocks
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

ENGINE_OPTIONS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "model")


def _architecture(model_type: str) -> str:
    return "gemma3" if model_type == "gemma3_text" else model_type


class GpuBackend:
    def __init__(self, spec: BackendSpec) -> None:
        check_options(spec, ENGINE_OPTIONS)
        self.name = spec.name
        self.spec = spec
        self.model_id = served_model_id(spec)
        self._engine: AsyncLLM | None = None

    async def start(self) -> None:
        if self._engine is not None:
            return
        path = self.spec.model or str(await asyncio.to_thread(default_model_path))
        try:
            # KV events feed the gateway's prefix catalog (the router's view of the cache)
            options = {"enable_kv_events": True} | self.spec.options
            self._engine = await asyncio.to_thread(AsyncLLM, path, **options)
        except (OSError, ValueError, NotImplementedError) as exc:
            raise BackendError(f"gpu backend {self.name!r}: {exc}") from exc

    async def stop(self, drain: bool = True) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        if drain:
            while engine.stats().running or engine.stats().waiting:
                if engine.error is not None:
                    break
                await asyncio.sleep(0.05)
        await engine.shutdown()

    @property
    def failure(self) -> BaseException | None:
        """Why the engine died (a failed step, a lost tensor-parallel rank), if it did:
        it serves nothing more."""
        return None if self._engine is None else self._engine.error

    @property
    def engine(self) -> AsyncLLM:
        if self._engine is None:
            raise BackendError(f"gpu backend {self.name!r} is not running")
        if self._engine.error is not None:
            raise BackendError(f"gpu backend {self.name!r} failed: {self._engine.error!r}")
        return self._engine

    def models(self) -> list[ModelCard]:
        length = self._engine.max_model_len if self._engine else 0
        return [ModelCard(id=self.model_id, backend=self.name, context_length=length)]

    async def render(
        self, model: str, prompt: PromptInput, tools: list[dict] | None = None
    ) -> list[int]:
        check_model(model, self.model_id)
        tokenizer = self.engine.tokenizer
        architecture = _architecture(self.engine.engine.hf_config.model_type)
        return await render_off_loop(
            lambda p: render_prompt(
                p,
                lambda text, add_bos: tokenizer.encode(text, add_special_tokens=add_bos),
                tokenizer.chat_template,
                architecture,
                bos_token=tokenizer.bos_token or "",
                eos_token=tokenizer.eos_token or "",
                tools=tools,
            ),
            prompt,
        )

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        check_model(model, self.model_id)
        tokenizer = self.engine.tokenizer
        return await decode_off_loop(tokenizer.decode, token_ids, range(len(tokenizer)))

    async def check_structured(self, model: str, structured: StructuredOutput) -> None:
        check_model(model, self.model_id)
        await self.engine.check_structured(structured)

    async def generate(self, req: GenRequest) -> AsyncIterator[GenChunk]:
        """BadRequestError (400) or EngineDeadError (a BackendError, 503) come from the
        engine as they are, before the first chunk."""
        check_model(req.model, self.model_id)
        stream = self.engine.generate(
            req.prompt_token_ids,
            req.sampling,
            req.request_id,
            req.cache_salt,
            req.priority,
            req.shared_prefix_len,
            req.tenant_id,
            req.weight,
        )
        async with contextlib.aclosing(stream):
            async for out in stream:
                if out.prompt_logprobs is None:
                    yield self._chunk(out, len(req.prompt_token_ids))
                else:  # a prompt's worth of token texts: off the event loop
                    yield await asyncio.to_thread(self._chunk, out, len(req.prompt_token_ids))

    def block_hashes(
        self, token_ids: list[int], cache_salt: str | None, shared_prefix_len: int = 0
    ) -> list[str]:
        if self._engine is None:
            return []
        block_size = self._engine.engine.config.block_size
        return [h.hex() for h in hash_blocks(token_ids, block_size, cache_salt, shared_prefix_len)]

    def kv_events(self) -> list[KVEvent]:
        if self._engine is None:
            return []
        return [
            KVEvent(
                e.kind,
                self.name,
                e.block_hash.hex(),
                e.parent_hash.hex() if e.parent_hash else None,
                e.cache_salt,
                len(e.token_ids),
                e.at,
            )
            for e in self._engine.take_kv_events()
        ]

    def _chunk(self, out: RequestOutput, num_prompt_tokens: int) -> GenChunk:
        usage = None
        if out.finished:
            usage = Usage(num_prompt_tokens, len(out.token_ids), out.num_cached_tokens)

        @functools.cache  # a prompt's logprobs name the same few tokens many times
        def text(token: int) -> str:
            return self.engine.tokenizer.decode([token])

        as_text = functools.partial(named_logprob, text)
        logprobs = prompt_logprobs = None
        if out.logprobs and out.new_token_ids:
            logprobs = [as_text(lp) for lp in out.logprobs[-len(out.new_token_ids) :]]
        if out.prompt_logprobs is not None:  # the first output only; None for the first token
            prompt_logprobs = [None if lp is None else as_text(lp) for lp in out.prompt_logprobs]
        return GenChunk(
            out.new_token_ids,
            out.text_delta,
            out.finish_reason,
            usage,
            logprobs,
            prompt_logprobs,
        )

    def stats(self) -> BackendStats:
        if self._engine is None:
            return BackendStats(name=self.name, healthy=False)
        s = self._engine.stats()
        return BackendStats(
            name=self.name,
            healthy=self._engine.error is None,
            running=s.running,
            waiting=s.waiting,
            kv_usage=s.kv_usage,
            prefix_queries=s.prefix_queries,
            prefix_hits=s.prefix_hits,
            preemptions=s.preemptions,
            prompt_tokens_per_s=s.prompt_tokens_per_s,
            gen_tokens_per_s=s.gen_tokens_per_s,
            extra={
                "num_blocks": s.num_blocks,
                "num_free_blocks": s.num_free_blocks,
                "num_steps": s.num_steps,
                "kv_cache_bytes": s.kv_cache_bytes,
                "weight_bytes": s.weight_bytes,
                "spec_decode_num_drafts": s.num_drafts,
                "spec_decode_num_draft_tokens": s.num_draft_tokens,
                "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
                "tenants": {
                    tenant: dataclasses.asdict(share) for tenant, share in s.tenants.items()
                },
            },
        )
