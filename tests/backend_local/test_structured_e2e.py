"""Structured outputs and tool calls on the llama.cpp backend with the default Gemma,
through `kvgate serve` and the openai client, with the engine in the gateway's process and
in a `kvgate worker` process (the constraint travels over the worker protocol); a
constrained and a free request share the context's batch. Echo with logprobs too: the
prompt's logprobs travel the same protocol."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from gateway.backends.default_model import DEFAULT_MODEL_ID
from tests.conftest import start_gateway

pytestmark = pytest.mark.slow

# one llama.cpp thread, as the suite's other llama.cpp engines: two meet at a barrier
# after every op and spin there while the suite's other workers hold the second core
# (docs/PERF.md, "The 24 s request": 8.4x slower on a busy machine)
CONFIG = """
[[backends]]
name = "local"
type = "local"
options = { n_ctx = 2048, n_parallel = 2, n_batch = 256, n_threads = 1 }
"""
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {
            "type": "array",
            "items": {"enum": ["English", "French", "German", "Italian"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "languages", "address"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module", params=["in-process", "worker"])
def client(request, tmp_path_factory, model_path):
    flags = ["--workers", "1"] if request.param == "worker" else []
    workdir = tmp_path_factory.mktemp(f"structured-local-{request.param}")
    gw = start_gateway(workdir, *flags, config=CONFIG, timeout=120)
    _, key = gw.tenant_key("structured")
    yield openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    gw.stop()


def test_json_schema_and_choice_beside_a_free_request(client):
    ask = [{"role": "user", "content": "Describe a famous scientist as JSON."}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    with ThreadPoolExecutor(2) as pool:
        constrained = pool.submit(
            client.chat.completions.create,
            model=DEFAULT_MODEL_ID,
            messages=ask,
            max_tokens=120,
            temperature=0,
            response_format=schema_format,
        )
        free = pool.submit(
            client.chat.completions.create,
            model=DEFAULT_MODEL_ID,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=16,
            temperature=0,
        )
        reply, plain = constrained.result(), free.result()
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    assert plain.choices[0].message.content.strip()
    obj = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[
            {
                "role": "user",
                "content": "Return a JSON object with the keys city and country for Rome.",
            }
        ],
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choices = ["positive", "negative", "neutral"]
    picked = client.completions.create(
        model=DEFAULT_MODEL_ID,
        prompt="Review: I loved this film!\nSentiment:",
        max_tokens=8,
        extra_body={"guided_choice": choices},
    )
    assert picked.choices[0].text in choices


def test_a_named_tool_call_streamed_and_not(client):
    fields = dict(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    )
    reply = client.chat.completions.create(**fields)
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(**fields, stream=True))
    arguments = "".join(
        tc.function.arguments or ""
        for c in chunks
        if c.choices
        for tc in c.choices[0].delta.tool_calls or []
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_tool_choice_auto_gives_either_text_or_a_valid_call(client):
    """The model may answer or call: either way the reply is one or the other, whole."""
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": "What is the weather in Paris? Use the tool."}],
        tools=[WEATHER],
        tool_choice="auto",
        max_tokens=60,
        temperature=0,
    )
    choice = reply.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(
                json.loads(call.function.arguments), WEATHER["function"]["parameters"]
            )
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content


def test_a_schema_that_cannot_compile_is_a_400(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}
    with pytest.raises(openai.BadRequestError, match="nowhere"):
        client.chat.completions.create(
            model=DEFAULT_MODEL_ID,
            messages=[{"role": "user", "content": "hi"}],
            response_format=bad,
        )


def test_echo_with_logprobs_comes_through_as_in_process(client):
    """Prompt logprobs cross the worker's wire (GenChunk.prompt_logprobs) as they come
    out of the engine in the gateway's own process."""
    prompt = "The capital of France is Paris"
    done = client.completions.create(
        model=DEFAULT_MODEL_ID, prompt=prompt, max_tokens=1, logprobs=1, echo=True
    )
    lp = done.choices[0].logprobs
    assert done.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == done.usage.prompt_tokens + 1
    assert lp.token_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[1 : done.usage.prompt_tokens]) == prompt
