"""Fair share between tenants: the Virtual Token Counter (VTC) of Sheng et al., "Fairness
in Serving Large Language Models" (OSDI 2024), so that one tenant's flood does not put
every other tenant behind it.

Each tenant has a counter: the cost of the service its requests received, each request's
cost divided by that request's weight. Within a priority, the scheduler admits the first
waiting request of the backlogged tenant (one with a waiting request) whose counter is
least; ties go to the tenant admitted least recently. If that request does not fit, no
one else is admitted that step (head of line, as under first come first served), so a
flood of small requests cannot overtake a fair one. Running requests are ordered by
(priority, counter, arrival): the least-served get the token budget first and the
most-served of the lowest priority are preempted first.

Cost: PROMPT_TOKEN_COST per prompt token computed and CACHED_TOKEN_COST per prompt token
found in the prefix cache, charged when a request is first admitted; OUTPUT_TOKEN_COST
per output token, charged as it is emitted (the counters trail by at most one step).
Recomputing a preempted request is the engine's choice and costs its tenant nothing.

Lift: when a tenant becomes backlogged (its first waiting request after none, by
arrival or preemption), its counter rises to at least the least counter of the other
backlogged tenants, or, when none is backlogged, to the virtual time (the largest counter
an admitted tenant had when chosen): time spent idle, or served while no one else was
waiting, banks no credit beyond U (below). Counters never go down.

Bound, when every waiting request has one priority: two backlogged tenants' counters
differ by at most U = (PROMPT_TOKEN_COST * longest prompt + OUTPUT_TOKEN_COST *
(max_num_seqs + 1) * largest max_tokens) / least weight (the scheduler keeps one seat
beyond max_num_seqs for a tenant becoming active). A tenant is admitted only while its
counter is the least (and the least never falls, as lifts start no one below it); after
that only what it was then admitted with (one prompt, the outputs still to come of at most
max_num_seqs + 1 running requests) can raise it. So over any time both stay backlogged their
weighted services differ by at most 2U, the form of the paper's bound with this engine's
U (the paper reserves KV for whole outputs, this engine preempts instead). A single
tenant is scheduled exactly as first come, first served.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from backend_gpu.sequence import Sequence

PROMPT_TOKEN_COST = 1.0
# a cached token's KV is read, not computed (DLPM and Equinox discount it too; 0.1 is ours)
CACHED_TOKEN_COST = 0.1
OUTPUT_TOKEN_COST = 1.0


@dataclass
class TenantStats:
    """One tenant's share, as the engine's stats report it."""

    weight: float  # of its latest request
    service: float  # cost served (the constants above), unweighted, never lifted
    counter: float  # the VTC counter: weighted service plus lifts; the scheduler's key
    waiting: int
    running: int


class _Tenant:
    __slots__ = (
        "weight",
        "service",
        "counter",
        "waiting",
        "running",
        "last_admitted",
        "newcomer",
    )

    def __init__(self) -> None:
        self.weight = 1.0
        self.service = 0.0
        self.counter = 0.0
        self.waiting = 0
        self.running = 0
        self.last_admitted = -1  # admission tick
        self.newcomer = False  # may take the spare seat (Ledger.is_newcomer)


class Ledger:
    """Every tenant's counter and queue lengths. The scheduler reports each move of a
    request (waits, admitted, preempted, finished) and each output emitted."""

    def __init__(self) -> None:
        self.tenants: dict[str, _Tenant] = {}
        self.virtual_time = 0.0
        self._ticks = itertools.count()
        # the tenants with a waiting request: a newcomer's lift looks at these alone, not
        # at every tenant the engine has served since it started
        self._backlogged: set[_Tenant] = set()
        # the last shares reported and the tenants changed since: the engine reports its
        # stats after every step, and rebuilding every tenant's share each time cost a
        # step more with each tenant ever seen
        self._shares: dict[str, TenantStats] = {}
        self._changed: set[str] = set()

    def _get(self, seq: Sequence) -> _Tenant:
        tenant = self.tenants.get(seq.tenant_id)
        if tenant is None:
            tenant = self.tenants[seq.tenant_id] = _Tenant()
        return tenant

    def _change(self, seq: Sequence) -> _Tenant:
        """`seq`'s tenant, to be changed (stats reports it anew)."""
        self._changed.add(seq.tenant_id)
        return self._get(seq)

    def counter(self, seq: Sequence) -> float:
        return self._get(seq).counter

    def is_newcomer(self, seq: Sequence) -> bool:
        """Whether `seq`'s tenant arrived with nothing waiting or running, not ahead of
        the others' counters, and has not been admitted since (the scheduler keeps a
        spare seat for it)."""
        return self._get(seq).newcomer

    def waits(self, seq: Sequence, arriving: bool = True) -> None:
        """`seq` joins the waiting queue (on arrival, or preempted)."""
        tenant = self._change(seq)
        tenant.weight = seq.weight
        if tenant.waiting == 0:
            backlogged = [t.counter for t in self._backlogged]
            floor = min(backlogged) if backlogged else self.virtual_time
            # the spare seat is for one not ahead of the others: a tenant that keeps
            # coming back with one request at a time cannot ride it past its share
            idle = arriving and tenant.running == 0
            tenant.newcomer = idle and tenant.counter <= floor
            tenant.counter = max(tenant.counter, floor)
            self._backlogged.add(tenant)
        tenant.waiting += 1

    def admitted(self, seq: Sequence) -> None:
        """`seq` left the waiting queue to run; its prompt is charged the first time."""
        tenant = self._change(seq)
        self._leaves_queue(tenant)
        tenant.running += 1
        tenant.last_admitted = next(self._ticks)
        tenant.newcomer = False
        self.virtual_time = max(self.virtual_time, tenant.counter)
        if not seq.prompt_charged:
            seq.prompt_charged = True
            cached = seq.num_cached_tokens
            computed = seq.num_prompt_tokens - cached
            self._charge(tenant, seq, computed * PROMPT_TOKEN_COST + cached * CACHED_TOKEN_COST)

    def preempted(self, seq: Sequence) -> None:
        self._change(seq).running -= 1
        self.waits(seq, arriving=False)

    def finished(self, seq: Sequence, was_running: bool) -> None:
        self.charge_outputs(seq)
        tenant = self._change(seq)
        if was_running:
            tenant.running -= 1
        else:
            self._leaves_queue(tenant)

    def _leaves_queue(self, tenant: _Tenant) -> None:
        tenant.waiting -= 1
        if tenant.waiting == 0:
            self._backlogged.discard(tenant)

    def charge_outputs(self, seq: Sequence) -> None:
        """Charge the output tokens `seq` emitted since the last call."""
        new = seq.num_output_tokens - seq.num_outputs_charged
        if new > 0:
            seq.num_outputs_charged += new
            self._charge(self._change(seq), seq, new * OUTPUT_TOKEN_COST)

    def _charge(self, tenant: _Tenant, seq: Sequence, cost: float) -> None:
        tenant.service += cost
        tenant.counter += cost / seq.weight

    def stats(self) -> dict[str, TenantStats]:
        """Every tenant's share, a new dict each call (another thread may hold the last
        one): a tenant unchanged since the last call keeps its TenantStats object."""
        for name in self._changed:
            t = self.tenants[name]
            self._shares[name] = TenantStats(t.weight, t.service, t.counter, t.waiting, t.running)
        self._changed.clear()
        return dict(self._shares)


