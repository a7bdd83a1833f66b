"""Adapter: the gateway's Backend protocol over HTTP, to an engine in another process or
on another host: a `kvgate worker`, or any OpenAI-compatible server (llama-cpp-python's
server, llama.cpp's llama-server, vLLM, SGLang).

    [[backends]]
    name = "gpu0"
    type = "remote"
    model = "gemma-3-270m"            # the id clients use
    options.url = "http://10.0.0.5:8001/v1"   # or options.urls = [...]: a replica each

The URL alone is enough: what the upstream does not tell is discovered at start
(remote_discovery.py: its model id, context length and tokenizer endpoint) and logged;
where it tells nothing, prompts go as text and quotas are reserved from a bound
(remote_text.py). The options, each winning over what is discovered, and their
defaults are remote_options.py's.
`kvgate worker` (gateway/worker/) serves the other side of this HTTP contract.

A worker renders, generates and reports its prefix cache natively (engine_api records
over HTTP), so it routes by prefix like an in-process replica; a vision model's worker
takes a chat's images as the files the gateway decoded (remote_images.py). A
third-party upstream takes them where its entry says `vision = true` (remote_vision.py:
data URLs to its /v1/chat/completions, `image_tokens` reserved per image), else an image
is a 400 naming the entry. A third-party upstream
gets streamed /v1/completions (a text-bound chat: /v1/chat/completions); its
`block_hashes` and `kv_events` come from a record of the prompts this gateway sent it
(remote_sent.py: approximate prefix routing).

LoRA adapters: a worker's engine loads them (the request carries the adapter's name and
path; check_adapter and remove_adapter are its /kvgate/v1/adapters calls). A third-party
upstream (vLLM, SGLang) serves adapters it loaded itself: the gateway's adapter's path is
the upstream's name for it, sent as the request's `model`, and nothing is checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

from engine_api.errors import BackendError, BadRequestError
from engine_api.images import ImageInput
from engine_api.records import (
    EMBED,
    GENERATE,
    AdapterRef,
    BackendStats,
    EmbedRequest,
    EmbedResult,
    GenChunk,
    GenRequest,
    KVEvent,
    ModelCard,
    Progress,
    PromptInput,
)
from engine_api.structured import StructuredOutput
from gateway.backends.common import (
    check_model,
    decode_off_loop,
    has_images,
    refuse_images,
    render_off_loop,
)
from gateway.backends.kv_transfer import BOTH
from gateway.backends.remote_discovery import ASSUMED_CONTEXT_LENGTH, LLAMA_SERVER, VLLM
from gateway.backends.remote_embed import embed_upstream, task_option
from gateway.backends.remote_health import Monitor
from gateway.backends.remote_http import (
    Endpoint,
    UpstreamClient,
    UpstreamUnreachable,
    within_deadlines,
)
from gateway.backends.remote_openai import (
    completion_chunks,
    open_completion,
    open_text_completion,
    unconstrained_upstream,
)
from gateway.backends.remote_options import RemoteOptions, replica_specs
from gateway.backends.remote_sent import SentBlocks
from gateway.backends.remote_text import IMAGES_MARK, carried_prompt, marked, text_bound
from gateway.backends.remote_tokenize import count as count_upstream
from gateway.backends.remote_tokenize import detokenize as upstream_detokenize
from gateway.backends.remote_tokenize import tokenize as upstream_tokenize
from gateway.backends.remote_tokenizer import RemoteTokenizer, load_tokenizer
from gateway.backends.remote_vision import image_chat, open_image_chat
from gateway.backends.remote_worker import check_adapter as worker_check_adapter
from gateway.backends.remote_worker import remove_adapter as worker_remove_adapter
from gateway.backends.remote_worker import worker_block_hashes, worker_stream
from gateway.backends.spec import BackendSpec

log = logging.getLogger("kvgate.remote")
COUNT_READ_S = 5.0  # at most this (or read_timeout_s) for /tokenize to count output


def build_replicas(spec: BackendSpec) -> list[RemoteBackend]:
    """The entry's adapters, one per upstream URL, each knowing the others."""
    replicas = [RemoteBackend(s) for s in replica_specs(spec)]
    for r in replicas:
        r.siblings = [other for other in replicas if other is not r]
    return replicas


