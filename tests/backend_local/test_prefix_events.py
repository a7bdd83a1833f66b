"""Prefix blocks the engine reports, and published prefixes, with the real default model."""

from dataclasses import replace

import pytest

from backend_local import EngineConfig, LocalEngine, SamplingParams
from backend_local.prefix_blocks import BLOCK_SIZE, block_hashes
from gateway.backends import BackendSpec, BadRequestError, GenRequest, build_backend
from gateway.backends.default_model import DEFAULT_MODEL_ID
from tests.backend_local.helpers import collect

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant for a bakery. Answer briefly and politely. " * 3


def exactly(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def replay(events, held: set[str] | None = None) -> set[str]:
    """The block hashes a catalog fed with `events` believes the engine holds."""
    held = set() if held is None else held
    for e in events:
        if e.kind == "stored":
            assert e.block_hash not in held
            held.add(e.block_hash)
        else:
            held.remove(e.block_hash)
    return held


def events_engine(model_path: str, n_parallel: int) -> LocalEngine:
    options = {"n_batch": 128, "n_threads": 1, "enable_kv_events": True}
    config = EngineConfig(model_path, n_ctx=512 * n_parallel, n_parallel=n_parallel, **options)
    return LocalEngine(config)


@pytest.fixture
def engine(model_path):
    engine = events_engine(model_path, n_parallel=2)
    yield engine
    engine.shutdown()


@pytest.fixture
def engine3(model_path):
    engine = events_engine(model_path, n_parallel=3)
    yield engine
    engine.shutdown()


async def test_events_follow_what_the_sequences_hold(engine):
    prompts = [engine.tokenize(f"{SYSTEM} Question {i}: how long does bread keep?") for i in "ab"]
    held: dict[str, list[int]] = {}  # salt -> tokens its sequence keeps
    for salt, prompt in zip(("a", "b"), prompts, strict=True):
        ids, _, out = await collect(engine, salt, prompt, exactly(6), salt)
        assert out.cached_tokens == 0
        held[salt] = prompt + ids[:-1]  # the last sampled token never gets a cell
    events = engine.take_kv_events()
    expected = {h for salt, toks in held.items() for h in block_hashes(toks, salt)}
    assert len(expected) == sum(len(t) // BLOCK_SIZE for t in held.values())
    assert replay(events) == expected
    first = next(e for e in events if e.kind == "stored")
    assert (first.parent_hash, first.cache_salt, first.num_tokens) == (None, "a", BLOCK_SIZE)

    # a third tenant takes the least recently used sequence: a's blocks are removed
    ids, _, _ = await collect(engine, "c", prompts[0], exactly(6), "c")
    events = engine.take_kv_events()
    assert {e.block_hash for e in events if e.kind == "removed"} == set(
        block_hashes(held.pop("a"), "a")
    )
    held["c"] = prompts[0] + ids[:-1]
    assert replay(events, expected) == {
        h for salt, toks in held.items() for h in block_hashes(toks, salt)
    }

    # the same tenant again with a shorter prompt: the sequence is cut to the common prefix
    short = prompts[1][: 2 * BLOCK_SIZE + 3]
    _, _, out = await collect(engine, "b2", short, exactly(1), "b")
    assert out.cached_tokens == len(short) - 1
    kept = set(block_hashes(short, "b"))
    removed = {e.block_hash for e in engine.take_kv_events() if e.kind == "removed"}
    assert removed == set(block_hashes(held["b"], "b")) - kept

    engine.shutdown()  # the context is freed: every block it held is removed
    events = engine.take_kv_events()
    assert {e.kind for e in events} == {"removed"}
    assert {e.block_hash for e in events} == kept | set(block_hashes(held["c"], "c"))


async def test_published_prefix_is_reused_across_tenants_but_their_own_tokens_never(engine3):
    engine = engine3  # three sequences: tenant a's stays cached while b's requests run
    published = engine.tokenize(SYSTEM)
    n = len(published)
    assert n > 2 * BLOCK_SIZE
    question = engine.tokenize(" Question: do you sell rye bread?", add_special=False)
    other = engine.tokenize(" When do you open on Sundays?", add_special=False)
    ids_a, _, out = await collect(engine, "a1", published + question, exactly(4), "tenant-a", n)
    assert out.cached_tokens == 0

    # tenant b, the same published prefix: reuses it, and only it, even for a's exact prompt
    _, _, out = await collect(engine, "b1", published + other, exactly(4), "tenant-b", n)
    assert out.cached_tokens == n
    ids_b, _, out = await collect(engine, "b2", published + question, exactly(4), "tenant-b", n)
    assert out.cached_tokens == n  # not n + len(question): those cells are tenant a's
    assert ids_b[:2] == ids_a[:2]  # reused published cells give the same continuation

    # not marked as published by the request: nothing of another tenant's is reused
    _, _, out = await collect(engine, "c1", published + question, exactly(4), "tenant-c")
    assert out.cached_tokens == 0

    # c1 took the least recently used sequence: b1's, not a's, which b2 copied from last
    events = engine.take_kv_events()
    held = replay(events)
    assert set(block_hashes(published + question + ids_a[:-1], "tenant-a", n)) <= held
    # the published blocks are stored once, without a salt; the rest under each salt
    stored = [e for e in events if e.kind == "stored"]
    public = [e.block_hash for e in stored if e.cache_salt is None]
    assert public == block_hashes(published + question, "tenant-a", n)[: n // BLOCK_SIZE]
    assert public == block_hashes(published + other, "tenant-b", n)[: n // BLOCK_SIZE]


async def test_adapter_reports_events_under_its_replica_name(model_path):
    options = {"n_ctx": 512, "n_parallel": 1, "n_batch": 64, "n_threads": 1}
    backend = build_backend(BackendSpec(name="local-1", type="local", options=options))
    await backend.start()
    prompt = await backend.render(DEFAULT_MODEL_ID, SYSTEM)
    sampling = SamplingParams(temperature=0, max_tokens=2)
    request = GenRequest("r1", DEFAULT_MODEL_ID, prompt, sampling, "t", "salt-t")
    chunks = [c async for c in backend.generate(request)]
    held = prompt + chunks[0].token_ids
    events = backend.kv_events()
    assert {(e.replica, e.kind) for e in events} == {("local-1", "stored")}
    assert [e.block_hash for e in events] == backend.block_hashes(held, "salt-t")
    bad = replace(request, request_id="r2", shared_prefix_len=len(prompt) + 1)  # past the prompt
    with pytest.raises(BadRequestError, match="shared_prefix_len"):
        await anext(backend.generate(bad))
    assert backend.kv_events() == []  # refused: nothing changed
    await backend.stop()
    events = backend.kv_events()
    assert {e.kind for e in events} == {"removed"}
    assert [e.block_hash for e in events] == backend.block_hashes(held, "salt-t")
    assert backend.kv_events() == []