def _insert_first(queue: deque[Sequence], seq: Sequence) -> None:
    """A preempted request goes first among its priority's, never ahead of a better one
    (a request preempted for a better priority's must not take its seat straight back)."""
    i = 0
    while i < len(queue) and queue[i].priority < seq.priority:
        i += 1
    queue.insert(i, seq)


def _insert(queue: deque[Sequence], seq: Sequence) -> None:
    """By priority, first come first served within one priority."""
    key = seq.sort_key()
    i = len(queue)
    while i > 0 and queue[i - 1].sort_key() > key:
        i -= 1
    queue.insert(i, seq)


class FcfsQueue:
    """All waiting requests in one line: by priority, then arrival; preempted in front
    of their priority's."""

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)

    def add(self, seq: Sequence) -> None:
        _insert(self._queue, seq)

    def push_front(self, seq: Sequence) -> None:
        _insert_first(self._queue, seq)

    def peek(self) -> Sequence | None:
        return self._queue[0] if self._queue else None

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)


class VtcQueue:
    """One line per tenant, as FcfsQueue orders it; the next request is the head of the
    least-served tenant's line among those at the best priority."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._queues: dict[str, deque[Sequence]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Sequence]:
        """Every queued request, a tenant's line at a time (not in admission order)."""
        return (seq for queue in self._queues.values() for seq in queue)

    def add(self, seq: Sequence) -> None:
        _insert(self._queues.setdefault(seq.tenant_id, deque()), seq)
        self._len += 1

    def push_front(self, seq: Sequence) -> None:
        _insert_first(self._queues.setdefault(seq.tenant_id, deque()), seq)
        self._len += 1

    def peek(self) -> Sequence | None:
        best, best_key = None, None
        for queue in self._queues.values():
            head = queue[0]
            tenant = self._ledger.tenants[head.tenant_id]
            key = (head.priority, tenant.counter, tenant.last_admitted, head.arrival)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def remove(self, seq: Sequence) -> None:
        queue = self._queues[seq.tenant_id]
        queue.remove(seq)
        if not queue:
            del self._queues[seq.tenant_id]
        self._len -= 1
