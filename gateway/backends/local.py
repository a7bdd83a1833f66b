"""Adapter: the gateway's Backend protocol over `backend_local.LocalEngine` (llama.cpp).

The engine takes engine_api's SamplingParams and raises engine_api's errors (DecodeError
is a BackendError), so requests and errors pass through as they are; only outputs are
reshaped, by what every in-process adapter shares (in_process.py). This says where the
engine's tokenizer is, how its outputs read, and how the fair queue's spare seat fits.

With `options.task = "embed"` the engine embeds (pooled as `options.pooling` says) and
this is an EmbeddingBackend: the card says so, `render` tokenizes text as llama-server's
--embedding does (BOS and special tokens) and `embed` runs the request; chat messages and
`generate` are a BadRequestError that says the model embeds.

Images: with an entry's `mmproj` option (the GGUF's vision projector, as llama-server's
--mmproj) the card says `vision` and a chat's images are rendered as llama-server does:
each image part is libmtmd's media marker in the template's text, and libmtmd tokenizes
that text with the images (backend_local.vision); each image stands in the prompt as a
run of the engine's placeholder id, its blocks keyed by the image's digest. Without it
the model takes none (a chat with an image is a 400)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable

from backend_local import EngineConfig, LocalEngine, ModelLoadError, RequestOutput
from backend_local.engine import NOT_A_GENERATOR
from backend_local.prefix_blocks import BLOCK_SIZE
from engine_api.block_hash import adapter_root, hash_blocks, image_key_spans
from engine_api.errors import BackendError, BadRequestError
from engine_api.images import ImageInput
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
from gateway.backends.common import check_model, has_images, render_off_loop, render_prompt
from gateway.backends.generation_config import from_gguf
from gateway.backends.in_process import InProcessBackend, Output, Tokenization
from gateway.backends.spec import BackendSpec
from gateway.backends.vision_render import with_image_markers

ENGINE_OPTIONS = (
    *("n_ctx", "n_parallel", "n_batch", "n_threads", "verbose"),
    *("task", "pooling", "normalize"),
    *("kv_disk_path", "kv_disk_gb", "kv_tier_secret"),
    *("enable_lora", "max_loras"),
    "mmproj",
)


class LocalBackend(InProcessBackend[LocalEngine]):
    kind = "local"
    engine_options = ENGINE_OPTIONS

    def __init__(self, spec: BackendSpec) -> None:
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
            return {"vision": engine.vision is not None}
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

    @property
    def image_token_id(self) -> int | None:
        """The id each image's run is made of in a prompt (a worker's /v1/models tells
        it, so a gateway keys an image's blocks as this engine does); None: no images."""
        vision = self._engine.vision if self._engine is not None else None
        return vision.placeholder if vision is not None else None

    async def render_chat(
        self, model: str, prompt: PromptInput, tools: list[dict] | None, kwargs: dict
    ) -> list[int]:
        """A chat with images on a model with a projector: the template's text with
        libmtmd's marker for each image, tokenized by libmtmd with the images (a thread);
        everything else as any backend renders it."""
        vision = self._engine.vision if self._engine is not None else None
        if vision is None or not has_images(prompt):
            return await super().render_chat(model, prompt, tools, kwargs)
        check_model(model, self.model_id)
        messages, images = with_image_markers(prompt, vision.marker)
        t = self._tokenization()
        return await asyncio.to_thread(
            render_prompt,
            messages,
            lambda text, add_bos: vision.tokenize(text, images, add_bos),
            t.chat_template,
            t.architecture,
            t.bos_token,
            t.eos_token,
            tools,
            kwargs,
        )

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
            usage = Usage(
                out.prompt_tokens,
                out.completion_tokens,
                out.cached_tokens,
                image_tokens=out.image_tokens,
            )
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
        images: list[ImageInput] | None = None,
    ) -> list[str]:
        """The engine's keys: with `images`, their placeholder runs' blocks keyed by
        their digests as the engine keys them (runs that do not pair with them: none,
        the engine refuses the request)."""
        keys = None
        if images and self.image_token_id is not None:
            try:
                keys = image_key_spans(token_ids, self.image_token_id, [i.digest for i in images])
            except BadRequestError:
                return []
        root = adapter_root(adapter)
        hashes = hash_blocks(
            token_ids, BLOCK_SIZE, cache_salt, shared_prefix_len, root, extra_keys=keys
        )
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
