"""Reasoning before a constrained answer (issue 48.4) on the gpu engine, through the
gateway with the openai client: a tiny random Qwen3 with Qwen3's real chat template
(tests/gateway/fixtures/chat_templates), so that its parsers are detected as a real
Qwen3's are. Its output is noise, steered with logit_bias on `<`: where the grammar lets
a `<think>` block come first the noise goes into it and comes back as reasoning; with
thinking off the same bias cannot start one and the answer is the constrained JSON
from its first token; and where it does not reason, the answer validates."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import pytest
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from gateway.backends import BackendSpec
from tests.backend_gpu.byte_tokens import save_byte_token_model

TEMPLATE = Path(__file__).parent / "fixtures" / "chat_templates" / "qwen3.jinja"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
ASK = [{"role": "user", "content": "Weather in Oslo for two days?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The byte-token tiny Qwen3 with Qwen3's own template in its tokenizer config."""
    path = save_byte_token_model("qwen3", str(tmp_path_factory.mktemp("reasoning")))
    config = os.path.join(path, "tokenizer_config.json")
    with open(config) as f:
        data = json.load(f)
    data["chat_template"] = TEMPLATE.read_text()
    with open(config, "w") as f:
        json.dump(data, f)
    return path


@pytest.fixture
async def gateway(make_gateway, model_dir):
    options = {"max_num_batched_tokens": 256, "seed": 1}
    gw = await make_gateway([BackendSpec("tiny", "gpu", model_dir, "tiny", options)])
    _, key = await gw.tenant("acme")
    lt = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<0x3C>")  # "<"
    return AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0), lt


async def test_the_noise_may_reason_first_and_is_reasoning(gateway):
    client, lt = gateway
    models = await client.models.list()
    assert models.data[0].model_extra["kvgate"]["reasoning_parser"] == "qwen3"  # detected
    asked = {"model": "tiny", "messages": ASK, "max_tokens": 24, "seed": 3}
    toward_think = {"logit_bias": {str(lt): 100}}
    reply = await client.chat.completions.create(
        **asked, response_format=FORMAT, extra_body=toward_think
    )
    message = reply.choices[0].message
    reasoning = message.model_extra.get("reasoning")
    assert reasoning and not message.content and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens_details.reasoning_tokens == reply.usage.completion_tokens
    # thinking off: the same bias meets a grammar that starts at the JSON
    off = await client.chat.completions.create(
        **asked,
        response_format=FORMAT,
        extra_body=toward_think | {"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = off.choices[0].message
    assert message.content.startswith("{") and not message.model_extra.get("reasoning")


async def test_constrained_answers_still_validate(gateway):
    client, lt = gateway
    asked = {"model": "tiny", "messages": ASK, "max_tokens": 120}
    no_think = {"logit_bias": {str(lt): -100}}  # the noise does not open a block
    for seed in range(2):
        reply = await client.chat.completions.create(
            **asked, seed=seed, response_format=FORMAT, extra_body=no_think
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        forced = await client.chat.completions.create(
            **asked, seed=seed, tools=[WEATHER], tool_choice="required", extra_body=no_think
        )
        [call] = forced.choices[0].message.tool_calls
        assert forced.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
