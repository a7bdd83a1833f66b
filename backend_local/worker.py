"""The decode loop. One thread owns the llama context; nothing else ever touches it.

Each step: take new requests and aborts from the inbox, give free sequences to waiting
requests (reusing cached prefixes), then build one llama_batch holding the next token of
every generating sequence followed by prompt chunks of the prefilling ones (up to n_batch
tokens), decode it, and sample each sequence that produced logits with its own sampler
(outputs.py). A request with prompt logprobs gets logits for every prompt token instead
of the last.
With a disk tier (kv_disk_tier.py) a prompt's prefix is restored from disk when the
cells hold less of it, and saved there once computed. With LoRA adapters a step decodes
the sequences of one adapter only, the adapters' groups taking turns (lora_groups.py).
A prompt's images (a model with a vision projector, vision.py) are prefilled one at a
time into their sequence before the step's batch, which then carries the text after them.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import llama_cpp

from backend_local.config import EngineConfig
from backend_local.context_thread import ContextThread
from backend_local.errors import DecodeError
from backend_local.grammar import GrammarMask
from backend_local.kv_disk_tier import DiskTier
from backend_local.lora import AdapterCache
from backend_local.lora_groups import LoraGroups
from backend_local.model import LlamaModel
from backend_local.outputs import sample, score_prompt
from backend_local.prefix_blocks import BLOCK_SIZE, BlockLedger, block_hashes
from backend_local.requests import Request, RequestOutput
from backend_local.sampling import build_sampler, logit_bias_arrays
from backend_local.slots import Placement, Slot, place
from backend_local.stats import EngineStats
from backend_local.text_stream import TextStream
from backend_local.vision import Vision
from engine_api.errors import BadRequestError, EngineDeadError
from engine_api.throughput import Throughput

log = logging.getLogger(__name__)

# Prompt tokens with logits (prompt logprobs) per decode step. llama.cpp computes the
# n_vocab-wide output layer for each and keeps a logits buffer as large as the largest
# step's (1 MiB a row for Gemma 3's 262k vocabulary), and each row's log-softmax holds
# up the other sequences: 64 rows cost less than a full prompt batch does.
PROMPT_LOGPROBS_ROWS = 64


class Worker(ContextThread[Request]):
    def __init__(self, model: LlamaModel, config: EngineConfig, vision: Vision | None) -> None:
        super().__init__("llama-worker")
        self.model = model
        self.config = config
        self.vision = vision
        self.ctx = model.new_context(config)
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(config.n_batch, 0, 1)
        self.slots = [Slot(i) for i in range(config.n_parallel)]
        self.waiting: deque[Request] = deque()
        self.throughput = Throughput()
        self.prefix_query_tokens = 0
        self.prefix_reused_tokens = 0
        self.ledger = BlockLedger() if config.enable_kv_events else None
        self.grammar_mask = GrammarMask(model.n_vocab)
        self.disk = DiskTier(model, config, self.ctx) if config.kv_disk_path else None
        self.adapters = AdapterCache(model, self.ctx, config.max_loras)
        self.lora = LoraGroups(self.adapters) if config.enable_lora else None
        self._removals: set[str] = set()  # adapters to free once no sequence runs them

    def stats(self) -> EngineStats:
        busy = [s for s in self.slots if s.request is not None]
        prompt_rate, gen_rate = self.throughput.rates()
        return EngineStats(
            healthy=self.alive,
            n_parallel=len(self.slots),
            busy=len(busy),
            free=len(self.slots) - len(busy),
            waiting=len(self.waiting) + len(self._inbox),
            n_ctx=self.config.n_ctx,
            kv_cells_busy=sum(len(s.cached) for s in busy),
            prompt_tokens_total=self.throughput.prompt_total,
            gen_tokens_total=self.throughput.gen_total,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_reused_tokens=self.prefix_reused_tokens,
            prompt_tokens_per_s=prompt_rate,
            gen_tokens_per_s=gen_rate,
            **(self.disk.stats() if self.disk is not None else {}),
            adapters_loaded=self.adapters.names(),
            lora_loads=self.adapters.loads,
        )

    def remove_adapter(self, name: str) -> None:
        """Free the adapter `name` (and the cells computed under it) once no running
        request uses it; a later request naming it loads it again."""
        with self._cond:
            self._removals.add(name)
            self._cond.notify()

    # -- the worker thread ---------------------------------------------------------------

    def _close(self, orphans: list[Request], dead: EngineDeadError) -> None:
        with self._cond:
            orphans += self.waiting
            self.waiting.clear()
        for slot in self.slots:
            if slot.request is not None:
                self._fail(slot, dead)
            else:  # the context goes, and with it the blocks this slot kept
                self._drop_cells(slot)
        for request in orphans:
            request.emit(dead)
        if self.disk is not None:
            self.disk.close()
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        self.adapters.close()

    def _has_work(self) -> bool:
        return bool(self.waiting) or any(s.request is not None for s in self.slots)

    def _step(self) -> bool:
        """One decode step; False when the loop should end."""
        with self._cond:
            # (a removal waits only for a running request, so it never spins here)
            while not (
                self._inbox or self._aborts or self._stopping or self._has_work() or self._removals
            ):
                self._cond.wait()
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, set()
            removals, self._removals = self._removals, set()
            stopping, drain = self._stopping, self._drain
        if stopping and not drain:
            aborts |= {r.request_id for r in self.waiting}
            aborts |= {s.request.request_id for s in self.slots if s.request is not None}
        self._apply_aborts(aborts)
        if removals:
            self._remove_adapters(removals)
        if stopping and not self._has_work():
            return False
        self._admit()
        self._decode_step()
        if self.lora is not None:  # past max_loras, the adapters no request runs under
            self.lora.trim(self.slots)
        return True

    def _apply_aborts(self, request_ids: set[str]) -> None:
        if not request_ids:
            return
        for slot in self.slots:
            if slot.request is not None and slot.request.request_id in request_ids:
                self._release(slot, RequestOutput(slot.request.request_id, [], "", "abort"))
        for request in [r for r in self.waiting if r.request_id in request_ids]:
            self.waiting.remove(request)
            request.emit(
                RequestOutput(request.request_id, [], "", "abort", len(request.prompt), 0, 0)
            )

    def _admit(self) -> None:
        copied: set[int] = set()  # sequences whose streams a copy reads at the next decode
        while self.waiting and any(s.request is None for s in self.slots):
            request = self.waiting.popleft()
            if self.lora is not None and not self.lora.load(request):
                continue
            # prompt logprobs need the logits of every prompt position: no cached cells
            scored = request.params.prompt_logprobs is not None
            salt, shared, adapter = request.cache_salt, request.shared_prefix_len, request.adapter
            placement = place(
                self.slots, request.prompt, salt, shared, not scored, adapter, request.spans
            )
            slot = placement.slot
            hashes = []  # the prompt's block hashes, for the disk tier (never with images)
            if self.disk is not None and not scored and not request.spans:
                hashes = self.disk.prefix_hashes(request.prompt, salt, shared, adapter)
            reuse = self._take_prefix(placement, hashes, copied)
            self._plan_save(slot, hashes, reuse)
            slot.cached = request.prompt[:reuse]
            slot.salt = request.cache_salt
            slot.adapter = adapter
            slot.shared_len = request.shared_prefix_len
            slot.spans = request.spans
            self._sync_blocks(slot)
            slot.request = request
            slot.sampler = build_sampler(request.params, self.model.n_vocab)
            slot.logit_bias = logit_bias_arrays(request.params)
            slot.grammar = request.grammar
            slot.stream = TextStream(request.params.stop)
            slot.output_ids = []
            slot.next_token = None
            slot.reused = reuse
            if request.progress is not None:
                request.progress.advance(reuse, reuse)
            slot.prompt_logprobs = [None] if scored else None
            if not scored:  # as in vLLM, a request that skips the cache does not query it
                self.prefix_query_tokens += len(request.prompt)
            self.prefix_reused_tokens += reuse

    def _remove_adapters(self, names: set[str]) -> None:
        for name in names:
            idle = self.lora.remove(name, self.slots) if self.lora is not None else []
            if idle is None:  # a request runs under it: again at a later step
                with self._cond:
                    self._removals.add(name)
                continue
            for slot in idle:
                self._drop_cells(slot)

    def _take_prefix(self, placement: Placement, hashes: list[bytes], copied: set[int]) -> int:
        """Leave the placement's slot holding the longest prefix it can have, from the
        disk tier when that holds a longer one than the cells do; its length."""
        slot = placement.slot
        found = self.disk.candidates(hashes, placement.reuse) if hashes else []
        # (a stream another slot copies from must keep its data until the next decode)
        if found and slot.seq_id not in copied:
            llama_cpp.llama_memory_seq_rm(self.mem, slot.seq_id, -1, -1)
            restored = self.disk.restore(slot.seq_id, found)
            if restored:
                # a state past the sliding window holds only that window's cells
                cut = llama_cpp.llama_memory_seq_pos_min(self.mem, slot.seq_id) > 0
                slot.floor = restored if cut else 0
                return restored
            if placement.source is slot:  # its cells went with the failed load
                placement = Placement(slot, None, 0)
        floor = placement.source.floor if placement.source is not None else 0
        reuse = self._load_prefix(placement, copied)
        slot.floor = floor if reuse else 0
        return reuse

    def _plan_save(self, slot: Slot, hashes: list[bytes], reuse: int) -> None:
        """Have the slot's state saved when its prefill reaches the prompt's last whole
        block, if that is still ahead and not stored yet."""
        at = len(hashes) * BLOCK_SIZE
        wanted = reuse < at and self.disk.wants(hashes[-1])
        slot.save_at, slot.save_key = (at, hashes[-1]) if wanted else (0, None)

    def _load_prefix(self, placement: Placement, copied: set[int]) -> int:
        """Leave the placement's slot holding just the reused prefix; its length."""
        slot, reuse = placement.slot, placement.reuse
        if placement.source is slot:
            if not llama_cpp.llama_memory_seq_rm(self.mem, slot.seq_id, reuse, -1):
                reuse = 0  # this memory cannot cut a sequence short: start over
                llama_cpp.llama_memory_seq_rm(self.mem, slot.seq_id, -1, -1)
        elif placement.source is not None:
            # Each sequence has its own stream, and llama.cpp copies between streams
            # only whole (the data moves at the next decode): copy, then cut the tail.
            src = placement.source.seq_id
            llama_cpp.llama_memory_seq_cp(self.mem, src, slot.seq_id, -1, -1)
            copied.add(src)
            llama_cpp.llama_memory_seq_rm(self.mem, slot.seq_id, reuse, -1)
            # a prefix others copy from (a published one) is in use: evict it last
            placement.source.last_used = time.monotonic()
        else:
            llama_cpp.llama_memory_seq_rm(self.mem, slot.seq_id, -1, -1)
        return reuse

    def _add(self, n: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
        b = self.batch
        b.token[n] = token
        b.pos[n] = pos
        b.n_seq_id[n] = 1
        b.seq_id[n][0] = seq_id
        b.logits[n] = logits

    def _add_prompt_chunk(self, slot: Slot, n: int) -> list[int]:
        """Add the slot's next prompt tokens to the batch from entry `n` on, as many as fit;
        those tokens. Only the prompt's last token needs logits (they give the first output
        token), but every one does for prompt logprobs, in fewer rows at a time."""
        prompt, start = slot.request.prompt, len(slot.cached)
        every_row = slot.prompt_logprobs is not None
        room = self.config.n_batch - n
        end = start + (min(room, PROMPT_LOGPROBS_ROWS) if every_row else room)
        # an image ends a chunk: it is prefilled by itself (_prefill_images)
        end = min([end, *(s for s, _, _ in slot.spans if s >= start)])
        # a state to save ends a chunk: it must hold exactly its prefix
        chunk = prompt[start : min(end, slot.save_at) if start < slot.save_at else end]
        for i, token in enumerate(chunk):
            pos = start + i
            self._add(n + i, token, pos, slot.seq_id, every_row or pos == len(prompt) - 1)
        return chunk

    def _decode_step(self) -> None:
        busy = [s for s in self.slots if s.request is not None]
        if not busy:
            return
        if self.lora is not None:
            busy = self.lora.this_turn(busy)
        for slot in [s for s in busy if s.prefilling and s.request.images]:
            self._prefill_images(slot)
        busy = [s for s in busy if s.request is not None]  # an image may have failed one
        n = 0
        added: list[tuple[Slot, list[int]]] = []
        outputs: list[tuple[Slot, int]] = []  # slot, batch index of its logits
        for slot in busy:
            if slot.next_token is not None:
                self._add(n, slot.next_token, len(slot.cached), slot.seq_id, True)
                added.append((slot, [slot.next_token]))
                outputs.append((slot, n))
                n += 1
        n_gen = n
        scored: list[tuple[Slot, int, int, int]] = []  # slot, batch index, position, rows
        # Oldest prompts first, so a long prompt cannot starve the ones behind it forever.
        for slot in sorted((s for s in busy if s.prefilling), key=lambda s: s.request.arrival):
            if n == self.config.n_batch:
                break
            start = len(slot.cached)
            chunk = self._add_prompt_chunk(slot, n)
            added.append((slot, chunk))
            if slot.prompt_logprobs is not None:
                scored.append((slot, n, start, len(chunk)))
            n += len(chunk)
            if start + len(chunk) == len(slot.request.prompt):
                outputs.append((slot, n - 1))
        if n == 0:
            return
        self.batch.n_tokens = n
        rc = llama_cpp.llama_decode(self.ctx, self.batch)
        if rc != 0:
            error = DecodeError(f"llama_decode failed with status {rc} for a batch of {n} tokens")
            for slot, _ in added:
                self._fail(slot, error)
            return
        for slot, tokens in added:
            slot.cached.extend(tokens)
            slot.next_token = None
            assert len(slot.cached) <= self.config.n_ctx_per_seq
            if len(slot.cached) == slot.save_at:
                self.disk.save(slot.seq_id, slot.save_key)
                slot.save_at, slot.save_key = 0, None
            prompt = slot.request.prompt
            if len(slot.cached) <= len(prompt):  # a prompt chunk, never a decode
                if slot.request.progress is not None:
                    slot.request.progress.advance(len(slot.cached), slot.reused)
                if len(slot.cached) == len(prompt):  # its prompt is all in cells
                    self._sync_blocks(slot)
        self.throughput.record(n - n_gen, len(outputs))
        for slot, index, start, count in scored:
            score_prompt(self.ctx, self.model.n_vocab, slot, index, start, count)
        for slot, index in outputs:
            self._sample(slot, index)

    def _prefill_images(self, slot: Slot) -> None:
        """The images next in the slot's prompt prefilled (Vision.prefill_next); a
        failure ends its request (its cells are dropped)."""
        try:
            self.vision.prefill_next(self.ctx, slot, self.config.n_batch, self.throughput)
        except (BadRequestError, DecodeError) as exc:
            self._fail(slot, exc)

    def _sample(self, slot: Slot, index: int) -> None:
        output = sample(self.ctx, self.model, self.grammar_mask, slot, index)
        if output.finish_reason is None:
            slot.next_token = output.token_ids[0]
            slot.request.emit(output)
        else:
            self._release(slot, output)

    def _release(self, slot: Slot, last: RequestOutput) -> None:
        """End the slot's request with `last`; the slot keeps its cells for prefix reuse."""
        request = slot.request
        last.prompt_tokens = len(request.prompt)
        last.completion_tokens = len(slot.output_ids)
        last.cached_tokens = slot.reused
        last.image_tokens = sum(end - start for start, end, _ in request.spans)
        self._clear(slot)
        self._sync_blocks(slot)
        request.emit(last)

    def _fail(self, slot: Slot, error: BaseException) -> None:
        """End the slot's request with an error; its cells are dropped (they may be partial)."""
        request = slot.request
        self._clear(slot)
        self._drop_cells(slot)
        request.emit(error)

    def _drop_cells(self, slot: Slot) -> None:
        llama_cpp.llama_memory_seq_rm(self.mem, slot.seq_id, -1, -1)
        slot.cached = []
        slot.spans = []
        slot.floor = 0
        self._sync_blocks(slot)

    def _sync_blocks(self, slot: Slot) -> None:
        """Report the slot's full blocks of cached tokens as they are now."""
        if self.ledger is None:
            return
        blocks = block_hashes(slot.cached, slot.salt, slot.shared_len, slot.adapter, slot.spans)
        self.ledger.replace(slot.blocks, blocks, slot.salt, slot.shared_len)
        slot.blocks = blocks

    def _clear(self, slot: Slot) -> None:
        if slot.sampler is not None:
            llama_cpp.llama_sampler_free(slot.sampler)
        slot.request = None
        slot.sampler = None
        slot.logit_bias = None
        slot.grammar = None
        slot.stream = None
        slot.next_token = None
        slot.prompt_logprobs = None
        slot.last_used = time.monotonic()
