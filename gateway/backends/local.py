"""Adapter: the gateway's Backend protocol over `backend_local.LocalEngine` (llama.cpp).

The engine takes engine_api's SamplingParams and raises engine_api's errors (DecodeError
is a BackendError), so requests and errors pass through as they are; only outputs are
reshaped, by what every in-process adapter shares (in_process.py). This says where the
engine's tokenizer is, how its outputs read, and how the fair queue's spare seat fits.

With `options.task = "embed"` the engine embeds (pooled as `options.pooling` says) and
this is an EmbeddingBackend: the card says so, `render` tokenizes text as llama-server's
--embedding does (BOS and special tokens) and `embed` runs the request; chat messages and
`generate` are a BadRequestError that says the model embeds.

Images: its models take none (the card's `vision` is false: a chat with an image is a
400). An entry's `mmproj` option (a GGUF's vision projector) is refused at start-up:
llama-cpp-python 0.3.36 encodes images with libmtmd only inside its chat handlers
(MTMDChatHandler, Qwen25VLChatHandler: one sequence through Llama.create_chat_completion),
and this engine batches its own slots without them."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable

from backend_local import EngineConfig, LocalEngine, ModelLoadError, RequestOutput
from backend_local.engine import NOT_A_GENERATOR
from backend_local.prefix_blocks import BLOCK_SIZE
from engine_api.block_hash import adapter_root, hash_blocks
from engine_api.errors import BackendError, BadRequestError
from engine_api.records import (
    EMBED,
    AdapterRef,
    BackendStats,
    EmbedRequest,
    EmbedResult,
    GenRequest,
    KVEvent,
    Progress,
    PromptInput,
    Usage,
)
from gateway.backends.base import SPARE_SEATS
from gateway.backends.common import check_model, render_off_loop
from gateway.backends.generation_config import from_gguf
from gateway.backends.in_process import InProcessBackend, Output, Tokenization
from gateway.backends.spec import BackendSpec

ENGINE_OPTIONS = (
    *("n_ctx", "n_parallel", "n_batch", "n_threads", "verbose"),
    *("task", "pooling", "normalize"),
    *("kv_disk_path", "kv_disk_gb", "kv_tier_secret"),
    *("enable_lora", "max_loras"),
)

MMPROJ_REFUSED = (
    "local backend {name!r}: option mmproj: kvgate's llama.cpp engine does not serve images "
    "yet (llama-cpp-python's multimodal support is its single-sequence chat handlers, which "
    "this batched engine does not use); serve the vision model on the gpu backend, or "
    "remove mmproj"
)


class LocalBackend(InProcessBackend[LocalEngine]):
    kind = "local"
    engine_options = ENGINE_OPTIONS

    def __init__(self, spec: BackendSpec) -> None:
        if "mmproj" in spec.options:
            raise ValueError(MMPROJ_REFUSED.format(name=spec.name))
        super().__init__(spec)
        self._last_events: list[KVEvent] = []  # a stopped engine's last ones ("removed")
        # llama.cpp serves its slots first come, first served: the gateway queues fairly
        # in front of them (gateway/routing/fair_queue.py)
        self.max_in_flight: int | None = None

    async def _start_engine(self, path: str) -> LocalEngine:
        try:
            config = EngineConfig(model_path=path, enable_kv_events=True, **self.spec.options)
            self.max_in_flight = config.n_parallel
            # one more sequence, with a full share of the context, for the fair queue's
            # spare seat (a tenant with nothing in flight starts at once)
            seqs = config.n_parallel + SPARE_SEATS
            config = dataclasses.replace(config, n_parallel=seqs, n_ctx=config.n_ctx_per_seq * seqs)
            return await asyncio.to_thread(LocalEngine, config)
        except (ModelLoadError, ValueError) as exc:
            raise BackendError(f"local backend {self.name!r}: {exc}") from exc

    async def stop(self, drain: bool = True) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await engine.stop(drain)
            self._last_events += self._events_of(engine)

    def _context_length(self) -> int:
        return self.engine.context_length

    def _model_sampling(self, path: str) -> dict[str, float]:
        return from_gguf(self.engine.model.meta)

    def _card_fields(self) -> dict:
        engine = self.engine
        if engine.pooling is None:
            return {}
        return {"task": EMBED, "embedding_size": engine.model.n_embd, "truncatable": False}

    async def render(
        self, model: str, prompt: PromptInput, tools: list[dict] | None = None
    ) -> list[int]:
        """On an embedding model: text -> the ids llama-server embeds (BOS added, special
        tokens parsed), token ids as they are, chat messages a BadRequestError."""
        if self._engine is None or self._engine.pooling is None:
            return await super().render(model, prompt, tools)
        check_model(model, self.model_id)
        if isinstance(prompt, str):
            return await render_off_loop(self._engine.tokenize, prompt)
        if prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        raise BadRequestError(f"{NOT_A_GENERATOR} (it takes text or token ids, not messages)")

    async def embed(self, req: EmbedRequest, progress: Progress | None = None) -> EmbedResult:
        check_model(req.model, self.model_id)
        return await self.engine.embed(req, progress)

    def _tokenization(self) -> Tokenization:
        engine = self.engine
        llama = engine.model
        return Tokenization(
            lambda text, add_bos: engine.tokenize(text, add_special=add_bos),
            llama.chat_template,
            llama.architecture,
            llama.bos_text,
            llama.eos_text,
            (llama.architecture,),  # a GGUF's general.architecture
            llama.architecture,
        )

    def _decoder(self, skip_special_tokens: bool) -> tuple[Callable[[list[int]], str], range]:
        engine = self.engine
        decode = functools.partial(engine.detokenize, skip_special_tokens=skip_special_tokens)
        return decode, range(engine.model.n_vocab)

    def _token_text(self) -> Callable[[int], str]:
        return self.engine.model.token_text

    def _stream(self, req: GenRequest, progress: Progress | None) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(req, progress)

    def _output(self, out: RequestOutput, req: GenRequest) -> Output:
        usage = None
        if out.finish_reason is not None:
            usage = Usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
        return Output(
            out.token_ids,
            out.text,
            out.finish_reason,
            usage,
            out.logprobs,
            out.prompt_logprobs,
            out.stop_sequence,
        )

    def block_hashes(
        self,
        token_ids: list[int],
        cache_salt: str | None,
        shared_prefix_len: int = 0,
        adapter: AdapterRef | None = None,
    ) -> list[str]:
        root = adapter_root(adapter)
        hashes = hash_blocks(token_ids, BLOCK_SIZE, cache_salt, shared_prefix_len, root)
        return [h.hex() for h in hashes]

    async def _check_adapter(self, ref: AdapterRef) -> None:
        """The engine reads the GGUF adapter's header, off the event loop."""
        await asyncio.to_thread(self.engine.check_adapter, ref)

    async def remove_adapter(self, name: str) -> None:
        self.engine.remove_adapter(name)

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
        extra = {
            "n_parallel": s.n_parallel,
            "free_sequences": s.free,
            "prompt_tokens_total": s.prompt_tokens_total,
            "gen_tokens_total": s.gen_tokens_total,
        }
        if self._engine.config.enable_lora:
            extra |= {"adapters_loaded": list(s.adapters_loaded), "lora_loads": s.lora_loads}
        if self._engine.config.kv_disk_path:  # a tier's counters only when it is on
            extra |= {k: v for k, v in dataclasses.asdict(s).items() if k.startswith("kv_disk_")}
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
            extra=extra,
        )
