"""Decides, each step, which requests run and how many of their tokens.

There is one token budget per step. A request only has `num_computed_tokens` chasing
`len(token_ids)`: a prompt is a run of tokens to compute (in chunks when it does not
fit the budget), a decode is one token to compute, so both share one batch. When the
KV pool runs dry the lowest-priority running request is preempted: its blocks are freed
and it is computed again later (its full blocks are likely still in the prefix cache).
A waiting request of a better priority than a running one does not wait for it: when the
sequence limit or the KV pool keeps it out, the worst running request of a worse
priority is preempted for it (vLLM's priority scheduling cannot displace a running
request when the sequence limit binds, its issue 40004); batch work yields this way.

Within a priority, tenants share by the Virtual Token Counter (backend_gpu.fairness):
which waiting request goes next, which running one gets the budget first and which is
preempted depend on how much each tenant was served. `fairness="fcfs"` (and the static
policy) serve first come, first served instead. Under VTC one seat beyond max_num_seqs
is kept for a tenant becoming active, so a newcomer does not wait for a seat.

A vision model whose image tokens attend to each other (Gemma 3) has an image's tokens
computed in one step: a chunk ends before an image it would cut, and a sequence whose
next image does not fit what is left of the budget waits for a step with room (the
engine refuses a budget below one image).

A request under a LoRA adapter is admitted only with a device slot for its adapter
(`adapters`, backend_gpu.lora's manager): a slot is pinned while a running sequence
uses it, so a step never holds more distinct adapters than there are slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from backend_gpu.block_manager import BlockManager
from backend_gpu.config import EngineConfig
from backend_gpu.fairness import FcfsQueue, Ledger, TenantStats, VtcQueue
from backend_gpu.prompt_logprobs import PromptSpan, prompt_spans
from backend_gpu.sequence import Sequence, SequenceStatus
from engine_api.records import AdapterRef


class AdapterSlots(Protocol):
    """The LoRA manager's side the scheduler uses (backend_gpu.lora.LoRAManager)."""

    def acquire(self, ref: AdapterRef) -> int | None: ...

    def release(self, slot: int) -> None: ...


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence, tokens computed this step
    # rows whose logits score prompt tokens for prompt logprobs (backend_gpu.prompt_logprobs)
    prompt_spans: list[PromptSpan] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


