"""The llama.cpp engine's disk tier (kv_disk_path) with the real default model: saved
prefixes survive a restart as cached tokens, keep tenants apart, and a damaged,
foreign, unloadable, forged or swapped file, one that is no record at all (a symlink
to /dev/zero, a FIFO, a 1 GiB sparse file: issue 45), or a path that cannot be
written, never changes an output."""

import contextlib
import os
from pathlib import Path

import pytest

from backend_local import EngineConfig, LocalEngine, SamplingParams
from backend_local.kv_disk_tier import DiskTier
from backend_local.prefix_blocks import BLOCK_SIZE
from engine_api.kv_disk import SUFFIX
from engine_api.kv_records import RecordCodec, fingerprint
from gateway.backends import BackendError, BackendSpec, GenRequest, build_backend
from gateway.backends.default_model import DEFAULT_MODEL_ID
from tests.backend_local.helpers import assert_same_up_to_near_tie, collect, collect_logprobs

pytestmark = pytest.mark.slow

# one thread: two spin at llama.cpp's barriers while the suite's other workers hold the
# second core (docs/PERF.md, "The 24 s request")
OPTIONS = {"n_ctx": 4096, "n_parallel": 2, "n_batch": 256, "n_threads": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=12)
SCORED = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
SLIDING_WINDOW = 512  # Gemma 3's sliding-window layers
SECRET = "the secret the gateways share, for tests"


def engine_on(model_path: str, disk: Path | None) -> LocalEngine:
    disk_path = disk and str(disk)
    return LocalEngine(
        EngineConfig(model_path, kv_disk_path=disk_path, kv_tier_secret=SECRET, **OPTIONS)
    )


@pytest.fixture(scope="module")
def plain(model_path):
    engine = engine_on(model_path, None)
    yield engine
    engine.shutdown()


