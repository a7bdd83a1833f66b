"""Special tokens reach the output parsers where they may be markers: a real gateway on
llama.cpp with the packaged SmolLM2 instruct, a tool parser configured. Its chat markers
are special tokens; forced by logit_bias, one is text in a reply that offers tools (the
parser reads it) and no text in one that does not (gateway.serving.sampling.keep_markers)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.conftest import start_gateway

pytestmark = pytest.mark.slow

CONFIG = """
[[backends]]
name = "chat"
type = "local"
model = "smollm2-135m-instruct"
tool_call_parser = "hermes"
n_ctx = 1024
"""
IM_START = 1  # <|im_start|> in SmolLM2's vocabulary: a control token, not an end of turn
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    gw = start_gateway(tmp_path_factory.mktemp("markers"), config=CONFIG, timeout=120)
    _, key = gw.tenant_key("markers")
    yield OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    gw.stop()


def _reply(client: OpenAI, **fields) -> str | None:
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Weather?"}],
        max_tokens=2,
        temperature=0,
        logit_bias={str(IM_START): 100},
        **fields,
    )
    return reply.choices[0].message.content


def test_a_marker_is_text_where_the_tool_parser_reads_it(client):
    assert _reply(client, tools=[TOOL]) == "<|im_start|><|im_start|>"
    assert _reply(client) in ("", None)
    assert _reply(client, tools=[TOOL], tool_choice="none") in ("", None)
    # vLLM's own field asks for the same without tools
    assert _reply(client, extra_body={"skip_special_tokens": False}) == "<|im_start|><|im_start|>"
