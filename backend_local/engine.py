"""The asyncio face of the llama.cpp backend.

    engine = LocalEngine(EngineConfig("model.gguf", n_parallel=4))
    req = GenRequest("req-1", "", engine.tokenize("Hello"), SamplingParams())
    async for out in engine.generate(req):
        print(out.text, end="")
    engine.shutdown()

Closing a `generate` iterator early (or cancelling the task reading it) aborts the request:
the worker frees its sequence before its next decode step.

With `EngineConfig(enable_lora=True)` a request may name a GGUF LoRA adapter
(`GenRequest.adapter`, backend_local.lora): loaded on demand, checked ahead by
`check_adapter`, freed by `remove_adapter`.

With `EngineConfig(task="embed")` the engine embeds instead (an EmbedWorker owns the
context): `await engine.embed(EmbedRequest(...))`; `generate` is a BadRequestError.

With `EngineConfig(mmproj=...)` (a vision projector GGUF) a request may carry images
(`GenRequest.images`, each where a run of `engine.vision.placeholder` ids stands in its
prompt: `engine.vision.tokenize` makes such prompts from text); backend_local.vision.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from backend_local.config import EngineConfig
from backend_local.embed_worker import EmbedJob, EmbedWorker
from backend_local.grammar import llama_grammar_cache
from backend_local.model import LlamaModel
from backend_local.prefix_blocks import BlockEvent
from backend_local.requests import Request, RequestOutput
from backend_local.stats import EngineStats
from backend_local.vision import Vision
from backend_local.worker import Worker
from engine_api.block_hash import KeySpan, image_key_spans
from engine_api.errors import BadRequestError, LoraDisabledError, PromptTooLongError
from engine_api.records import AdapterRef, EmbedRequest, EmbedResult, GenRequest, Progress
from engine_api.sampling import SamplingParams
from engine_api.structured import StructuredOutput

NOT_A_GENERATOR = "this is an embedding model: it embeds text and does not generate it"
NO_LORA = "this engine serves no LoRA adapters (enable_lora is off)"
# An embed request of more tokens than this is checked in a worker thread: 2048 inputs of
# thousands of ids each would stall the event loop for seconds.
LARGE_EMBED_TOKENS = 1 << 16


class LocalEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model = LlamaModel(config.model_path, verbose=config.verbose)
        self.pooling: str | None = None  # an embedding engine's pooling
        self.vision: Vision | None = None  # the model's vision projector (mmproj)
        try:
            if config.task == "embed":
                self.pooling = config.pooling or self.model.own_pooling() or "mean"
                self._worker: Worker | EmbedWorker = EmbedWorker(self.model, config, self.pooling)
            else:
                if config.mmproj is not None:
                    self.vision = Vision(self.model, config.mmproj, config.n_threads)
                self._worker = Worker(self.model, config, self.vision)
        except BaseException:
            self._close()
            raise
        self._active: set[str] = set()
        self.grammars = llama_grammar_cache(self.model)
        self._worker.start()

    @property
    def context_length(self) -> int:
        """The most tokens (prompt plus completion) one request may hold."""
        return self.config.n_ctx_per_seq

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        return self.model.tokenize(text, add_special, parse_special)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The ids' text; special tokens (a chat's turn markers) as their text unless
        `skip_special_tokens`, as a transformers tokenizer's decode."""
        return self.model.detokenize(token_ids, special=not skip_special_tokens)

    def check_request(
        self, prompt_token_ids: list[int], params: SamplingParams, shared_prefix_len: int = 0
    ) -> None:
        """Raise BadRequestError (a ValueError; PromptTooLongError for size) if the request
        can never be served."""
        params.validate()
        if not prompt_token_ids:
            raise BadRequestError("the prompt is empty")
        if not 0 <= shared_prefix_len <= len(prompt_token_ids):
            raise BadRequestError(
                f"shared_prefix_len must be in [0, {len(prompt_token_ids)}], "
                f"got {shared_prefix_len}"
            )
        params.check_vocab(self.model.n_vocab)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model.n_vocab]
        if bad:
            raise BadRequestError(
                f"token ids out of the vocabulary (size {self.model.n_vocab}): {bad[:5]}"
            )
        if len(prompt_token_ids) + params.max_tokens > self.context_length:
            raise PromptTooLongError(len(prompt_token_ids), params.max_tokens, self.context_length)

    async def check_structured(self, structured: StructuredOutput) -> None:
        """Compile a structured output ahead of its request, in a worker thread;
        BadRequestError if it cannot be. The request finds it compiled."""
        await asyncio.to_thread(self.grammars.compile, structured)

    async def generate(
        self, req: GenRequest, progress: Progress | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has finish_reason and usage set.
        `progress` hears how much of the prompt is in cells (reused cells as cached);
        leaving early returns once the worker has applied the abort, after the decode in
        flight (whose cells it keeps): `progress` then holds all it computed.

        Cached cells are reused under the same `req.cache_salt`; under another salt only
        within the first `req.shared_prefix_len` prompt tokens (a published prefix) when
        the cells' request marked them as shared too.

        Raises BadRequestError / PromptTooLongError for requests that cannot be served,
        EngineDeadError when the worker is gone, DecodeError if llama.cpp fails on it.
        """
        if self.pooling is not None:
            raise BadRequestError(NOT_A_GENERATOR)
        request_id, params, shared_prefix_len = req.request_id, req.sampling, req.shared_prefix_len
        self.check_request(req.prompt_token_ids, params, shared_prefix_len)
        if req.adapter is not None and not self.config.enable_lora:
            raise BadRequestError(NO_LORA)
        if request_id in self._active:
            raise BadRequestError(f"request id {request_id!r} is already running")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def emit(item: RequestOutput | BaseException) -> None:
            # RuntimeError: the caller's loop is closed, nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, item)

        request = Request(
            request_id, list(req.prompt_token_ids), params, req.cache_salt, emit, shared_prefix_len
        )
        request.adapter = req.adapter
        request.progress = progress
        request.images, request.spans = req.images, self._image_spans(req)
        if params.structured is not None:  # compiled before the worker sees it
            request.grammar = self.grammars.matcher(params.structured)
        self._worker.submit(request)
        self._active.add(request_id)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._active.discard(request_id)
            if not finished:
                self._worker.abort(request_id)
                await _ended(queue)

    def _image_spans(self, req: GenRequest) -> list[KeySpan]:
        """Where the request's images lie in its prompt, keyed by their digests; a
        BadRequestError where this engine cannot take them."""
        if not req.images:
            return []
        if self.vision is None:
            raise BadRequestError("this model takes no images (its engine has no mmproj)")
        if req.adapter is not None or req.sampling.prompt_logprobs is not None:
            raise BadRequestError(
                "images are not served with a LoRA adapter or prompt_logprobs on this engine"
            )
        if any(not image.rgb for image in req.images):
            raise BadRequestError("an image reached the engine without its pixels")
        spans = image_key_spans(
            req.prompt_token_ids, self.vision.placeholder, [image.digest for image in req.images]
        )
        if spans[-1][1] == len(req.prompt_token_ids):
            raise BadRequestError("the prompt must end in text after its last image")
        return spans

    def check_embed(self, req: EmbedRequest) -> None:
        """Raise BadRequestError (PromptTooLongError for an input past the context) if the
        request can never be embedded here."""
        if self.pooling is None:
            raise BadRequestError("this model generates text; it is not an embedding model")
        if not req.inputs:
            raise BadRequestError("input is empty: give at least one input to embed")
        for i, ids in enumerate(req.inputs):
            if not ids:
                raise BadRequestError(f"input {i} is empty: an input needs at least one token")
            if any(type(t) is not int or not 0 <= t < self.model.n_vocab for t in ids):
                raise BadRequestError(
                    f"input {i} has token ids outside the vocabulary [0, {self.model.n_vocab})"
                )
            if len(ids) > self.context_length:
                raise PromptTooLongError(len(ids), 0, self.context_length)
        if req.dimensions is not None:
            raise BadRequestError("this model's vectors are not made to be shortened (dimensions)")

    async def embed(self, req: EmbedRequest, progress: Progress | None = None) -> EmbedResult:
        """The inputs' pooled vectors (normalized if the config says so), in order;
        `progress` hears the tokens of the inputs embedded so far. Cancelling the caller
        drops the inputs not yet embedded, once the one in flight is (`progress` then
        holds all it embedded)."""
        if sum(len(ids) for ids in req.inputs) > LARGE_EMBED_TOKENS:
            await asyncio.to_thread(self.check_embed, req)
        else:
            self.check_embed(req)
        if req.request_id in self._active:
            raise BadRequestError(f"request id {req.request_id!r} is already running")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[list[float]]] = loop.create_future()
        ended = asyncio.Event()  # the worker is through with the job, however it ended

        def emit(item: list[list[float]] | BaseException | None) -> None:
            def settle() -> None:
                ended.set()
                if done.done() or item is None:  # the caller has gone
                    return
                if isinstance(item, BaseException):
                    done.set_exception(item)
                else:
                    done.set_result(item)

            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                loop.call_soon_threadsafe(settle)

        self._worker.submit(EmbedJob(req.request_id, req.inputs, emit, progress=progress))
        self._active.add(req.request_id)
        try:
            vectors = await done
        finally:
            self._active.discard(req.request_id)
            if not done.done() or done.cancelled():
                self._worker.abort(req.request_id)
                await ended.wait()
        return EmbedResult(vectors, sum(len(i) for i in req.inputs))

    def check_adapter(self, ref: AdapterRef) -> None:
        """Raise BadRequestError naming what is wrong with the adapter for this model (no
        such file, a PEFT directory, not a GGUF LoRA, another architecture, tensors that
        do not fit); blocking (it loads a copy): call it off the event loop."""
        if self.pooling is not None:
            raise BadRequestError(NOT_A_GENERATOR)
        if not self.config.enable_lora:
            raise LoraDisabledError(NO_LORA)
        self._worker.adapters.check(ref)

    def remove_adapter(self, name: str) -> None:
        """Free the adapter once no running request uses it; never blocks."""
        if self.config.enable_lora:
            self._worker.remove_adapter(name)

    def abort(self, request_id: str) -> None:
        self._worker.abort(request_id)

    def stats(self) -> EngineStats:
        return self._worker.stats()

    def take_kv_events(self) -> list[BlockEvent]:
        """Prefix blocks stored and removed since the last call (needs enable_kv_events;
        else always empty). Never blocks; the last events of a shut-down engine stay here."""
        ledger = self._worker.ledger
        return ledger.take_events() if ledger is not None else []

    @property
    def healthy(self) -> bool:
        return self._worker.alive

    def shutdown(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the worker (finishing running requests first if `drain`) and free the model."""
        if self._worker.stop(drain, timeout):
            self._close()

    def _close(self) -> None:
        if self.vision is not None:
            self.vision.close()
        self.model.close()

    async def stop(self, drain: bool = True) -> None:
        await asyncio.to_thread(self.shutdown, drain)


async def _ended(queue: asyncio.Queue[RequestOutput | BaseException]) -> None:
    """Until the worker's last word on an aborted request: its abort, its last output
    (it finished first) or the error that ended it. The worker says one on every path:
    an abort is applied between decodes, and a worker that stops or dies tells every
    request it holds."""
    while True:
        item = await queue.get()
        if isinstance(item, BaseException) or item.finish_reason is not None:
            return
