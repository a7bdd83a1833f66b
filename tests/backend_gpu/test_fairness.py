"""Fair share between tenants (Virtual Token Counter), driven without a model: backlogged
tenants stay within the VTC bound of each other at every step, weights divide service,
idle time banks no credit, a flood cannot hold back a newcomer, preemption takes from
the most-served tenant, and one tenant is scheduled exactly as first come first served."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_gpu import LLM
from backend_gpu.block_manager import BlockManager
from backend_gpu.config import EngineConfig
from backend_gpu.fairness import OUTPUT_TOKEN_COST, PROMPT_TOKEN_COST
from backend_gpu.scheduler import ScheduledBatch, Scheduler
from backend_gpu.sequence import Sequence, SequenceStatus
from engine_api.errors import BadRequestError
from engine_api.records import GenRequest
from engine_api.sampling import SamplingParams
from tests.backend_gpu.model_free_steps import advance
from tests.requests import req

BS = 4
_tokens = itertools.count(1000)  # prompts that share no block unless a test says so


def vtc_bound(longest_prompt: int, max_tokens: int, max_num_seqs: int, min_weight: float):
    """U: how far apart two backlogged tenants' counters may be (backend_gpu.fairness);
    VTC keeps one seat beyond max_num_seqs for a tenant becoming active."""
    seats = max_num_seqs + 1
    cost = longest_prompt * PROMPT_TOKEN_COST + seats * max_tokens * OUTPUT_TOKEN_COST
    return cost / min_weight


@dataclass
class Sim:
    """A scheduler and block manager stepped the way the engine steps them."""

    fairness: str = "vtc"
    num_blocks: int = 512
    max_num_seqs: int = 4
    budget: int = 64
    prefix: bool = True
    live: list[Sequence] = field(default_factory=list)

    def __post_init__(self) -> None:
        config = EngineConfig(
            model="",
            block_size=BS,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.budget,
            fairness=self.fairness,
        )
        self.bm = BlockManager(self.num_blocks, BS, enable_prefix_caching=self.prefix)
        self.sched = Scheduler(config, self.bm)
        self.ids = itertools.count()

    def submit(self, tenant, n=1, prompt_len=8, max_tokens=8, weight=1.0, prompt=None):
        seqs = []
        for _ in range(n):
            tokens = prompt if prompt is not None else [next(_tokens) for _ in range(prompt_len)]
            params = SamplingParams(max_tokens=max_tokens)
            seq = Sequence(
                req(
                    f"{tenant}{next(self.ids)}",
                    tokens,
                    params,
                    tenant,
                    tenant_id=tenant,
                    weight=weight,
                )
            )
            self.sched.add(seq)
            self.live.append(seq)
            seqs.append(seq)
        return seqs

    def step(self) -> ScheduledBatch:
        batch = self.sched.schedule()
        advance(self.sched, self.bm, batch, self.live)
        return batch

    def counter(self, tenant: str) -> float:
        return self.sched.ledger.tenants[tenant].counter

    def service(self, tenant: str) -> float:
        return self.sched.ledger.tenants[tenant].service

    def backlogged(self) -> list[str]:
        return [name for name, t in self.sched.ledger.tenants.items() if t.waiting]


def run_backlogged(sim: Sim, weights: dict[str, float], bound: float) -> int:
    """Step while every tenant in `weights` is backlogged, checking at every step that
    their weighted services since the start differ by at most 2U and their counters by
    at most U; return the number of steps."""
    start = {t: sim.service(t) / w for t, w in weights.items()}
    steps = 0
    while set(weights) <= set(sim.backlogged()):
        sim.step()
        steps += 1
        served = [sim.service(t) / w - start[t] for t, w in weights.items()]
        assert max(served) - min(served) <= 2 * bound + 1e-9
        counters = [sim.counter(t) for t in sim.backlogged()] or [0.0]
        assert max(counters) - min(counters) <= bound + 1e-9  # U is reached exactly
    return steps


def test_equal_weights_stay_within_the_bound_at_every_step():
    sim = Sim()
    sim.submit("a", 30)  # a floods first: first come first served would run all of it
    sim.submit("b", 30)
    bound = vtc_bound(8, 8, sim.max_num_seqs, 1.0)
    assert run_backlogged(sim, {"a": 1.0, "b": 1.0}, bound) > 20
    assert abs(sim.service("a") - sim.service("b")) <= 2 * bound


def test_first_come_first_served_breaks_that_bound():
    sim = Sim(fairness="fcfs")
    sim.submit("a", 30)
    sim.submit("b", 30)
    bound = vtc_bound(8, 8, sim.max_num_seqs, 1.0)
    with pytest.raises(AssertionError):
        run_backlogged(sim, {"a": 1.0, "b": 1.0}, bound)


def test_weights_two_to_one_give_service_two_to_one():
    sim = Sim()
    sim.submit("a", 90, weight=2.0)
    sim.submit("b", 45, weight=1.0)
    bound = vtc_bound(8, 8, sim.max_num_seqs, 1.0)
    run_backlogged(sim, {"a": 2.0, "b": 1.0}, bound)
    a, b = sim.service("a"), sim.service("b")
    assert b > 10 * bound  # long enough that the ratio means something
    assert abs(a / 2 - b) <= 2 * bound
    assert sim.sched.tenant_stats()["a"].weight == 2.0


def test_a_tenant_back_from_idle_banks_no_credit():
    sim = Sim()
    sim.submit("a", 80)
    sim.submit("b", 4)
    bound = vtc_bound(8, 8, sim.max_num_seqs, 1.0)
    while any(s.tenant_id == "b" for s in sim.live):  # b is served, then goes idle
        sim.step()
    for _ in range(60):  # a alone uses the capacity b leaves
        sim.step()
    assert sim.counter("a") - sim.counter("b") > 4 * bound  # what b could have banked
    sim.submit("b", 20)
    assert sim.counter("b") == sim.counter("a")  # lifted to the backlogged minimum
    a_waiting = sim.sched.ledger.tenants["a"].waiting
    run_backlogged(sim, {"a": 1.0, "b": 1.0}, bound)
    # while b's 20 requests (16 tokens each) were admitted, a's were too, about as many
    a_admitted = a_waiting - sim.sched.ledger.tenants["a"].waiting
    assert a_admitted >= 20 - 2 * bound / 16


def admitted_before(sim: Sim, newcomer: Sequence) -> list[Sequence]:
    """Step until `newcomer` is admitted; return the requests admitted before it (in
    earlier steps, or earlier in the same step)."""
    before: list[Sequence] = []
    while True:
        waiting = {id(s) for s in sim.live if s.status is SequenceStatus.WAITING}
        batch = sim.step()
        for seq in batch.seqs:
            if id(seq) not in waiting:
                continue
            if seq is newcomer:
                return before
            before.append(seq)


@pytest.mark.parametrize("fairness", ["vtc", "fcfs"])
def test_a_flood_cannot_hold_back_a_newcomer(fairness):
    sim = Sim(fairness=fairness)
    sim.submit("a", 50, max_tokens=6)
    for _ in range(5):
        sim.step()
    assert sim.sched.ledger.tenants["a"].waiting > 40
    (newcomer,) = sim.submit("b")
    ahead = admitted_before(sim, newcomer)
    if fairness == "vtc":
        assert ahead == []  # the first request admitted once a slot frees
    else:
        assert len(ahead) > 40  # behind the whole flood


@pytest.mark.parametrize("fairness", ["vtc", "fcfs"])
def test_a_newcomer_takes_the_spare_seat_at_the_next_step(fairness):
    sim = Sim(fairness=fairness)
    sim.submit("a", 20, max_tokens=50)
    for _ in range(3):
        sim.step()
    assert len(sim.sched.running) == sim.max_num_seqs  # every seat is a's
    (newcomer,) = sim.submit("b")
    sim.step()
    if fairness == "vtc":
        assert newcomer.status is SequenceStatus.RUNNING
        assert len(sim.sched.running) == sim.max_num_seqs + 1
        (second,) = sim.submit("b")  # b has a seat now: no second spare one
        sim.step()
        assert second.status is SequenceStatus.WAITING
    else:
        assert newcomer.status is SequenceStatus.WAITING
    assert len(sim.sched.running) <= sim.max_num_seqs + 1


def test_a_newcomer_lifted_into_a_tie_goes_before_the_tenant_just_served():
    sim = Sim(max_num_seqs=1)
    sim.submit("a", 2, max_tokens=1)
    sim.step()  # a's first request runs to its end
    (newcomer,) = sim.submit("b")
    assert sim.counter("b") == sim.counter("a") == 9
    assert admitted_before(sim, newcomer) == []


@pytest.mark.parametrize(("fairness", "victim"), [("vtc", "a"), ("fcfs", "b")])
def test_preemption_takes_from_the_most_served_tenant(fairness, victim):
    # 12 blocks hold 48 tokens; three requests grow to 24 tokens each
    sim = Sim(fairness=fairness, num_blocks=12, budget=64)
    sim.submit("a", 2, prompt_len=8, max_tokens=16)
    sim.step()
    sim.step()
    sim.submit("b", 1, prompt_len=8, max_tokens=16)  # the latest arrival
    while sim.sched.num_preemptions == 0:
        assert sim.sched.has_unfinished()
        sim.step()
    victims = [s for s in sim.live if s.num_preemptions]
    assert victims and all(s.tenant_id == victim for s in victims)
    if fairness == "vtc":
        assert sim.counter("a") > sim.counter("b")
    while sim.sched.has_unfinished():
        sim.step()
    assert sim.bm.num_free_blocks == sim.num_blocks


def test_cached_prompt_tokens_cost_a_tenth():
    sim = Sim()
    prompt = [next(_tokens) for _ in range(17)]
    sim.submit("a", prompt=prompt, max_tokens=1)
    while sim.sched.has_unfinished():
        sim.step()
    assert sim.service("a") == pytest.approx(17 + 1)
    sim.submit("a", prompt=prompt, max_tokens=1)  # 16 of its 17 tokens are cached
    while sim.sched.has_unfinished():
        sim.step()
    assert sim.service("a") == pytest.approx(18 + 1 + 16 * 0.1 + 1)


def described(batch: ScheduledBatch) -> list[tuple[str, int]]:
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]


def batches(ops, fairness: str, num_blocks: int, budget: int, max_num_seqs: int):
    """Replay `ops` on a fresh scheduler; every batch as (request id, tokens) pairs."""
    sim = Sim(fairness, num_blocks, max_num_seqs, budget)
    out = []
    for i, (op, family, priority, length) in enumerate(ops):
        if op == "add":
            prompt = [family * 100 + j for j in range(length)]
            max_tokens = 1 + length % 5
            if sim.bm.blocks_needed(length + max_tokens) > num_blocks:
                continue
            seq = Sequence(
                req(str(i), prompt, SamplingParams(max_tokens=max_tokens), None, priority)
            )
            sim.sched.add(seq)
            sim.live.append(seq)
        elif op == "step":
            batch = sim.step()
            out.append(described(batch))
        elif sim.live:
            seq = sim.live[(family + length) % len(sim.live)]
            sim.sched.finish(seq, "abort")
            sim.live.remove(seq)
    while sim.sched.has_unfinished():
        batch = sim.step()
        assert batch.seqs
        out.append(described(batch))
    assert sim.bm.num_free_blocks == num_blocks
    return out


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "step", "abort"]),
            st.integers(0, 3),  # prompt family: shared prefixes within a family
            st.integers(0, 2),  # priority
            st.integers(1, 30),  # length
        ),
        max_size=60,
    ),
    num_blocks=st.integers(8, 24),
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 4),
)
def test_one_tenant_is_scheduled_exactly_as_first_come_first_served(
    ops, num_blocks, budget, max_num_seqs
):
    vtc = batches(ops, "vtc", num_blocks, budget, max_num_seqs)
    fcfs = batches(ops, "fcfs", num_blocks, budget, max_num_seqs)
    assert vtc == fcfs


def check_pairs(sim: Sim, weights: dict[str, float], bound: float, baseline: dict) -> None:
    """Counters of backlogged tenants within U; the weighted services of two tenants
    since both became backlogged within 2U."""
    backlogged = sim.backlogged()
    counters = [sim.counter(t) for t in backlogged] or [0.0]
    assert max(counters) - min(counters) <= bound + 1e-9
    for pair in list(baseline):
        if not pair <= set(backlogged):
            del baseline[pair]
    for f, g in itertools.combinations(sorted(backlogged), 2):
        served = {t: sim.service(t) / weights[t] for t in (f, g)}
        start = baseline.setdefault(frozenset((f, g)), served)
        assert abs(served[f] - start[f] - (served[g] - start[g])) <= 2 * bound + 1e-9


arrival = st.tuples(
    st.integers(0, 40),  # step it arrives at
    st.integers(0, 3),  # tenant
    st.integers(0, 2),  # prompt family: a tenant's requests of one family share a prefix
    st.integers(1, 24),  # prompt length
    st.integers(1, 12),  # max_tokens
)


@settings(max_examples=150, deadline=None)
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=40),
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=4, max_size=4),
    num_blocks=st.integers(10, 40),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 6),
    prefix=st.booleans(),
)
def test_random_arrivals_keep_the_bound_starve_no_one_and_leak_nothing(
    arrivals, weights, num_blocks, budget, max_num_seqs, prefix
):
    sim = Sim("vtc", num_blocks, max_num_seqs, budget, prefix)
    longest = max(a[3] for a in arrivals)
    bound = vtc_bound(longest, max(a[4] for a in arrivals), max_num_seqs, min(weights))
    weight_of = {f"t{i}": w for i, w in enumerate(weights)}
    by_step: dict[int, list] = {}
    for a in arrivals:
        by_step.setdefault(a[0], []).append(a)
    submitted: list[Sequence] = []
    baseline: dict[frozenset, dict[str, float]] = {}  # pairs backlogged together since
    step = 0
    while step <= 40 or sim.sched.has_unfinished():
        for _, tenant, family, length, max_tokens in by_step.get(step, []):
            name = f"t{tenant}"
            prompt = [10_000 * tenant + 100 * family + j for j in range(length)]
            submitted += sim.submit(
                name, 1, max_tokens=max_tokens, weight=weight_of[name], prompt=prompt
            )
        if sim.sched.has_unfinished():
            assert sim.step().seqs, "scheduler stalled"
        step += 1
        assert step < 3000, "a request was starved"
        check_pairs(sim, weight_of, bound, baseline)
    assert all(s.is_finished and s.num_output_tokens == s.params.max_tokens for s in submitted)
    assert sim.bm.num_free_blocks == num_blocks
    assert all(t.waiting == t.running == 0 for t in sim.sched.ledger.tenants.values())


def test_weight_travels_in_gen_request_and_is_checked_on_the_wire():
    req = GenRequest("r", "m", [1, 2], SamplingParams(), "acme", weight=2.5)
    assert GenRequest.from_dict(req.to_dict()) == req
    old = req.to_dict()
    del old["weight"]
    assert GenRequest.from_dict(old).weight == 1.0
    for bad in ("2", float("nan"), True):
        with pytest.raises(BadRequestError, match="weight"):
            GenRequest.from_dict(req.to_dict() | {"weight": bad})


def test_unknown_fairness_is_refused():
    with pytest.raises(ValueError, match="fairness"):
        EngineConfig(model="", fairness="wfq")


def run_engine(engine, requests, params) -> tuple[dict[str, list[int]], list[str]]:
    """Every request's output tokens, and the order they were first scheduled in."""
    for request_id, tenant, weight, prompt in requests:
        engine.add_request(req(request_id, prompt, params, tenant, tenant_id=tenant, weight=weight))
    outputs, order = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        order += [s.request_id for s in engine.scheduler.running if s.request_id not in order]
    return outputs, order


