"""Model -> replica. The "prefix" policy sends a prompt to the replica that already holds
its leading blocks, unless that replica is much busier than another.

The rule, after SGLang's cache-aware router (cache_threshold, balance_abs_threshold,
balance_rel_threshold), with the catalog of KV events standing in for its radix tree:
  1. the best match: the replica holding the most leading blocks of the prompt, on its
     device or in the tiers under it (catalog.match_tiers: a block there is loaded back,
     not computed), then the most on its device, then the less loaded;
  2. it wins if it covers at least `cache_threshold` of the prompt's full blocks, unless
     its load (running + waiting) exceeds the least loaded replica's by more than
     `balance_abs` requests AND by more than `balance_rel` times: a long queue costs
     more than the prefill it would save;
  3. else the least loaded (then the longer match, then the longer one on the device,
     then least KV in use; equal replicas take turns).
A request under a LoRA adapter prefers the replicas that have it loaded
(BackendStats.extra["adapters_loaded"]), as llm-d routes by adapter: among equal matches
in 1, and in 3 the least loaded of them wins over the least loaded of all unless rule 2's
balance says it is overloaded (a load costs less than a long queue).
"round_robin" and "least_loaded" exist to measure the prefix policy against.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from gateway.backends import Backend, BackendError, BackendStats, ModelCard
from gateway.backends.kv_transfer import PREFILL, role_of
from gateway.config import ROUTER_POLICIES
from gateway.routing.catalog import PrefixCatalog

# why a replica was picked (the rules above)
ONLY_ONE = "the only healthy replica"
ROUND_ROBIN = "round robin"
LEAST_LOADED = "least loaded (no replica holds enough of the prompt)"
CACHED_PREFIX = "holds the longest cached prefix"
ADAPTER_LOADED = "has the adapter loaded"
OVERLOADED = "least loaded (the best match is overloaded)"


@dataclass(frozen=True)
class Candidate:
    """A healthy replica and the stats it was found healthy with."""

    backend: Backend
    stats: BackendStats


class Router:
    def __init__(
        self,
        backends: list[Backend],
        policy: str = "prefix",
        catalog: PrefixCatalog | None = None,
        cache_threshold: float = 0.5,
        balance_abs: int = 4,
        balance_rel: float = 1.5,
    ) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {ROUTER_POLICIES}, got {policy!r}")
        self.backends = backends
        self.policy = policy
        self.catalog = catalog
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.cards: dict[str, ModelCard] = {}
        self.serving: dict[str, list[Backend]] = {}
        self.broken: dict[str, str] = {}  # backend name -> why it is down
        # this gateway's requests per replica, from the pick to their end: a replica's
        # own stats see a request only once it reaches it (a remote one, later still),
        # and a burst picked in between must not all land on the replica that looked idle
        self.in_flight: dict[str, int] = {}
        # the same, per replica object: a reload that replaces a replica waits for the
        # requests on the old one, while its successor of the same name takes new ones
        self.holding: dict[int, int] = {}
        self._turn = itertools.count()  # round robin, and turns between equal replicas

    def add_models(self, backend: Backend) -> None:
        for card in backend.models():
            self.cards.setdefault(card.id, card)
            self.serving.setdefault(card.id, []).append(backend)

    def card(self, model: str) -> ModelCard | None:
        """The model's card. One without a context length yet (a remote upstream that
        was down at start tells it once it answers) is read again from its replicas."""
        card = self.cards.get(model)
        if card is not None and not card.context_length:
            for b in self.serving.get(model, []):
                if b.name not in self.broken:
                    fresh = [c for c in b.models() if c.id == model and c.context_length]
                    if fresh:
                        self.cards[model] = card = fresh[0]
                        break
        return card

    def candidates(self, model: str) -> list[Candidate]:
        """The healthy replicas serving `model`, each asked for its stats once;
        BackendError, with each replica's reason, when there is none."""
        healthy, reasons = [], []
        for b in self.serving.get(model, []):
            if role_of(b) == PREFILL:  # it takes prefill jobs only (serving/prefill_apart.py)
                continue
            if b.name in self.broken:
                reasons.append(self.broken[b.name])
            elif (s := b.stats()).healthy:
                healthy.append(Candidate(b, s))
            else:  # the adapter's own words for clients (a remote one names no address)
                reasons.append(str(s.extra.get("error") or f"backend {b.name} is unhealthy"))
        if not healthy:
            why = "; ".join(dict.fromkeys(reasons)) or "no healthy backend"
            raise BackendError(f"no backend can serve {model!r} right now ({why})")
        return healthy

    def prefill_replicas(self, model: str) -> list[Candidate]:
        """The healthy prefill-role replicas of `model`, each with its stats."""
        return [
            Candidate(b, s)
            for b in self.serving.get(model, [])
            if role_of(b) == PREFILL and b.name not in self.broken and (s := b.stats()).healthy
        ]

    def down(self, backends: list[Backend]) -> dict[str, str]:
        """Each of `backends` that cannot serve now, and why."""
        out = {}
        for b in backends:
            if b.name in self.broken:
                out[b.name] = self.broken[b.name]
            elif not (s := b.stats()).healthy:
                out[b.name] = str(s.extra.get("error") or "unhealthy")
        return out

    def pick(self, model: str, block_hashes: list[str] | None = None) -> Backend:
        """The replica for a prompt whose full blocks hash to `block_hashes`."""
        return self.pick_from(self.candidates(model), block_hashes or [])

    def pick_from(
        self, candidates: list[Candidate], block_hashes: list[str], adapter: str | None = None
    ) -> Backend:
        """Like `pick`, among candidates already read (a request reads them once to
        render its prompt, then picks by that prompt's blocks and its LoRA adapter)."""
        return self.pick_why(candidates, block_hashes, adapter)[0]

    def pick_why(
        self, candidates: list[Candidate], block_hashes: list[str], adapter: str | None = None
    ) -> tuple[Backend, str]:
        """`pick_from`'s replica and why it won (a trace's routing span tells it)."""
        if len(candidates) == 1:
            return candidates[0].backend, ONLY_ONE
        stats = [c.stats for c in candidates]
        index, why = self.decide(stats, block_hashes, adapter)
        return candidates[index].backend, why

    def claim(self, backend: Backend) -> None:
        """A request was sent its way (count it until `release`)."""
        self.in_flight[backend.name] = self.in_flight.get(backend.name, 0) + 1
        self.holding[id(backend)] = self.holding.get(id(backend), 0) + 1

    def release(self, backend: Backend) -> None:
        self.in_flight[backend.name] -= 1
        left = self.holding.pop(id(backend)) - 1
        if left:
            self.holding[id(backend)] = left

    def remove(self, gone: list[Backend]) -> None:
        """Route no more requests to `gone` (a reload removed them); a model left with no
        replica is gone too (404). Its requests in flight hold their replica and finish."""
        ids = {id(b) for b in gone}
        self.backends[:] = [b for b in self.backends if id(b) not in ids]
        for model in list(self.serving):
            self.serving[model] = [b for b in self.serving[model] if id(b) not in ids]
            if not self.serving[model]:
                del self.serving[model]
                self.cards.pop(model, None)
        names = {b.name for b in self.backends}
        for b in gone:
            if b.name not in names:
                self.broken.pop(b.name, None)

    def choose(
        self, stats: list[BackendStats], block_hashes: list[str], adapter: str | None = None
    ) -> int:
        """Index into `stats` (one per healthy replica) of the replica to use."""
        return self.decide(stats, block_hashes, adapter)[0]

    def decide(
        self, stats: list[BackendStats], block_hashes: list[str], adapter: str | None = None
    ) -> tuple[int, str]:
        """`choose`'s index, and which of the rules above picked it."""
        turn = next(self._turn)
        n = len(stats)
        if self.policy == "round_robin":
            return turn % n, ROUND_ROBIN
        loads = [max(s.running + s.waiting, self.in_flight.get(s.name, 0)) for s in stats]
        # per replica: (leading blocks held in any of its tiers, of those on the device)
        matched = [(0, 0)] * n
        if self.policy == "prefix" and block_hashes and self.catalog is not None:
            matched = [self.catalog.match_tiers(s.name, block_hashes) for s in stats]
        longer_first = [(-anywhere, -device) for anywhere, device in matched]
        loaded = [False] * n  # has the request's adapter loaded
        if self.policy == "prefix" and adapter is not None:
            loaded = [adapter in s.extra.get("adapters_loaded", ()) for s in stats]
        least = min(
            range(n),
            key=lambda i: (
                loads[i],
                longer_first[i],
                not loaded[i],
                stats[i].kv_usage,
                (i - turn) % n,
            ),
        )
        best = max(range(n), key=lambda i: (matched[i], loaded[i], -loads[i], (i - turn) % n))
        covered = matched[best][0]
        why = CACHED_PREFIX
        if covered == 0 or covered < self.cache_threshold * len(block_hashes):
            if not any(loaded):
                return least, LEAST_LOADED
            best = min((i for i in range(n) if loaded[i]), key=lambda i: (loads[i], least != i))
            why = ADAPTER_LOADED
        overloaded = (
            loads[best] - loads[least] > self.balance_abs
            and loads[best] > self.balance_rel * loads[least]
        )
        return (least, OVERLOADED) if overloaded else (best, why)