def saved_len(prompt: list[int]) -> int:
    """What the tier saves of a prompt: its whole blocks, one token left to compute."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def record_path(disk: Path, prompt: list[int], salt: str) -> Path:
    (store,) = disk.iterdir()  # one fingerprint's directory
    key = DiskTier.prefix_hashes(prompt, salt, 0)[-1]
    return store / (key.hex() + SUFFIX)


async def test_a_restart_serves_a_saved_prefix_as_cached_tokens_to_its_tenant_only(
    plain, model_path, tmp_path
):
    text = "The history of the Roman empire, told in short chapters for students. "
    prompt = plain.tokenize(text * 40)[:600]  # past the sliding window
    assert saved_len(prompt) > SLIDING_WINDOW
    ref_ids, ref_lps, _ = await collect_logprobs(plain, "ref", prompt, SCORED, "ref")

    first = engine_on(model_path, tmp_path)
    try:
        cold_ids, cold_lps, out = await collect_logprobs(first, "cold", prompt, SCORED, "a")
    finally:
        first.shutdown()
    assert out.cached_tokens == 0
    assert_same_up_to_near_tie(ref_ids, ref_lps, cold_ids, cold_lps)  # as without the tier
    assert first.stats().kv_disk_blocks_written == 1
    assert record_path(tmp_path, prompt, "a").exists()

    second = engine_on(model_path, tmp_path)
    try:
        # another tenant, the same prompt: nothing from tenant a's file
        _, _, other = await collect(second, "b", prompt, GREEDY, "b")
        assert other.cached_tokens == 0 and second.stats().kv_disk_hits == 0

        ids, _, out = await collect(second, "warm", prompt, SCORED, "a")
        assert out.cached_tokens == saved_len(prompt)
        assert ids == cold_ids  # the very cells the first engine computed
        stats = second.stats()
        assert stats.kv_disk_hits == saved_len(prompt)
        assert stats.prefix_reused_tokens == saved_len(prompt)
        assert stats.kv_disk_rejected == 0

        # Past the window, restored cells cannot be cut short (the state kept only the
        # window's sliding-layer cells): a prompt sharing 520 of them is computed anew.
        part = prompt[:520] + plain.tokenize(" Then the story turns to Egypt.", False)
        ids, lps, out = await collect_logprobs(second, "part", part, SCORED, "a")
        fresh_ids, fresh_lps, _ = await collect_logprobs(plain, "part", part, SCORED, "fresh")
        assert out.cached_tokens == 0
        assert_same_up_to_near_tie(fresh_ids, fresh_lps, ids, lps)
    finally:
        second.shutdown()


def damage(disk: Path, prompts: dict[str, list[int]]) -> None:
    """Spoil each prompt's record as its name says, as whoever can write to the
    directory could (without the secret)."""
    path = {name: record_path(disk, prompt, "t") for name, prompt in prompts.items()}
    original = {name: p.read_bytes() for name, p in path.items()}
    fp = bytes.fromhex(path["corrupt"].parent.name)
    codec = RecordCodec(fp, SECRET)

    def key_of(name: str) -> bytes:
        return bytes.fromhex(path[name].stem)

    data = bytearray(path["corrupt"].read_bytes())
    data[len(data) // 2] ^= 0x40
    path["corrupt"].write_bytes(data)

    path["truncated"].write_bytes(path["truncated"].read_bytes()[:-1000])

    payload = codec.decode(original["foreign"], key_of("foreign"))
    assert payload is not None
    other = RecordCodec(fingerprint(model="another-model.gguf"), SECRET)
    path["foreign"].write_bytes(other.encode(key_of("foreign"), payload))  # this name

    # passes every check of its own, but is no llama.cpp state
    path["refused"].write_bytes(codec.encode(key_of("refused"), b"\x01" * 4096))

    # chosen bytes (another prompt's state), framed as the format says, keyed by a guess
    path["forged"].write_bytes(RecordCodec(fp, "a guess").encode(key_of("forged"), payload))

    # another prompt's valid record, its header naming this prompt's prefix
    swapped = bytearray(original["foreign"])
    swapped[24:56] = key_of("swapped")
    path["swapped"].write_bytes(swapped)

    for name in ("symlink to /dev/zero", "fifo"):
        path[name].unlink()
    path["symlink to /dev/zero"].symlink_to("/dev/zero")
    os.mkfifo(path["fifo"])
    with open(path["sparse 1 GiB"], "r+b") as f:  # its own header, then a hole
        f.truncate(1 << 30)


async def test_damaged_foreign_forged_and_unloadable_files_are_recomputed(
    plain, model_path, tmp_path
):
    subjects = {"corrupt": "rivers", "truncated": "mountains", "foreign": "deserts"}
    subjects |= {"refused": "oceans", "forged": "forests", "swapped": "islands"}
    subjects |= {"symlink to /dev/zero": "lakes", "fifo": "volcanoes", "sparse 1 GiB": "caves"}
    prompts = {
        name: plain.tokenize(f"A short lecture on the {subject} of the world. " * 12)
        for name, subject in subjects.items()
    }
    first = engine_on(model_path, tmp_path)
    try:
        cold = {n: await collect_logprobs(first, n, p, SCORED, "t") for n, p in prompts.items()}
    finally:
        first.shutdown()
    assert first.stats().kv_disk_blocks_written == len(prompts)

    second = engine_on(model_path, tmp_path)
    damage(tmp_path, prompts)  # under the running engine: each found at its read
    try:
        for name, prompt in prompts.items():
            ids, lps, out = await collect_logprobs(second, name, prompt, SCORED, "t")
            assert out.cached_tokens == 0, name
            # recomputed: what a cold engine gives, up to llama.cpp's batch variance
            cold_ids, cold_lps, _ = cold[name]
            assert_same_up_to_near_tie(cold_ids, cold_lps, ids, lps)
        stats = second.stats()
    finally:
        second.shutdown()
    assert stats.kv_disk_hits == 0
    assert stats.kv_disk_rejected == len(prompts)
    # the spoiled files went; the recomputed prefixes were saved again, except the one
    # llama.cpp refused under this very fingerprint
    assert stats.kv_disk_blocks_written == len(prompts) - 1


async def test_an_unwritable_path_keeps_serving_and_counts_a_write_error(
    plain, model_path, tmp_path
):
    blocker = tmp_path / "kv"
    blocker.write_text("a file where the tier's directory should be")
    prompt = plain.tokenize("Three facts about the moon, each in one sentence. " * 6)
    ref, _, _ = await collect(plain, "ref", prompt, GREEDY, "ref")
    engine = engine_on(model_path, blocker)
    try:
        ids, _, out = await collect(engine, "x", prompt, GREEDY, "t")
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert ids[:2] == ref[:2] and out.finish_reason is not None
    assert stats.kv_disk_write_errors == 1 and stats.kv_disk_blocks_written == 0


async def test_the_gateway_bills_restored_tokens_as_cached_and_reports_the_tier(tmp_path):
    # the secret as the gateway's lifecycle passes it to an in-process engine
    options = {**OPTIONS, "kv_disk_path": str(tmp_path), "kv_disk_gb": 1, "kv_tier_secret": SECRET}
    backend = build_backend(BackendSpec(name="local", type="local", options=options))
    prompt = None
    try:
        for round_ in ("cold", "warm"):  # a stop and a start between: a new engine
            await backend.start()
            prompt = prompt or backend.engine.tokenize("Name the planets in order. " * 10)
            request = GenRequest(round_, DEFAULT_MODEL_ID, prompt, GREEDY, "t1", "s1")
            last = [c async for c in backend.generate(request)][-1]
            extra = backend.stats().extra
            await backend.stop()
        assert last.usage.cached_tokens == saved_len(prompt)
        assert extra["kv_disk_hits"] == saved_len(prompt)
        assert extra["kv_disk_blocks"] == 1 and extra["kv_disk_bytes"] > 0
        assert extra["kv_disk_blocks_written"] == 0  # this engine's: the first wrote it
        assert extra["kv_disk_rejected"] == extra["kv_disk_write_errors"] == 0
    finally:
        with contextlib.suppress(BackendError):
            await backend.stop()
