"""LoRA adapters on the llama.cpp engine with the real default model (Gemma 3 270M) and
random GGUF LoRA files written for it (lora_files.py)."""

import asyncio

import pytest

from backend_local import EngineConfig, LocalEngine, SamplingParams
from backend_local.prefix_blocks import block_hashes
from engine_api.errors import AdapterLoadError, BadRequestError
from engine_api.records import AdapterRef, GenRequest
from gateway.backends import BackendSpec, build_backend
from gateway.backends.default_model import DEFAULT_MODEL_ID
from tests.backend_local.helpers import assert_same_up_to_near_tie, wait_for
from tests.backend_local.lora_files import write_lora, write_peft_dir

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
LONG = "A long system prompt about the history of the Roman empire and its roads. " * 3


@pytest.fixture(scope="module")
def engine(model_path):
    config = EngineConfig(
        model_path,
        n_ctx=2048,
        n_parallel=4,
        n_batch=256,
        n_threads=1,
        enable_kv_events=True,
        enable_lora=True,
        max_loras=2,
    )
    engine = LocalEngine(config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def loras(tmp_path_factory, engine) -> dict[str, AdapterRef]:
    d = tmp_path_factory.mktemp("loras")
    return {
        name: AdapterRef(name, write_lora(d / f"{name}.gguf", engine.model, seed))
        for seed, name in enumerate(("a", "b", "c"), start=1)
    }


async def run(
    engine: LocalEngine,
    request_id: str,
    adapter: AdapterRef | None,
    salt: str,
    prompt: str = PROMPT,
    shared: int = 0,
):
    """(output ids, logprobs, last output) of a greedy request under `adapter`."""
    ids = engine.tokenize(prompt)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    req = GenRequest(
        request_id, "", ids, params, cache_salt=salt, shared_prefix_len=shared, adapter=adapter
    )
    out, logprobs, last = [], [], None
    async for chunk in engine.generate(req):
        out += chunk.token_ids
        logprobs += chunk.logprobs
        last = chunk
    return out, logprobs, last


async def test_an_adapter_changes_the_output_the_same_way_every_time(engine, loras):
    base, _, _ = await run(engine, "base", None, "s1")
    first, _, out1 = await run(engine, "a-1", loras["a"], "s1")
    again, _, out2 = await run(engine, "a-2", loras["a"], "s2")  # no cells to reuse
    assert first != base
    assert again == first
    assert out1.cached_tokens == out2.cached_tokens == 0  # nothing from the base's cells
    other, _, _ = await run(engine, "b-1", loras["b"], "s3")
    assert other not in (base, first)


async def test_a_mixed_batch_equals_each_request_alone(engine, loras):
    mix = [None, loras["a"], loras["b"], loras["a"]]
    prompts = [PROMPT, PROMPT, PROMPT, "Once upon a time, in a small village by the sea,"]
    solo = [
        await run(engine, f"solo-{i}", adapter, "solo", prompt)
        for i, (adapter, prompt) in enumerate(zip(mix, prompts, strict=True))
    ]
    mixed = await asyncio.gather(
        *(
            run(engine, f"mixed-{i}", adapter, "mixed", prompt)
            for i, (adapter, prompt) in enumerate(zip(mix, prompts, strict=True))
        )
    )
    for i, ((solo_ids, solo_lps, _), (ids, lps, last)) in enumerate(zip(solo, mixed, strict=True)):
        if i in (0, 2):  # alone in its group: each of its steps ran just as alone
            assert (ids, lps) == (solo_ids, solo_lps)
        else:  # decoded beside another request: llama.cpp's batches are not invariant
            assert_same_up_to_near_tie(solo_ids, solo_lps, ids, lps)
        assert last.cached_tokens <= 1  # at most the BOS a same-adapter neighbour holds
    assert len({tuple(ids) for ids, _, _ in solo[:3]}) == 3  # three different continuations
    stats = engine.stats()
    assert stats.lora_loads >= 2 and len(stats.adapters_loaded) <= 2


async def test_the_same_prompt_under_two_adapters_shares_no_cached_tokens(engine, loras):
    n = len(engine.tokenize(LONG))
    engine.take_kv_events()
    _, _, a = await run(engine, "share-a", loras["a"], "t1", LONG, shared=n)
    a_blocks = {e.block_hash for e in engine.take_kv_events() if e.kind == "stored"}
    # a published prefix, another tenant: still nothing under another adapter or the base
    _, _, b = await run(engine, "share-b", loras["b"], "t2", LONG, shared=n)
    b_blocks = {e.block_hash for e in engine.take_kv_events() if e.kind == "stored"}
    _, _, base = await run(engine, "share-base", None, "t2", LONG, shared=n)
    assert a.cached_tokens == b.cached_tokens == base.cached_tokens == 0
    ids = engine.tokenize(LONG)
    assert set(block_hashes(ids, "t1", n, loras["a"])) <= a_blocks
    assert set(block_hashes(ids, "t2", n, loras["b"])) <= b_blocks  # stored anew
    assert not a_blocks & b_blocks
    # the same adapter shares it, published across tenants as without adapters
    _, _, a2 = await run(engine, "share-a2", loras["a"], "t3", LONG, shared=n)
    assert a2.cached_tokens == n - 1


async def test_the_disk_tier_keeps_adapters_apart(model_path, loras, tmp_path):
    def start() -> LocalEngine:
        disk, lora = str(tmp_path), True
        secret = "one secret for both engines, as a gateway gives them"
        config = EngineConfig(
            model_path,
            512,
            1,
            n_threads=1,
            kv_disk_path=disk,
            enable_lora=lora,
            kv_tier_secret=secret,
        )
        return LocalEngine(config)

    engine = start()
    try:
        await run(engine, "disk-a", loras["a"], "t", LONG)
        await wait_for(lambda: engine.stats().kv_disk_blocks_written == 1)
    finally:
        engine.shutdown()
    engine = start()  # nothing in the cells: only the disk could serve the prefix
    try:
        _, _, b = await run(engine, "disk-b", loras["b"], "t", LONG)
        _, _, base = await run(engine, "disk-base", None, "t", LONG)
        assert b.cached_tokens == base.cached_tokens == engine.stats().kv_disk_hits == 0
        _, _, a = await run(engine, "disk-a2", loras["a"], "t", LONG)
        assert a.cached_tokens == engine.stats().kv_disk_hits > 0
    finally:
        engine.shutdown()


async def test_a_peft_directory_is_refused_with_how_to_convert_it(engine, tmp_path):
    peft = AdapterRef("peft", write_peft_dir(tmp_path / "peft"))
    with pytest.raises(BadRequestError, match=r"PEFT adapter.*convert_lora_to_gguf\.py --base"):
        engine.check_adapter(peft)
    # at a request too: a load that fails there (the files changed since their check)
    with pytest.raises(AdapterLoadError) as e:
        await run(engine, "peft", peft, "s")
    assert "'peft'" in str(e.value) and "convert_lora_to_gguf" in e.value.reason


async def test_a_file_that_is_not_a_lora_for_this_model_is_refused_naming_why(
    engine, model_path, tmp_path
):
    text = tmp_path / "notes.txt"
    text.write_text("not an adapter")
    small = write_lora(tmp_path / "small.gguf", engine.model, 9, targets=("attn_q",))
    cases = {
        str(tmp_path / "missing.gguf"): "not found",
        str(text): "not a GGUF file",
        model_path: "is a GGUF model, not an adapter",
        write_lora(tmp_path / "llama.gguf", engine.model, 9, architecture="llama"): (
            "for a llama model; this model's architecture is gemma3"
        ),
        write_lora(tmp_path / "vector.gguf", engine.model, 9, general_type="control_vector"): (
            "GGUF control_vector, not an adapter"
        ),
    }
    loads = engine.stats().lora_loads
    for path, problem in cases.items():
        with pytest.raises(BadRequestError, match=problem):
            engine.check_adapter(AdapterRef("bad", path))
    engine.check_adapter(AdapterRef("small", small))  # a good one passes
    assert engine.stats().lora_loads == loads  # a check leaves nothing loaded


async def test_another_models_shapes_are_refused(engine, tmp_path):
    # Gemma 3's attn_q weights with attn_k's name: the shapes do not fit the model's
    path = tmp_path / "shapes.gguf"
    write_lora(path, engine.model, 9, targets=("attn_q",))
    swapped = tmp_path / "swapped.gguf"
    swapped.write_bytes(path.read_bytes().replace(b"attn_q", b"attn_k"))
    with pytest.raises(BadRequestError, match="could not load.*do not fit this model"):
        engine.check_adapter(AdapterRef("swapped", str(swapped)))


async def test_more_adapters_than_max_loras_are_all_served(engine, loras):
    names = ["a", "b", "c"]
    alone = {n: (await run(engine, f"alone-{n}", loras[n], f"alone-{n}"))[:2] for n in names}
    loads = engine.stats().lora_loads
    together = await asyncio.gather(*(run(engine, f"all-{n}", loras[n], "all") for n in names))
    for n, (ids, lps, _) in zip(names, together, strict=True):
        assert_same_up_to_near_tie(*alone[n], ids, lps)
    stats = engine.stats()
    assert len(stats.adapters_loaded) <= 2  # max_loras once none runs
    assert stats.lora_loads > loads  # the least recently used went out and came back


async def test_a_removed_adapter_is_freed_with_its_cells_and_loads_again(engine, loras):
    first, _, _ = await run(engine, "rm-1", loras["c"], "rm")
    assert "c" in engine.stats().adapters_loaded
    loads = engine.stats().lora_loads
    engine.remove_adapter("c")
    await wait_for(lambda: "c" not in engine.stats().adapters_loaded)
    again, _, last = await run(engine, "rm-2", loras["c"], "rm")
    assert again == first
    assert last.cached_tokens == 0  # the cells computed under it went with it
    assert engine.stats().lora_loads == loads + 1


async def test_an_engine_without_lora_refuses_adapters(model_path, loras):
    engine = LocalEngine(EngineConfig(model_path, n_ctx=256, n_parallel=1, n_threads=1))
    try:
        with pytest.raises(BadRequestError, match="enable_lora"):
            engine.check_adapter(loras["a"])
        with pytest.raises(BadRequestError, match="enable_lora"):
            await run(engine, "no-lora", loras["a"], "s")
    finally:
        engine.shutdown()


async def test_the_gateway_backend_checks_serves_and_reports_adapters(loras, tmp_path):
    options = {"n_ctx": 512, "n_parallel": 1, "n_threads": 1, "enable_lora": True}
    backend = build_backend(BackendSpec(name="local", type="local", options=options))
    await backend.start()
    try:
        await backend.check_adapter(loras["a"])
        with pytest.raises(BadRequestError, match="convert_lora_to_gguf"):
            await backend.check_adapter(AdapterRef("p", write_peft_dir(tmp_path / "p")))
        ids = backend.engine.tokenize(PROMPT)
        params = SamplingParams(temperature=0, max_tokens=4)
        req = GenRequest("gw-1", DEFAULT_MODEL_ID, ids, params, adapter=loras["a"])
        chunks = [c async for c in backend.generate(req)]
        assert chunks[-1].finish_reason == "length"
        extra = backend.stats().extra
        assert (extra["adapters_loaded"], extra["lora_loads"]) == (["a"], 1)
        await backend.remove_adapter("a")
        await wait_for(lambda: backend.stats().extra["adapters_loaded"] == [])
    finally:
        await backend.stop()
