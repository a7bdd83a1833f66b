"""What the two in-process engine adapters (gpu, llama.cpp) share: starting the engine
on the configured or default model, rendering and decoding with its tokenizer off the
event loop when large, compiling structured outputs, and turning its outputs into
GenChunks (prompt-sized ones off the loop). Each adapter says only what differs: how
to start its engine, where its tokenizer and template are, how its outputs read, and
its stats. Written once so that a fix to one path cannot miss the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from engine_api.errors import BackendError, BadRequestError, LoraDisabledError
from engine_api.records import (
    AdapterRef,
    GenChunk,
    GenRequest,
    ModelCard,
    Progress,
    PromptInput,
    Usage,
)
from engine_api.structured import StructuredOutput
from gateway.backends.common import (
    check_model,
    check_options,
    decode_off_loop,
    named_logprob,
    refuse_images,
    render_off_loop,
    render_prompt,
    served_model_id,
)
from gateway.backends.default_model import default_model_path, model_path, packaged_sampling
from gateway.backends.spec import BackendSpec

E = TypeVar("E")  # the engine


@dataclass(frozen=True)
class Tokenization:
    """How an engine's model turns text into ids: for render_prompt."""

    encode: Callable[[str, bool], list[int]]  # (text, add_bos) -> ids
    chat_template: str | None
    architecture: str
    bos_token: str
    eos_token: str
    architectures: tuple[str, ...] = ()  # the model config's (HF's), for gateway.parsers.detect
    model_type: str | None = None