class RemoteBackend:
    def __init__(self, spec: BackendSpec) -> None:
        self.opts = RemoteOptions.parse(spec)
        self.model_id = spec.served_model_name or spec.model
        if not self.model_id:
            raise ValueError(f"remote backend {spec.name!r} needs `model`: the id clients use")
        self._default_model = spec.model or self.model_id  # the upstream's id, unless told
        self._task = None if self.opts.task is None else task_option(spec.name, self.opts.task)
        endpoint = Endpoint.parse(self.opts.url)
        # the address in the name: gateways sharing a database keep apart catalog rows
        self.name = f"{spec.name}@{endpoint.host}:{endpoint.port}"
        self.label = f"remote backend {spec.name!r}"  # for clients: no address
        self.client = UpstreamClient(
            endpoint,
            self.label,
            self.opts.api_key,
            self.opts.connect_timeout_s,
            self.opts.read_timeout_s,
            self.opts.max_response_bytes,
        )
        self.monitor = Monitor(
            self.client,
            self.name,
            self._default_model,
            self.opts.health_interval_s,
            lambda: self._inflight,
            self.opts.upstream_model,
            spec.options,
        )
        self.sent = SentBlocks(self.name)  # third-party upstreams: what went where
        self.tokenizer: RemoteTokenizer | None = None
        self.max_in_flight = self.opts.max_in_flight
        self._inflight = 0  # this gateway's requests on this replica now
        self._takes_ids: bool | None = None  # a third-party upstream takes token ids?
        self._started = False
        self.siblings: list[RemoteBackend] = []  # the entry's other replicas

    @property
    def upstream_model(self) -> str:
        """The upstream's id of the model: as discovered (remote_discovery.pick_entry)."""
        info = self.monitor.info
        return info.model if info else self.opts.upstream_model or self._default_model

    async def start(self) -> None:
        """After the first health check when the context length is configured, else once
        the upstream tells what it is; either way within start_timeout_s. One that does
        not answer in time is down, not broken: the watch keeps trying, and /health and
        its model's 503s say why until it answers."""
        if self._started:
            return
        await self.client.start()
        try:
            if self.opts.tokenizer:
                self.tokenizer = await self._load_tokenizer(self.opts.tokenizer)
            self.monitor.start()
            await self._wait_for_upstream()
        except BaseException:
            await self.monitor.stop()
            await self.client.close()
            raise
        self._started = True

    async def _load_tokenizer(self, path: str) -> RemoteTokenizer:
        try:
            return await asyncio.to_thread(load_tokenizer, path)
        except (OSError, ValueError) as e:
            raise BackendError(f"{self.label}: cannot load tokenizer {path!r}: {e}") from e

    async def _wait_for_upstream(self) -> None:
        """Until the upstream tells what it is (with the context length configured: until
        the first check ends), up to start_timeout_s; one still down is logged, one that
        refused the gateway (its api_key, a model it does not serve) fails the start."""
        m = self.monitor
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.opts.start_timeout_s):
                await m.checked.wait()
                if not (m.refused or self.opts.context_length):
                    await m.discovered.wait()
        if not m.healthy and m.refused:  # it answered: the entry is wrong, not the upstream down
            raise BackendError(m.reason)
        if not m.healthy:
            log.warning(
                "%s: %s is down (%s); serving its model once it answers",
                *(self.name, self.opts.url, m.reason),
            )

    async def stop(self, drain: bool = True) -> None:
        while drain and self._inflight:
            await asyncio.sleep(0.05)
        await self.monitor.stop()
        await self.client.close()
        self._started = False

    def _context_length(self) -> int | None:
        """Configured, else told by the upstream, else assumed (once it has answered)."""
        info = self.monitor.info
        if self.opts.context_length or info is None:
            return self.opts.context_length
        return info.context_length or ASSUMED_CONTEXT_LENGTH

    @property
    def task(self) -> str:
        """options.task, else what the upstream's /v1/models says (a kvgate worker's),
        else generate (vLLM's and llama-server's lists do not say)."""
        info = self.monitor.info
        return self._task or (info.task if info is not None and info.task else GENERATE)

    def models(self) -> list[ModelCard]:
        # an embedding upstream judges `dimensions` itself: the gateway passes it on
        truncatable = self.task == EMBED
        card = ModelCard(self.model_id, self.name, self._context_length() or 0)
        vision = self._vision  # a worker's vision model, or an upstream's by options.vision
        return [dataclasses.replace(card, task=self.task, truncatable=truncatable, vision=vision)]

    @property
    def _vision(self) -> bool:
        info = self.monitor.info
        if info is not None and info.worker is not None:
            return info.vision
        return self.opts.vision

    @property
    def image_refusal(self) -> str | None:
        """Why this replica's model takes no images, where its entry could say it does."""
        if self._vision or self._is_worker:
            return None
        return f"{self.label} is not marked as taking them (its options.vision)"

    @property
    def role(self) -> str:
        """prefill | decode | both: options.role, else what the worker says it is."""
        info = self.monitor.info
        worker = info.worker if info is not None else None
        return self.opts.role or (worker.role if worker is not None else BOTH)

    @property
    def kv_url(self) -> str:
        """Where a decode worker pulls this prefill worker's blocks from (its root)."""
        return self.client.endpoint.root

    @property
    def _is_worker(self) -> bool:
        return self.monitor.info is not None and self.monitor.info.worker is not None

    @property
    def text_bound(self) -> bool:
        """A third-party upstream that cannot render chats into token ids for the gateway
        (no options.tokenizer, no vLLM-shaped /tokenize): prompts go as text, quotas are
        reserved from a bound (remote_text.py)."""
        info = self.monitor.info
        return (
            self.tokenizer is None
            and info is not None
            and info.worker is None
            and info.found.tokenizer not in (VLLM, LLAMA_SERVER)
        )

    async def render(
        self, model: str, prompt: PromptInput, tools: list[dict] | None = None
    ) -> list[int]:
        return await self.render_chat(model, prompt, tools, {})

    def chat_template_info(self) -> tuple[str | None, list[str], str | None]:
        """ChatTemplateBackend: nothing to detect output parsers from, as a remote
        upstream parses its own replies (gateway.serving.parser_choice)."""
        return None, [], None

    async def render_chat(
        self, model: str, prompt: PromptInput, tools: list[dict] | None, kwargs: dict
    ) -> list[int]:
        """ChatTemplateBackend: `render`, with the chat template's variables (vLLM's and
        SGLang's chat_template_kwargs) sent where the upstream renders the chat (its
        /tokenize, /apply-template or /chat/completions, a kvgate worker's /tokenize), or
        rendered with here (options.tokenizer)."""
        check_model(model, self.model_id)
        if not self._vision:  # docs/apis.md: Images
            refuse_images(model, prompt)
        elif not self._is_worker and has_images(prompt):  # to its chat API (remote_vision)
            return image_chat(prompt, tools, kwargs, self.opts.image_tokens)
        if not prompt:
            raise BadRequestError("the prompt must be a string, token ids, or chat messages")
        if self.text_bound:
            return text_bound(prompt, tools, model, kwargs)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if not (isinstance(prompt, str) or all(isinstance(m, dict) for m in prompt)):
            raise BadRequestError("the prompt must be a string, token ids, or chat messages")
        if self.tokenizer is not None and not self._is_worker:
            tokenizer = self.tokenizer
            return await render_off_loop(lambda p: tokenizer.render(p, tools, kwargs), prompt)
        # the entry's replicas serve one model: if this one fails, another tokenizes
        replicas = [self, *(r for r in self.siblings if r.stats().healthy)]
        for replica in replicas[:-1]:
            with contextlib.suppress(BackendError):
                return await replica._tokenize(prompt, tools, kwargs)
        return await replicas[-1]._tokenize(prompt, tools, kwargs)

    async def _tokenize(
        self, prompt: str | list[dict[str, Any]], tools: list[dict] | None, kwargs: dict
    ) -> list[int]:
        """Through the upstream's tokenizer endpoint (remote_tokenize.py)."""
        info = self.monitor.info
        kind = info.found.tokenizer if info is not None and info.worker is None else VLLM
        try:
            return await upstream_tokenize(
                self.client,
                kind or VLLM,
                self.upstream_model,
                prompt,
                tools,
                self._is_worker,
                kwargs,
            )
        except BackendError as e:
            self._failed(e)
            raise

    async def detokenize(
        self, model: str, token_ids: list[int], skip_special_tokens: bool = False
    ) -> str:
        """With options.tokenizer where it renders too; else the upstream's /detokenize
        (vLLM's shape, which a worker serves). Special tokens stay, as in vLLM's; only a
        tokenizer here or a worker can skip them."""
        check_model(model, self.model_id)
        if self.tokenizer is not None and not self._is_worker:
            tok = self.tokenizer.tokenizer
            decode = functools.partial(tok.decode, skip_special_tokens=skip_special_tokens)
            return await decode_off_loop(decode, token_ids, range(len(tok)))
        if self.text_bound:
            text = carried_prompt(token_ids) if marked(token_ids) else None
            if not isinstance(text, str):
                raise BadRequestError(
                    f"the upstream of model {model!r} does not detokenize for the gateway"
                )
            return text
        if skip_special_tokens and not self._is_worker:  # vLLM's /detokenize keeps them
            raise BadRequestError(
                f"the upstream of model {model!r} cannot skip special tokens: its "
                "/detokenize keeps them (the entry's options.tokenizer would skip them)"
            )
        try:
            return await upstream_detokenize(
                self.client, self.upstream_model, token_ids, skip_special_tokens, self._is_worker
            )
        except BackendError as e:
            self._failed(e)
            raise

    async def check_structured(self, model: str, structured: StructuredOutput) -> None:
        """A worker's engine compiles the constraint when the request comes (a schema
        it cannot compile is a 400 then); a third-party upstream gets none."""
        check_model(model, self.model_id)
        if not self._is_worker:
            raise BadRequestError(unconstrained_upstream(model))

    async def generate(
        self, req: GenRequest, progress: Progress | None = None
    ) -> AsyncIterator[GenChunk]:
        """Errors before the first chunk (connect, 5xx, timeout, invalid JSON) let the
        gateway try another replica; closing this iterator closes the HTTP response,
        which aborts the request upstream. `progress`: a worker's count of the prompt it
        computed, asked for when the iterator closes early (remote_abort.py); a
        third-party upstream cannot say, so the whole prompt once its response began."""
        check_model(req.model, self.model_id)
        if self.monitor.info is None:
            raise BackendError(f"{self.label}: the upstream has not answered yet")
        upstream_req = dataclasses.replace(req, model=self.upstream_model)
        if req.adapter is not None and not self._is_worker:  # by its upstream name
            upstream_req = dataclasses.replace(req, model=req.adapter.path)
        self._inflight += 1
        self.monitor.progress()
        try:
            if self._is_worker:
                stream = worker_stream(self.client, upstream_req, progress)
            else:
                stream = self._completions(upstream_req, progress)
            opts = self.opts
            timed = within_deadlines(
                stream, self.label, opts.first_token_timeout_s, opts.request_timeout_s
            )
            async with contextlib.aclosing(timed):
                async for chunk in timed:
                    self.monitor.progress()
                    yield chunk
        except BackendError as e:
            self._failed(e)
            raise
        finally:
            self._inflight -= 1

    async def check_adapter(self, ref: AdapterRef) -> None:
        """LoraBackend: a worker's engine judges it; a third-party upstream is trusted to
        serve the adapter it was configured with."""
        if self._is_worker:
            await worker_check_adapter(self.client, ref)

    async def remove_adapter(self, name: str) -> None:
        if self._is_worker:
            await worker_remove_adapter(self.client, name)

    async def embed(self, req: EmbedRequest, progress: Progress | None = None) -> EmbedResult:
        """The upstream's /v1/embeddings (remote_embed.py), within first_token_timeout_s;
        `progress` as remote_embed says."""
        check_model(req.model, self.model_id)
        if self.monitor.info is None:
            raise BackendError(f"{self.label}: the upstream has not answered yet")
        upstream_req = dataclasses.replace(req, model=self.upstream_model)
        self._inflight += 1
        self.monitor.progress()
        try:
            timeout_s = self.opts.first_token_timeout_s
            return await embed_upstream(
                self.client, upstream_req, self._is_worker, timeout_s, progress
            )
        except BackendError as e:
            self._failed(e)
            raise
        finally:
            self._inflight -= 1

    async def count_prompt(self, model: str, token_ids: list[int]) -> int | None:
        check_model(model, self.model_id)
        if not (self.text_bound and marked(token_ids)) or token_ids[0] == IMAGES_MARK:
            return None  # an image chat's images: only the upstream counts them
        text = carried_prompt(token_ids)
        info = self.monitor.info
        kind = None if info is None else info.found.tokenizer
        if not isinstance(text, str) or kind is None:
            return None
        timeout_s = self.opts.connect_timeout_s + min(self.opts.read_timeout_s, COUNT_READ_S)
        # no overhead taken off: the BOS its tokenizer adds, its prompt has too
        return await count_upstream(self.client, kind, self.upstream_model, text, 0, timeout_s)

    async def count_output(self, model: str, text: str, local_only: bool) -> int | None:
        """Tokens in generated text: with options.tokenizer (off the loop), else, unless
        `local_only`, through the upstream's /tokenize; None where neither counts."""
        check_model(model, self.model_id)
        if self.tokenizer is not None:
            return await asyncio.to_thread(self.tokenizer.count, text)
        info = self.monitor.info
        kind = VLLM if info is None or info.worker else info.found.tokenizer
        if local_only or kind is None:
            return None
        overhead = info.found.count_overhead if info is not None else 0
        timeout_s = self.opts.connect_timeout_s + min(self.opts.read_timeout_s, COUNT_READ_S)
        return await count_upstream(
            self.client, kind, self.upstream_model, text, overhead, timeout_s
        )

    def _failed(self, e: BackendError) -> None:
        """A call failed: unreachable leaves the rotation now; anything else (dead, or
        only this request?) has the watch check at once."""
        self.monitor.check_now(down=str(e) if isinstance(e, UpstreamUnreachable) else None)

    async def _completions(
        self, req: GenRequest, progress: Progress | None
    ) -> AsyncIterator[GenChunk]:
        tok = self.tokenizer
        if tok is not None:  # else the upstream's own tokenizer judges (vLLM: a 400)
            req.sampling.check_vocab(len(tok.tokenizer))
        if req.images:  # an image chat (remote_vision.py)
            resp = await open_image_chat(self.client, req, req.model)
        elif self.text_bound and marked(req.prompt_token_ids):
            resp = await open_text_completion(self.client, req, req.model)
        else:  # req.model: the upstream's id (of the model, or of the adapter)
            resp, self._takes_ids = await open_completion(
                self.client, req, req.model, self._takes_ids, tok and tok.prompt_text
            )
        if progress is not None:  # it took the prompt: billed whole from here, as it
            progress.advance(len(req.prompt_token_ids))  # cannot tell what it computed
        # the upstream took the prompt: its blocks are likely in its cache now (an
        # adapter's are keyed apart upstream: not recorded)
        if req.adapter is None:
            hashes = self.sent.hashes(req.prompt_token_ids, req.cache_salt, req.shared_prefix_len)
            self.sent.record(hashes, req.cache_salt, req.shared_prefix_len)
        chunks = completion_chunks(self.client, resp, req.sampling.logprobs or 0)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    def block_hashes(
        self,
        token_ids: list[int],
        cache_salt: str | None,
        shared_prefix_len: int = 0,
        adapter: AdapterRef | None = None,
        images: list[ImageInput] | None = None,
    ) -> list[str]:
        """As the worker's engine keys its cache (under the adapter's chain root, an
        image's placeholder blocks keyed by its digest); for an upstream without events,
        as the record of what this gateway sent it keys its blocks (an adapter's prompts
        are not recorded: none is routed by it)."""
        info = self.monitor.info
        worker = info.worker if info else None
        if info is not None and worker is None:
            return [] if adapter else self.sent.hashes(token_ids, cache_salt, shared_prefix_len)
        if worker is None:
            return []
        return worker_block_hashes(
            worker, token_ids, cache_salt, shared_prefix_len, adapter, images
        )

    def kv_events(self) -> list[KVEvent]:
        return self.monitor.events.take() + self.sent.take()

    def stats(self) -> BackendStats:
        """What the watch last read, with this gateway's requests started since."""
        m = self.monitor
        healthy = self._started and m.healthy
        kind = "unknown" if m.info is None else "kvgate" if m.info.worker else "openai"
        extra: dict[str, Any] = {"url": self.opts.url, "upstream": kind}
        if not healthy:
            extra["error"] = m.reason
        if m.stats is None:
            return BackendStats(self.name, healthy, running=self._inflight, extra=extra)
        running = max(self._inflight, m.stats.running + self._inflight - m.inflight_at_poll)
        return dataclasses.replace(
            m.stats,
            name=self.name,  # the worker reports its own engine's name
            healthy=healthy and m.stats.healthy,
            running=running,
            extra=m.stats.extra | extra,
        )