def test_fairness_changes_the_order_not_the_greedy_outputs(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    shared = [5, 6, 7, 8] * 4  # a block a's requests share in the prefix cache
    requests = [(f"a{i}", "a", 1.0, shared + [9 + i] * (1 + 3 * i)) for i in range(6)]
    requests += [(f"b{i}", "b", 2.0, [40 + i] * (5 + 2 * i)) for i in range(3)]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    runs = {
        "fcfs": {"fairness": "fcfs"},
        "vtc": {"fairness": "vtc"},
        # a pool of 4 blocks for 3 requests of up to 3: preemption, and speculation too
        # (max_model_len 64: a pool must hold one whole sequence)
        "vtc-spec": {
            "kv_cache_memory_bytes": 4 * 8192,
            "max_model_len": 64,
            "speculative_config": ngram,
        },
    }
    results = {}
    for name, options in runs.items():
        llm = LLM(tiny_model_dir("llama"), max_num_seqs=3, max_num_batched_tokens=16, **options)
        results[name] = run_engine(llm.engine, requests, params)
        stats = llm.stats()
        assert stats.prefix_hits > 0 and stats.num_free_blocks == stats.num_blocks
        assert all(t.waiting == t.running == 0 for t in stats.tenants.values())
        assert stats.tenants["b"].weight == 2.0
        assert stats.tenants["b"].service == sum(len(r[3]) + 6 for r in requests[6:])
    assert stats.preemptions > 0 and stats.num_drafts > 0
    assert results["vtc"][0] == results["fcfs"][0] == results["vtc-spec"][0]
    assert results["fcfs"][1][:6] == [f"a{i}" for i in range(6)]  # b waits for a's flood
    assert results["vtc"][1].index("b0") < 2  # b goes as soon as it is the least served
    # the offline API has one implicit tenant, ""
    llm.generate([[7, 8, 9]], params)
    assert llm.stats().tenants[""].service == 3 + 6


def test_engine_refuses_a_weight_that_is_not_positive_and_finite(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"))
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(BadRequestError, match="weight"):
            llm.engine.add_request(req("x", [5, 6], SamplingParams(), tenant_id="t", weight=bad))
    assert not llm.engine.seqs and not llm.engine.has_unfinished_requests()
    assert llm.stats().tenants == {}


def test_stats_report_every_tenant_as_it_is_now_and_keep_earlier_reports():
    sim = Sim()
    sim.submit("a", 2, max_tokens=32)
    sim.submit("b", 1)
    while any(s.tenant_id == "b" for s in sim.live):
        sim.step()
    before = sim.sched.tenant_stats()
    sim.step()  # a is served more, b is idle
    sim.step()
    after = sim.sched.tenant_stats()
    ledger = sim.sched.ledger.tenants
    for name in ("a", "b"):  # each as the ledger has it now, idle or not
        t = ledger[name]
        assert vars(after[name]) == {"weight": t.weight, "service": t.service,
                                     "counter": t.counter, "waiting": t.waiting,
                                     "running": t.running}  # fmt: skip
    assert after["a"].service > before["a"].service  # the earlier report is not changed
    assert after is not before and after["b"] is before["b"]  # b, unchanged, not rebuilt
