"""vLLM's `priority` field (issue 50): an int, lower first, carried in each GenRequest; a
request may only yield (a larger number), never go ahead of its tenant's priority."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from gateway.schemas.inference import ChatCompletionRequest
from gateway.serving.admission import _requests
from gateway.tenancy.auth import Principal
from gateway.tenancy.quota import QuotaLimits

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("asked", "tenant", "sent"), [(None, 2, 2), (5, 2, 5), (-3, 2, 2)])
def test_a_request_priority_only_yields(asked, tenant, sent) -> None:
    body = ChatCompletionRequest.model_validate(
        CHAT | ({} if asked is None else {"priority": asked})
    )
    who = Principal("key_1", "t_1", "acme", ("inference",), QuotaLimits(), None, priority=tenant)
    plan = SimpleNamespace(choices=1, max_tokens=[8])
    card = SimpleNamespace(sampling_defaults={})
    args = ("r-1", body, who, plan, [[1, 2]], "salt", [0], None)
    [req] = _requests(*args, card=card, images=[])  # type: ignore[arg-type]
    assert req.priority == sent


def test_priority_is_validated_at_the_route(live_gateway) -> None:
    _, key = live_gateway.tenant_key("acme")
    with httpx.Client(base_url=live_gateway.url, timeout=30) as http:
        headers = {"Authorization": f"Bearer {key}"}
        bad = http.post("/v1/chat/completions", json=CHAT | {"priority": "high"}, headers=headers)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
        ok = http.post("/v1/chat/completions", json=CHAT | {"priority": 7}, headers=headers)
        assert ok.status_code == 200, ok.text
