"""A finished Job's end: its billed counts, its usage row with the quota settlement that
commits with it, and the metrics, prefix catalog and dashboard that count it.

Apart from the Job (gateway.serving.job) because it runs once a request, after the last
chunk, with its own rules: what is billed (the backend's usage where a meter took it,
else the gateway's count, the tokenizer's where text came without ids), what a request
that ended early pays for its prompt, and the order of the row's commit and the counts.
`Job` inherits `JobFinish`, so `Job.finish` is as it was and a chunk's path (Job.events,
Job._account) goes through nothing of it; these methods read the Job's fields
(requests, meters, n, backend, price, reservation, span and the rest) and its token
properties (prompt_tokens, cached_tokens, image_tokens, ttft, tpot, _tell_rates).
"""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.backends import OutputCountingBackend
from gateway.backends.capabilities import supports
from gateway.observe.stats import Finished
from gateway.serving.metering import ChoiceMeter
from gateway.serving.traces import usage_attributes
from gateway.tenancy.usage import UsageRow

log = logging.getLogger("kvgate")


class JobFinish:
    """The Job's finish (`finish`) and what it needs; a base of `Job` only."""

    async def finish(
        self, status: int, finish_reason: str | None, error: str = "", delivered: bool = True
    ) -> None:
        """Commit the usage row, then settle quota and count. Safe to call once.
        `delivered` False: the client received none of the output (a whole response
        that failed), so none of it is billed."""
        assert not self.finished
        self.finished = True
        self.gw.router.release(self.backend)
        if self.adapter is not None:
            self.gw.adapters.release(self.adapter, served=self.first_token_at is not None)
        end = time.perf_counter()
        # Shielded: a client that goes away must not lose the row.
        if delivered and self._counts_to_await():  # all of it in a task: it awaits counts
            await asyncio.shield(self._count_then_record(status, finish_reason, error, end))
            return
        # the common case: the row is queued now and its commit awaited, with no task a
        # request (each a turn of the event loop and about 10 us)
        await asyncio.shield(self._record(status, finish_reason, error, delivered, end))

    async def _count_then_record(
        self, status: int, finish_reason: str | None, error: str, end: float
    ) -> None:
        counts = await self._count_tokens()
        await self._record(status, finish_reason, error, True, end, counts)

    def _record(
        self,
        status: int,
        finish_reason: str | None,
        error: str,
        delivered: bool,
        end: float,
        text_counts: dict[int, int | None] | None = None,
    ) -> asyncio.Future[None]:
        """The usage row queued; its future resolves once it is committed. The metrics and
        the dashboard count the request then, whether the commit worked or not."""
        prompt_tokens = 0
        try:
            if delivered:
                self._settle_meters(text_counts or {})
                prompt_tokens = self.prompt_tokens if status == 200 else self._prompt_computed()
            else:
                self.completion_tokens, self.cached_by_prompt = 0, {}
            row = self._usage_row(status, finish_reason, prompt_tokens, end)
            if self.span is not None:
                self.span.set_attributes(
                    usage_attributes(
                        self.request_id,
                        prompt_tokens,
                        self.completion_tokens,
                        self.cached_tokens,
                        self.ttft,
                        finish_reason,
                    )
                )
            committed = self.gw.usage.submit(row)
        except BaseException:
            self._count(status, prompt_tokens, end, error)
            raise

        def done(f: asyncio.Future[None]) -> None:
            if not f.cancelled() and f.exception() is None:
                self.gw.metrics.billed(self.principal.tenant_name, self.model, row.spend_nano_usd)
            self._count(status, prompt_tokens, end, error)

        committed.add_done_callback(done)
        return committed

    def _usage_row(
        self, status: int, finish_reason: str | None, prompt_tokens: int, end: float
    ) -> UsageRow:
        """The request's row, with its spend and the quota settlement that commits with it."""
        gw, p, ttft = self.gw, self.principal, self.ttft
        spend = self.price.spend(prompt_tokens, self.cached_tokens, self.completion_tokens)
        # settled with the row: in memory at once, on PostgreSQL in the row's commit
        settlement = gw.quota.settlement(
            self.reservation,
            prompt_tokens + self.completion_tokens,
            # a batch line is no request of the tenant's rate (rpm): given back
            count_request=status not in (503,) and self.batch is None,
            used_spend=spend,
        )
        return UsageRow(
            request_id=self.request_id,
            tenant_id=p.tenant_id or "",
            key_id=p.key_id,
            model=self.model,
            prompt_tokens=prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            ttft_ms=None if ttft is None else ttft * 1000,
            latency_ms=(end - self.started) * 1000,
            status=status,
            finish_reason=finish_reason,
            user=self.user,
            counted_by=self.counted_by,
            spend_nano_usd=spend,
            batch_id=self.batch[0] if self.batch else None,
            custom_id=self.batch[1] if self.batch else None,
            image_tokens=self.image_tokens,
            settlement=settlement,
        )

    def _count(self, status: int, prompt_tokens: int, end: float, error: str) -> None:
        """The finished request in the metrics, the prefix catalog and the dashboard."""
        gw, p, ttft, tpot = self.gw, self.principal, self.ttft, self.tpot
        m, tenant, model = gw.metrics, p.tenant_name, self.model
        m.child(m.requests, tenant, model, str(status)).inc()
        m.child(m.prompt_tokens, tenant, model).inc(prompt_tokens)
        m.child(m.generation_tokens, tenant, model).inc(self.completion_tokens)
        m.child(m.prefix_queries, tenant, model).inc(prompt_tokens)
        if self.cached_tokens:
            m.child(m.cached_tokens, tenant, model).inc(self.cached_tokens)
        if images := self.image_tokens:
            m.child(m.image_tokens, tenant, model).inc(images)
        if self.block_hashes and self.cached_by_prompt.get(0):
            gw.catalog.drain([self.backend])  # the blocks it hit may be just stored
            hits = self.cached_by_prompt[0]
            gw.catalog.record_hits(self.backend.name, self.block_hashes, hits)
        if ttft is not None:
            m.child(m.ttft, model).observe(ttft)
        if tpot is not None:
            m.child(m.tpot, model).observe(tpot)
        m.child(m.e2e, model).observe(end - self.started)
        done = Finished(
            time.time(), prompt_tokens, self.completion_tokens, ttft, tpot, end - self.started
        )
        gw.traffic.request_finished(p.tenant_id or "", tenant, done, ok=status == 200)
        if status >= 500:
            gw.traffic.error(tenant, self.model, status, error)

    def _counts_to_await(self) -> bool:
        """Whether settling needs the tokenizer's counts (_count_tokens), which may await
        the upstream: a text-bound prompt without the backend's usage, or text that came
        without token ids, from a backend that counts them."""
        return supports(self.backend, OutputCountingBackend) and any(
            meter.text or (index % self.n == 0 and meter.prompt_bound and meter.claim is None)
            for index, meter in enumerate(self.meters)
        )

    async def _count_tokens(self) -> dict[int, int | None]:
        """The tokenizer's counts the meters need: each text-bound prompt's (into its
        meter), and each choice's text without token ids (returned, by choice)."""
        texts = {}
        for index, meter in enumerate(self.meters):
            if index % self.n == 0 and meter.prompt_bound and meter.claim is None:
                meter.prompt_counted = await self._count_prompt(index)
            texts[index] = await self._count_text(meter)
        return texts

    def _settle_meters(self, text_counts: dict[int, int | None]) -> None:
        """Each choice's completion tokens and each prompt's cached tokens, as billed:
        the backend's usage where its meter took it, else the gateway's own count (with
        the model's tokenizer for text that came without token ids: `text_counts`)."""
        total, cached, counters = 0, {}, set()
        for index, meter in enumerate(self.meters):
            tokens, counter = meter.billed(text_counts.get(index))
            total += tokens
            counters.add(counter)
            cached.setdefault(index // self.n, meter.cached)
        for prompt, on_prefill in (self.prefill_cached or {}).items():
            # as without disaggregation: the blocks found cached where the prompt ran
            cached[prompt] = max(cached.get(prompt, 0), on_prefill)
        self.completion_tokens, self.cached_by_prompt = total, cached
        self._tell_rates(time.perf_counter())  # what is left, as billed
        self.counted_by = "gateway" if "gateway" in counters else "engine"

    def _prompt_computed(self) -> int:
        """The prompt tokens of a request that ended before its answer did (a client that
        left, a drain's cut, a failure): per prompt, what its engines computed (its
        choices' replica, a prefill worker it went to first; all of it once one of its
        choices had output: its prefill was done), the cached tokens within that; none
        for a prompt no engine took. What was not computed is not cached for the next
        request either."""
        total = 0
        for prompt in range(len(self.requests) // self.n):
            first = prompt * self.n
            meters = self.meters[first : first + self.n]
            whole = meters[0].prompt if meters else len(self.requests[first].prompt_token_ids)
            taken = [m.progress for m in meters]
            if prompt in self.prefill_progress:
                taken.append(self.prefill_progress[prompt])
            computed = max((p.tokens for p in taken), default=0)
            if any(m.delivered for m in meters):
                computed = whole
            computed = min(computed, whole)
            cached = max([self.cached_by_prompt.get(prompt, 0), *(p.cached for p in taken)])
            self.cached_by_prompt[prompt] = min(cached, computed)
            total += computed
        return total

    async def _count_prompt(self, index: int) -> int | None:
        """A text-bound prompt the backend sent no usage for: its tokens by the upstream's
        tokenizer where it can count them (else the bound stands)."""
        if not supports(self.backend, OutputCountingBackend):
            return None
        try:
            req = self.requests[index]  # its model: the replica's (an adapter's base)
            return await self.backend.count_prompt(req.model, req.prompt_token_ids)
        except Exception:  # the bound stands; the row must still be written
            log.exception("request %s: counting its prompt failed", self.request_id)
            return None

    async def _count_text(self, meter: ChoiceMeter) -> int | None:
        """The tokenizer's count of the text the choice delivered without token ids; the
        upstream's /tokenize against its own usage only where that usage looks off."""
        if not meter.text or not supports(self.backend, OutputCountingBackend):
            return None
        try:
            return await self.backend.count_output(
                self.requests[0].model, "".join(meter.text), local_only=meter.plausible()
            )
        except Exception:  # the meter's own count stands; the row must still be written
            log.exception("request %s: counting its output failed", self.request_id)
            return None
