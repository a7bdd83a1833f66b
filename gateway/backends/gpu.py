"""Adapter: the gateway's Backend protocol over `backend_gpu.AsyncLLM` (in-process engine).

The engine takes engine_api's SamplingParams and raises engine_api's errors, so requests
and errors pass through as they are; only outputs are reshaped, by what every in-process
adapter shares (in_process.py). This says where the engine's tokenizer is and how its
outputs read.

On an embedding model (the engine's task EMBED) it is an EmbeddingBackend: the card
says so, `render` tokenizes text as sentence-transformers does and `embed` runs the
request; chat messages, `generate` and structured outputs are a BadRequestError that
says the model embeds."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
from collections.abc import AsyncIterator, Callable

from backend_gpu import AsyncLLM, EngineStats, RequestOutput
from backend_gpu.config import EngineConfig
from backend_gpu.embed_engine import NOT_A_GENERATOR
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
from gateway.backends.common import check_model, has_images, render_off_loop
from gateway.backends.generation_config import from_hf_dir
from gateway.backends.in_process import InProcessBackend, Output, Tokenization
from gateway.backends.vision_render import widen_placeholders, with_image_markers

ENGINE_OPTIONS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "model")
# each KV tier's counters (EngineStats.kv_host_*, ...), passed on under their own names
KV_TIER_STATS = {
    tier: tuple(f.name for f in dataclasses.fields(EngineStats) if f.name.startswith(f"kv_{tier}_"))
    for tier in ("host", "disk", "shared")
}
# blocks moved between engines (kv_transfer): taken tokens, blocks out, in, refused
KV_TRANSFER_STATS = tuple(
    f.name for f in dataclasses.fields(EngineStats) if f.name.startswith("kv_transfer_")
)


def kv_tiers_on(config: EngineConfig) -> list[str]:
    """The tiers under the KV cache that `config` asks for: only theirs are reported. The
    host tier stages blocks for the others, so it is on with any of them."""
    lower = [t for t, on in (("disk", config.kv_disk_path), ("shared", config.kv_shared_url)) if on]
    return ["host", *lower] if lower or config.kv_offload_gb else []


def _architecture(model_type: str) -> str:
    """The built-in chat template's family of a text model type (a multimodal model's
    text model takes its family's: Qwen2.5-VL chats as Qwen2 does)."""
    return {"gemma3_text": "gemma3", "qwen2_5_vl_text": "qwen2"}.get(model_type, model_type)


