"""A better priority displaces a worse one (issue 50: batch work yields): when the
sequence limit or the KV pool keeps a waiting request out, the worst running request of a
worse priority is preempted for it and resumes later, recomputed to the same output."""

from __future__ import annotations

from backend_gpu import LLM, SamplingParams
from backend_gpu.sequence import Sequence, SequenceStatus
from tests.backend_gpu.test_fairness import Sim
from tests.requests import req

BATCH, INTERACTIVE = 5, 0  # priorities: lower first


def _submit(
    sim: Sim, name: str, priority: int, prompt_len: int = 8, max_tokens: int = 8, tenant: str = ""
):
    tokens = [hash((name, i)) % 30_000 + 1000 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens)
    seq = Sequence(req(name, tokens, params, None, priority, tenant_id=tenant))
    sim.sched.add(seq)
    sim.live.append(seq)
    return seq


def _run(sim: Sim) -> list[str]:
    """Step to the end; the request ids in the order they finished."""
    done: list[str] = []
    while sim.sched.has_unfinished():
        before = list(sim.live)
        sim.step()  # a sequence that finishes leaves sim.live
        done += [seq.request_id for seq in before if seq not in sim.live]
    return done


def test_a_better_priority_takes_a_seat_when_the_sequence_limit_binds():
    sim = Sim(fairness="fcfs", max_num_seqs=2)
    batch = [_submit(sim, f"b{i}", BATCH, max_tokens=30) for i in range(2)]
    sim.step()
    sim.step()
    assert all(s.status is SequenceStatus.RUNNING for s in batch)
    urgent = _submit(sim, "urgent", INTERACTIVE, max_tokens=4)
    step = sim.step()
    assert urgent in step.seqs and sim.sched.num_preemptions == 1
    # the most recent batch request gave its seat; it waits, first of its priority
    assert [s.status for s in batch].count(SequenceStatus.WAITING) == 1
    order = _run(sim)
    assert order[0] == "urgent" and sorted(order) == ["b0", "b1", "urgent"]
    assert sim.bm.num_free_blocks == sim.num_blocks


def test_an_idle_tenants_request_takes_the_spare_seat_beside_the_batch():
    """Under VTC an interactive request whose tenant has nothing running takes the seat kept
    for a newcomer, beside both running batch lines: none is displaced, so none is
    recomputed (studies.batch_yield's case; PERF.md). The tenant's second request at once
    gets no spare seat: the lines give theirs up to bring the engine back to its limit."""
    sim = Sim(fairness="vtc", max_num_seqs=2)
    lines = [_submit(sim, f"b{i}", BATCH, max_tokens=30, tenant="batch") for i in range(4)]
    sim.step()
    sim.step()
    running = [s for s in lines if s.status is SequenceStatus.RUNNING]
    assert len(running) == 2
    urgent = _submit(sim, "urgent", INTERACTIVE, max_tokens=8, tenant="web")
    step = sim.step()
    assert urgent in step.seqs and all(s in step.seqs for s in running)
    assert sim.sched.num_preemptions == 0
    second = _submit(sim, "second", INTERACTIVE, max_tokens=8, tenant="web")
    step = sim.step()
    assert second in step.seqs and sim.sched.running == [urgent, second]
    assert sim.sched.num_preemptions == 2
    assert all(s.status is SequenceStatus.WAITING for s in lines)
    order = _run(sim)
    assert order[:2] == ["urgent", "second"] and sorted(order[2:]) == ["b0", "b1", "b2", "b3"]


def test_a_better_priority_takes_blocks_when_the_kv_pool_binds():
    sim = Sim(fairness="vtc", num_blocks=12, max_num_seqs=8, budget=64)
    hog = _submit(sim, "hog", BATCH, prompt_len=32, max_tokens=8)  # 8 of the 12 blocks
    sim.step()
    assert hog.status is SequenceStatus.RUNNING
    urgent = _submit(sim, "urgent", INTERACTIVE, prompt_len=20)  # 5 blocks: no room
    step = sim.step()
    assert urgent in step.seqs and hog.status is SequenceStatus.WAITING
    assert _run(sim)[0] == "urgent"
    assert sim.bm.num_free_blocks == sim.num_blocks


def test_the_same_priority_never_displaces():
    sim = Sim(fairness="fcfs", max_num_seqs=1)
    first = _submit(sim, "first", BATCH, max_tokens=10)
    sim.step()
    _submit(sim, "second", BATCH)
    sim.step()
    assert first.status is SequenceStatus.RUNNING and sim.sched.num_preemptions == 0
    assert _run(sim) == ["first", "second"]


def test_a_displaced_request_resumes_to_its_own_greedy_output(tiny_model_dir):
    """On the engine with one sequence slot: the batch request preempted mid-decode for
    an interactive one is recomputed and ends as it would have alone."""
    llm = LLM(tiny_model_dir("llama"), max_num_seqs=1, max_num_batched_tokens=32)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    alone = {
        name: llm.generate([prompt], greedy)[0].token_ids
        for name, prompt in (("batch", [9, 10, 11, 12]), ("urgent", [20, 21, 22]))
    }
    engine = llm.engine
    finished: list[str] = []
    outputs: dict[str, list[int]] = {"batch": [], "urgent": []}

    def step() -> None:
        for out in engine.step():
            outputs[out.request_id] = out.token_ids  # all of its output so far
            if out.finished:
                finished.append(out.request_id)

    engine.add_request(req("batch", [9, 10, 11, 12], greedy, None, BATCH))
    for _ in range(4):
        step()
    engine.add_request(req("urgent", [20, 21, 22], greedy, None, INTERACTIVE))
    while engine.scheduler.has_unfinished():
        step()
    assert finished == ["urgent", "batch"]
    assert engine.scheduler.num_preemptions == 1
    assert outputs == alone