def _whole_images(seq: Sequence, start: int, num_new: int) -> int:
    """`num_new` tokens from index `start`, or fewer: a chunk never ends inside an image
    whose tokens see each other (Gemma 3's; backend_gpu.multimodal); 0: not this step."""
    if seq.images is None:
        return num_new
    return seq.images.chunk_end(start, start + num_new) - start


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        adapters: AdapterSlots | None = None,
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.static = config.scheduling_policy == "static"
        self.block_manager = block_manager
        self.adapters = adapters
        # counted under either policy, so that fcfs reports the shares it gives too
        self.ledger = Ledger()
        self.fair = config.fairness == "vtc" and not self.static
        self.waiting: FcfsQueue | VtcQueue = VtcQueue(self.ledger) if self.fair else FcfsQueue()
        self.running: list[Sequence] = []
        self.static_batch: set[str] = set()  # static policy: the batch being run
        self.num_preemptions = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue by priority, first come first served within one priority (and tenant)."""
        self.ledger.waits(seq)
        self.waiting.add(seq)

    def tenant_stats(self) -> dict[str, TenantStats]:
        return self.ledger.stats()

    def schedule(self) -> ScheduledBatch:
        for seq in self.running:  # what the last step emitted counts before choosing
            self.ledger.charge_outputs(seq)
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        if not self.static:
            self._displace_for_priority(budget)
        budget = self._schedule_running(batch, budget)
        if self.static and not self.running:
            self._form_static_batch()
        self._schedule_waiting(batch, budget)
        batch.prompt_spans = prompt_spans(batch.seqs, batch.num_new_tokens)
        return batch

    def _form_static_batch(self) -> None:
        """The next batch: the first waiting requests whose whole lengths fit the pool
        together; newcomers wait until all of them finish."""
        bm = self.block_manager
        self.static_batch.clear()
        free = bm.num_free_blocks
        for seq in list(self.waiting)[: self.max_num_seqs]:
            need = bm.blocks_needed(seq.num_prompt_tokens + seq.params.max_tokens)
            if need > free and self.static_batch:
                break
            free -= need
            self.static_batch.add(seq.request_id)

    def _running_key(self, seq: Sequence) -> tuple:
        """Lower runs first and is preempted last."""
        if not self.fair:
            return seq.sort_key()
        return (seq.priority, self.ledger.counter(seq), seq.arrival)

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        bm = self.block_manager
        self.running.sort(key=self._running_key)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = len(seq) - seq.num_computed_tokens
            assert num_new > 0
            # proposed tokens ride along with a decode, as far as the budget allows
            if num_new > 1:
                seq.spec_token_ids = []
            del seq.spec_token_ids[budget - 1 :]
            num_new = min(num_new + len(seq.spec_token_ids), budget)
            num_new = _whole_images(seq, seq.num_computed_tokens, num_new)
            if num_new == 0:  # its next image waits for a budget that takes it whole
                i += 1
                continue
            while not bm.can_append_slots(seq, num_new):
                if seq.spec_token_ids:  # drop the guesses before preempting anyone
                    num_new -= len(seq.spec_token_ids)
                    seq.spec_token_ids = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                bm.append_slots(seq, num_new)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
                continue
            break  # seq itself was preempted: everything after it is gone too
        return budget

    def _displace_for_priority(self, budget: int) -> None:
        """Preempt running requests of a worse priority than the next waiting one while
        the sequence limit or the KV pool keeps that one out."""
        head = self.waiting.peek()
        while head is not None and self.running:
            victim = max(self.running, key=self._running_key)
            if victim.priority <= head.priority:
                return
            seated = len(self.running) < self.max_num_seqs + self._spare_seats(head)
            if seated and self._fits(head, budget) is not None:
                return
            self.running.remove(victim)
            self._preempt(victim)

    def _fits(self, seq: Sequence, budget: int) -> tuple[list, list, int] | None:
        """Its cached blocks, lower-tier hits and tokens to compute this step, if the KV
        pool (and, without chunked prefill, the budget) takes it now; else None."""
        bm = self.block_manager
        cached = bm.find_cached_blocks(seq)
        lower = bm.find_lower_tier_hits(seq, cached)
        num_new = len(seq) - (len(cached) + len(lower)) * bm.block_size
        if not self.chunked_prefill and num_new > budget:
            return None
        start = (len(cached) + len(lower)) * bm.block_size
        num_new = _whole_images(seq, start, min(num_new, budget))
        if num_new == 0 or not bm.can_allocate(seq, cached, num_new, lower):
            return None
        return cached, lower, num_new

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0:
            seq = self.waiting.peek()
            assert seq is not None
            if len(self.running) >= self.max_num_seqs + self._spare_seats(seq):
                break
            if self.static and seq.request_id not in self.static_batch:
                break
            fits = self._fits(seq, budget)
            if fits is None:
                break
            cached, lower, num_new = fits
            if not self._take_adapter_slot(seq):
                break
            self.waiting.remove(seq)
            bm.allocate(seq, cached, lower)
            bm.append_slots(seq, num_new)
            self.ledger.admitted(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new

    def _spare_seats(self, seq: Sequence) -> int:
        """Under VTC one seat beyond max_num_seqs is kept for a tenant becoming active:
        its first request starts at the next step instead of waiting for a flooding
        tenant's request to end. Its other requests wait for ordinary seats, so
        weights still divide the service."""
        return int(self.fair and self.ledger.is_newcomer(seq))

    def _take_adapter_slot(self, seq: Sequence) -> bool:
        """Pin a slot holding `seq`'s adapter (none needed without one); False while its
        weights are not at hand or every slot is pinned by other adapters."""
        if seq.adapter is None:
            return True
        assert self.adapters is not None  # the engine refuses adapters without LoRA
        slot = self.adapters.acquire(seq.adapter)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _release_adapter_slot(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            assert self.adapters is not None
            self.adapters.release(seq.lora_slot)
            seq.lora_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self._release_adapter_slot(seq)
        self.block_manager.free(seq)
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.ledger.preempted(seq)
        self.waiting.push_front(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish or abort a sequence wherever it is and give its blocks back."""
        if seq.status is SequenceStatus.RUNNING:
            self._release_adapter_slot(seq)
            self.running.remove(seq)
            self.ledger.finished(seq, was_running=True)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.ledger.finished(seq, was_running=False)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