@dataclass(frozen=True)
class Output:
    """One engine output in the adapters' common terms (ids and text new since the last;
    logprobs as the engine gives them: token ids, named here)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[Any] | None
    prompt_logprobs: list[Any | None] | None
    stop_sequence: str | None = None  # the stop string that ended the request


class InProcessBackend(ABC, Generic[E]):
    kind: str  # "gpu" | "local": how messages name the backend
    engine_options: tuple[str, ...]

    def __init__(self, spec: BackendSpec) -> None:
        check_options(spec, self.engine_options)
        self.name = spec.name
        self.spec = spec
        self.model_id = served_model_id(spec)
        self._engine: E | None = None
        self._sampling: dict[str, float] = {}  # the card's sampling_defaults

    async def start(self) -> None:
        if self._engine is not None:
            return
        if self.spec.model:
            path = await asyncio.to_thread(model_path, self.spec.model)
        else:
            path = str(await asyncio.to_thread(default_model_path))
        self._engine = await self._start_engine(path)
        own = self._model_sampling(path) | packaged_sampling(self.spec.model)
        self._sampling = own | self.spec.generation_config

    @abstractmethod
    async def _start_engine(self, path: str) -> E:
        """The engine on the model at `path`; BackendError naming the backend if it
        cannot start."""

    @property
    def engine(self) -> E:
        if self._engine is None:
            raise BackendError(f"{self.kind} backend {self.name!r} is not running")
        return self._engine

    def models(self) -> list[ModelCard]:
        length = self._context_length() if self._engine is not None else 0
        fields = self._card_fields() if self._engine is not None else {}
        card = ModelCard(self.model_id, self.name, length, **fields)
        card.sampling_defaults = self._sampling
        return [card]

    def _card_fields(self) -> dict[str, Any]:
        """The model card's fields beyond its id and context length (what an embedding
        model's card says)."""
        return {}

    def _model_sampling(self, path: str) -> dict[str, float]:
        """The sampling defaults the model at `path` carries (gateway.backends.
        generation_config), read once at start."""
        return {}

    @abstractmethod
    def _context_length(self) -> int: ...

    @abstractmethod
    def _tokenization(self) -> Tokenization: ...

    @abstractmethod
    def _decoder(self, skip_special_tokens: bool) -> tuple[Callable[[list[int]], str], range]:
        """The engine's decode of ids to text (special tokens as text, or left out), and
        the ids it knows."""

    @abstractmethod
    def _token_text(self) -> Callable[[int], str]:
        """One token's text, for logprobs."""

    async def check_adapter(self, ref: AdapterRef) -> None:
        """LoraBackend: the engine checks the adapter against its model; an engine started
        without LoRA is a BadRequestError saying how to turn it on, as the gateway and a
        `kvgate worker` take it (the engine knows neither's flags)."""
        try:
            await self._check_adapter(ref)
        except LoraDisabledError:
            raise BadRequestError(
                f"the {self.kind} backend {self.name!r} of {self.model_id!r} was started "
                "without LoRA: start it with --enable-lora, or set enable_lora = true in the "
                "config file ([server], or the backend's [[backends]] entry)"
            ) from None

    @abstractmethod
    async def _check_adapter(self, ref: AdapterRef) -> None:
        """The engine's check of adapter `ref` against its model (BadRequestError)."""

    @abstractmethod
    def _stream(self, req: GenRequest, progress: Progress | None) -> AsyncIterator[Any]:
        """The engine's outputs for `req`; closing it aborts the request (and returns
        once `progress` holds all the engine computed)."""

    @abstractmethod
    def _output(self, out: Any, req: GenRequest) -> Output: ...

    async def render(
        self, model: str, prompt: PromptInput, tools: list[dict] | None = None
    ) -> list[int]:
        return await self.render_chat(model, prompt, tools, {})

    async def render_chat(
        self,
        model: str,
        prompt: PromptInput,
        tools: list[dict] | None,
        kwargs: dict,
        expand: Callable[[str], str] | None = None,
    ) -> list[int]:
        """ChatTemplateBackend: `render` with the template's extra variables. Images
        are refused unless the model's card says it takes them (`vision`), in which case
        the adapter renders them itself (`expand`: its change to the template's text
        before the tokenizer, as the model's processor writes an image there)."""
        check_model(model, self.model_id)
        if not self.models()[0].vision:
            refuse_images(model, prompt)
        t = self._tokenization()
        encode = t.encode if expand is None else (lambda text, bos: t.encode(expand(text), bos))
        return await render_off_loop(
            lambda p: render_prompt(
                p,
                encode,
                t.chat_template,
                t.architecture,
                bos_token=t.bos_token,
                eos_token=t.eos_token,
                tools=tools,
                template_kwargs=kwargs,
            ),
            prompt,
        )

    def chat_template_info(self) -> tuple[str | None, list[str], str | None]:
        """ChatTemplateBackend: what the output parsers are detected from."""
        t = self._tokenization()
        return t.chat_template, list(t.architectures), t.model_type

    async def detokenize(
        self, model: str, token_ids: list[int], skip_special_tokens: bool = False
    ) -> str:
        check_model(model, self.model_id)
        decode, known = self._decoder(skip_special_tokens)
        return await decode_off_loop(decode, token_ids, known)

    async def check_structured(self, model: str, structured: StructuredOutput) -> None:
        check_model(model, self.model_id)
        await self.engine.check_structured(structured)  # type: ignore[attr-defined]

    async def generate(
        self, req: GenRequest, progress: Progress | None = None
    ) -> AsyncIterator[GenChunk]:
        """BadRequestError (400) comes from the engine before the first chunk; an
        EngineDeadError (a BackendError, 503) at any chunk."""
        check_model(req.model, self.model_id)
        stream = self._stream(req, progress)
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for out in stream:
                output = self._output(out, req)
                if output.prompt_logprobs is None:
                    yield self._chunk(output)
                else:  # a prompt's worth of token texts: off the event loop
                    yield await asyncio.to_thread(self._chunk, output)

    def _chunk(self, out: Output) -> GenChunk:
        # a prompt's logprobs name the same few tokens many times
        as_text = functools.partial(named_logprob, functools.cache(self._token_text()))
        logprobs = None if out.logprobs is None else [as_text(lp) for lp in out.logprobs]
        prompt_logprobs = None
        if out.prompt_logprobs is not None:  # the first output only; None for the first token
            prompt_logprobs = [None if lp is None else as_text(lp) for lp in out.prompt_logprobs]
        return GenChunk(
            out.token_ids,
            out.text,
            out.finish_reason,
            out.usage,
            logprobs,
            prompt_logprobs,
            out.stop_sequence,
        )
