"""A gateway restarted over the same disk tier re-warms its pins from disk: the pin's
prefill at start-up loads the blocks instead of computing them, and the tenant's first
request after the restart is a cache hit; another tenant's is not."""

from __future__ import annotations

import pytest

from gateway.backends import BackendSpec
from tests.backend_gpu.tiny_models import save_tiny_model
from tests.gateway.test_prefixes import SYSTEM, cached, call, eventually, stop


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("tiers-model")))


async def test_pins_are_rewarmed_from_the_disk_tier_after_a_restart(
    make_gateway, tiny_llama, tmp_path
) -> None:
    options = {"seed": 1, "kv_disk_path": str(tmp_path / "kv")}
    backends = [BackendSpec("tiny", "gpu", tiny_llama, "tiny", options)]
    gw = await make_gateway(backends)
    _, key_a = await gw.tenant("a")
    _, key_b = await gw.tenant("b")
    status, pin = await call(gw, "POST", "/v1/prefixes", key_a, {"name": "support", "text": SYSTEM})
    assert status == 201, pin
    await stop(gw)

    gw = await make_gateway(backends)  # same database, same disk tier, a fresh engine
    (backend,) = gw.state.router.backends

    def disk_hits() -> int:
        return backend.stats().extra.get("kv_disk_hits", 0)

    assert await eventually(disk_hits, lambda hits: hits >= 16) >= 16  # the pin's blocks
    assert await cached(gw, key_a, "The first request after the restart?") > 0
    assert await cached(gw, key_b, "Someone else's?") == 0