class GpuBackend(InProcessBackend[AsyncLLM]):
    kind = "gpu"
    engine_options = ENGINE_OPTIONS

    async def _start_engine(self, path: str) -> AsyncLLM:
        try:
            # KV events feed the gateway's prefix catalog (the router's view of the cache)
            options = {"enable_kv_events": True} | self.spec.options
            return await asyncio.to_thread(AsyncLLM, path, **options)
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
        engine = super().engine
        if engine.error is not None:
            raise BackendError(f"gpu backend {self.name!r} failed: {engine.error!r}")
        return engine

    def _context_length(self) -> int:
        return self.engine.max_model_len

    def _model_sampling(self, path: str) -> dict[str, float]:
        # a Hugging Face directory's generation_config.json (a GGUF file on this engine
        # is read by the gguf package, whose reader is not kept: none there)
        return from_hf_dir(path) if os.path.isdir(path) else {}

    def _card_fields(self) -> dict:
        engine = self.engine
        if engine.task != EMBED:
            return {"vision": self._vision() is not None}
        spec = engine.engine.spec
        return {"task": EMBED, "embedding_size": spec.size, "truncatable": spec.truncatable}

    async def render(
        self, model: str, prompt: PromptInput, tools: list[dict] | None = None
    ) -> list[int]:
        """On an embedding model: text -> the ids sentence-transformers gives it (special
        tokens included), token ids as they are, chat messages a BadRequestError."""
        if self._engine is None or self._engine.task != EMBED:
            return await super().render(model, prompt, tools)
        check_model(model, self.model_id)
        if isinstance(prompt, str):
            return await render_off_loop(self._engine.engine.tokenize, prompt)
        if prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        raise BadRequestError(f"{NOT_A_GENERATOR} (it takes text or token ids, not messages)")

    def _vision(self):
        """The engine's image inputs (backend_gpu.multimodal.VisionSteps); None: a model
        that takes no images."""
        if self._engine is None or self._engine.task == EMBED:
            return None
        return self._engine.engine.runner.vision

    @property
    def image_token_id(self) -> int | None:
        """A vision model's image placeholder token (a worker's /v1/models tells it, so a
        gateway keys an image's blocks as this engine does); None: it takes no images."""
        if self._vision() is None:
            return None
        return self._engine.engine.hf_config.image_token_id

    async def render_chat(
        self, model: str, prompt: PromptInput, tools: list[dict] | None, kwargs: dict
    ) -> list[int]:
        """A vision model's chat with images: each image part as its placeholder run
        (gateway.backends.vision_render); everything else as any backend renders it."""
        vision = self._vision()
        if vision is None or not has_images(prompt):
            return await super().render_chat(model, prompt, tools, kwargs)
        markers = vision.markers
        messages, images = with_image_markers(prompt, markers.marker)
        token_ids = await super().render_chat(model, messages, tools, kwargs, markers.expand)
        try:
            counts = [vision.processor.num_tokens(im.width, im.height) for im in images]
        except ValueError as exc:  # an aspect ratio past the processor's
            raise BadRequestError(str(exc)) from None
        pad_id = self.engine.engine.hf_config.image_token_id
        refused = markers.pad if markers.expansion is None else f"{markers.marker} or {markers.pad}"
        return widen_placeholders(token_ids, pad_id, counts, refused)

    async def embed(self, req: EmbedRequest, progress: Progress | None = None) -> EmbedResult:
        check_model(req.model, self.model_id)
        return await self.engine.embed(req, progress)

    def _tokenization(self) -> Tokenization:
        tokenizer = self.engine.tokenizer
        config = self.engine.engine.hf_config
        return Tokenization(
            lambda text, add_bos: tokenizer.encode(text, add_special_tokens=add_bos),
            tokenizer.chat_template,
            _architecture(config.model_type),
            tokenizer.bos_token or "",
            tokenizer.eos_token or "",
            tuple(getattr(config, "architectures", None) or ()),
            config.model_type,
        )

    def _decoder(self, skip_special_tokens: bool) -> tuple[Callable[[list[int]], str], range]:
        tokenizer = self.engine.tokenizer
        decode = functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
        return decode, range(len(tokenizer))

    def _token_text(self) -> Callable[[int], str]:
        tokenizer = self.engine.tokenizer
        return lambda token: tokenizer.decode([token])

    def _stream(self, req: GenRequest, progress: Progress | None) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(req, progress)

    def _output(self, out: RequestOutput, req: GenRequest) -> Output:
        usage = None
        if out.finished:
            usage = Usage(
                len(req.prompt_token_ids),
                len(out.token_ids),
                out.num_cached_tokens,
                image_tokens=out.num_image_tokens,
            )
        logprobs = None
        if out.logprobs and out.new_token_ids:
            logprobs = out.logprobs[-len(out.new_token_ids) :]
        return Output(
            out.new_token_ids,
            out.text_delta,
            out.finish_reason,
            usage,
            logprobs,
            out.prompt_logprobs,
            # vLLM's stop_reason: the stop string, or the stop token id that ended it
            out.stop_reason if isinstance(out.stop_reason, str) else None,
        )

    async def export_kv(self, req: GenRequest) -> list[bytes]:
        """KVTransferBackend: the records of `req`'s prompt blocks the engine holds; a
        BadRequestError when it was not started with kv_transfer."""
        check_model(req.model, self.model_id)
        return await self.engine.export_kv(req)

    async def import_kv(self, req: GenRequest, records: list[bytes]) -> int:
        """KVTransferBackend: a prefill worker's records, for `req` to continue from."""
        check_model(req.model, self.model_id)
        return await self.engine.import_kv(req, records)

    def block_hashes(
        self,
        token_ids: list[int],
        cache_salt: str | None,
        shared_prefix_len: int = 0,
        adapter: AdapterRef | None = None,
        images: list[ImageInput] | None = None,
    ) -> list[str]:
        """The engine's keys: with `images`, their placeholders' blocks keyed by their
        digests as the engine keys them (a prompt whose placeholders do not pair with
        them: none, the engine refuses it)."""
        if self._engine is None:
            return []
        block_size = self._engine.engine.config.block_size
        root = adapter_root(adapter)
        keys = None
        if images and self._vision() is not None:
            pad_id = self._engine.engine.hf_config.image_token_id
            try:
                keys = image_key_spans(token_ids, pad_id, [im.digest for im in images])
            except BadRequestError:
                return []
        hashes = hash_blocks(
            token_ids, block_size, cache_salt, shared_prefix_len, root, extra_keys=keys
        )
        return [h.hex() for h in hashes]

    async def _check_adapter(self, ref: AdapterRef) -> None:
        """The engine validates it against its model, off its own thread."""
        await self.engine.check_adapter(ref)

    async def remove_adapter(self, name: str) -> None:
        await self.engine.remove_adapter(name)

    def kv_events(self) -> list[KVEvent]:
        if self._engine is None:
            return []
        # a lower tier's event carries no tokens; its blocks are full ones
        block_size = self._engine.engine.config.block_size
        return [
            KVEvent(
                e.kind,
                self.name,
                e.block_hash.hex(),
                e.parent_hash.hex() if e.parent_hash else None,
                e.cache_salt,
                len(e.token_ids) if e.medium == "device" else block_size,
                e.at,
                e.medium,
            )
            for e in self._engine.take_kv_events()
        ]

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
                # prompt (or embedded) tokens computed: cache hits are not
                "prompt_tokens_total": self._engine.engine.throughput.prompt_total,
                "kv_cache_bytes": s.kv_cache_bytes,
                "weight_bytes": s.weight_bytes,
                "spec_decode_num_drafts": s.num_drafts,
                "spec_decode_num_draft_tokens": s.num_draft_tokens,
                "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
                **{
                    name: getattr(s, name)
                    for tier in kv_tiers_on(self._engine.engine.config)
                    for name in KV_TIER_STATS[tier]
                },
                **{
                    name: getattr(s, name)
                    for name in KV_TRANSFER_STATS
                    if self._engine.engine.config.kv_transfer
                },
                # flat records: asdict's deep copy cost the router 5 us a tenant a request
                "tenants": {tenant: vars(share).copy() for tenant, share in s.tenants.items()},
                "adapters_loaded": list(s.adapters_loaded),
                "lora_loads": s.lora_loads,
                # a vision model's encoder cache: images found, images encoded
                **(
                    {
                        "encoder_cache_hits": s.encoder_cache_hits,
                        "encoder_cache_misses": s.encoder_cache_misses,
                    }
                    if self._vision() is not None
                    else {}
                ),
            },
        )
