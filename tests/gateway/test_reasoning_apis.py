"""Reasoning and tool calls on every API, end to end: a real `kvgate serve` of fake
backends, each with a family's parsers, answering `mock_response` texts written in that
family's format, read by the real `openai` and `anthropic` clients, whole and streamed;
the parsers each backend got (its entry's, the serve flags', none), said in /v1/models
and the start-up lines; a parser name kvgate does not have, refused at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from gateway.config_check import ConfigError
from gateway.config_load import load_settings
from tests.conftest import ADMIN_KEY, LiveGateway, free_port, start_gateway

THOUGHT = "The user wants the weather in Oslo."
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
QWEN3 = f"<think>\n{THOUGHT}\n</think>\n\nLet me check.\n<tool_call>\n{CALL}\n</tool_call>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
ENTRIES = {  # served model -> its entry's parsers
    "qwen": {"reasoning_parser": "qwen3", "tool_call_parser": "hermes"},
    "r1": {"reasoning_parser": "deepseek_r1"},
    "llama": {"tool_call_parser": "llama3_json"},
    "mistral": {"tool_call_parser": "mistral"},
    "plain": {},
}


def config() -> str:
    lines = []
    for name, parsers in ENTRIES.items():
        lines += ["[[backends]]", f'name = "{name}"', 'type = "fake"']
        lines += [f'served_model_name = "{name}"']
        lines += [f'{k} = "{v}"' for k, v in parsers.items()]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[tuple[LiveGateway, str]]:
    tmp = tmp_path_factory.mktemp("reasoning")
    gw = start_gateway(tmp, config=config())
    _, key = gw.tenant_key("acme")
    yield gw, key
    gw.stop()


def client(gw: LiveGateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def test_each_backends_parsers_are_said_at_start_and_in_models(gateway):
    gw, key = gateway
    models = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    said = {m["id"]: m["kvgate"] for m in models.json()["data"]}
    for name, parsers in ENTRIES.items():
        assert said[name]["reasoning_parser"] == parsers.get("reasoning_parser")
        assert said[name]["tool_call_parser"] == parsers.get("tool_call_parser")
        assert said[name]["parsers_from"] == ("configured" if parsers else "none")
    log = gw.log.read_text()
    said = "(configured: reasoning parser qwen3, tool-call parser hermes)"
    assert f"backend qwen (fake) serving: qwen {said}" in log
    assert "backend plain (fake) serving: plain\n" in log  # no parsers: nothing more said


def test_chat_reasoning_and_calls_whole_and_streamed(gateway):
    gw, key = gateway
    c = client(gw, key)
    asked = {"model": "qwen", "messages": ASK, "tools": [WEATHER]}
    reply = c.chat.completions.create(**asked, extra_body={"mock_response": QWEN3})
    message = reply.choices[0].message
    assert message.reasoning == message.reasoning_content == THOUGHT  # type: ignore[attr-defined]
    assert message.content == "Let me check."
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    assert reply.choices[0].finish_reason == "tool_calls"
    details = reply.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < reply.usage.completion_tokens
    # the reply's message sent back as the SDK sends it (its reasoning too), and the result
    result = {"role": "tool", "tool_call_id": call.id, "content": "-3 C"}
    after = c.chat.completions.create(
        model="qwen", messages=[*ASK, message, result], extra_body={"mock_response": "Cold."}
    )
    assert after.choices[0].message.content == "Cold."

    stream = c.chat.completions.create(
        **asked,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"mock_response": QWEN3},
    )
    reasoning, content, calls, finish, usage = [], [], {}, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        said = getattr(delta, "reasoning", None)  # the delta's extra fields, where sent
        assert said == getattr(delta, "reasoning_content", None)
        reasoning.append(said or "")
        content.append(delta.content or "")
        for d in delta.tool_calls or []:
            if d.id is not None:  # a call's first delta: id, type and name
                assert d.type == "function" and d.function.name == "get_weather"
                calls[d.index] = []
            calls[d.index].append(d.function.arguments or "")
    assert "".join(reasoning) == THOUGHT and "".join(content).strip() == "Let me check."
    assert [json.loads("".join(a)) for a in calls.values()] == [{"city": "Oslo"}]
    assert finish == "tool_calls"
    assert usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


def test_other_families(gateway):
    gw, key = gateway
    c = client(gw, key)
    r1 = c.chat.completions.create(
        model="r1", messages=ASK, extra_body={"mock_response": f"{THOUGHT}\n</think>\n\nSunny."}
    )
    assert r1.choices[0].message.reasoning == THOUGHT  # type: ignore[attr-defined]
    assert r1.choices[0].message.content == "Sunny."
    for model, text in (
        ("llama", '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
        ("qwen", QWEN3),
    ):
        reply = c.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER], extra_body={"mock_response": text}
        )
        [call] = reply.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Oslo"}, model
    # no parsers: the text is the answer, and without tools a call is only text
    plain = c.chat.completions.create(
        model="plain", messages=ASK, extra_body={"mock_response": QWEN3}
    )
    assert plain.choices[0].message.content == QWEN3
    assert getattr(plain.choices[0].message, "reasoning", None) is None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0


def test_enable_thinking_false_reads_no_reasoning(gateway):
    gw, key = gateway
    c = client(gw, key)
    text = "<think>hm</think>Hello!"
    on = c.chat.completions.create(model="qwen", messages=ASK, extra_body={"mock_response": text})
    assert on.choices[0].message.reasoning == "hm"  # type: ignore[attr-defined]
    off = c.chat.completions.create(
        model="qwen",
        messages=ASK,
        extra_body={"mock_response": text, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.choices[0].message.content == text
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_messages_thinking_text_and_tool_use_whole_and_streamed(gateway):
    gw, key = gateway
    claude = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    asked = {"model": "qwen", "max_tokens": 256, "messages": ASK, "tools": [tool]}
    whole = claude.messages.create(**asked, extra_body={"mock_response": QWEN3})
    with claude.messages.stream(**asked, extra_body={"mock_response": QWEN3}) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert {"thinking_delta", "signature_delta", "text_delta", "input_json_delta"} <= set(kinds)
    for msg in (whole, final):
        assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
        thinking, text, use = msg.content
        assert thinking.thinking == THOUGHT and thinking.signature
        assert text.text.strip() == "Let me check."
        assert use.name == "get_weather" and use.input == {"city": "Oslo"}
        assert msg.stop_reason == "tool_use"
    assert whole.content[0].signature == final.content[0].signature


def test_reasoning_sent_back_is_taken_and_thinking_turned_off_on_messages(gateway):
    """A client's next turn carries the reply's thinking block, and its reasoning item on
    the Responses API: both are taken (and left out of the prompt); Anthropic's thinking
    "disabled" turns the parser's reasoning off."""
    gw, key = gateway
    claude = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)
    first = claude.messages.create(
        model="qwen", max_tokens=64, messages=ASK, extra_body={"mock_response": QWEN3}
    )
    turns = [*ASK, {"role": "assistant", "content": first.content}]
    turns.append({"role": "user", "content": "And tomorrow?"})
    text = "<think>hm</think>Cold."
    on = claude.messages.create(
        model="qwen", max_tokens=64, messages=turns, extra_body={"mock_response": text}
    )
    assert [b.type for b in on.content] == ["thinking", "text"]
    off = claude.messages.create(
        model="qwen",
        max_tokens=64,
        messages=turns,
        thinking={"type": "disabled"},
        extra_body={"mock_response": text},
    )
    assert [(b.type, b.text) for b in off.content] == [("text", text)]
    c = client(gw, key)
    response = c.responses.create(
        model="qwen", input="Weather in Oslo?", extra_body={"mock_response": QWEN3}
    )
    again = c.responses.create(
        model="qwen",
        input=[*response.output, {"role": "user", "content": "And tomorrow?"}],
        extra_body={"mock_response": text},
    )
    assert [i.type for i in again.output] == ["reasoning", "message"]


def test_responses_reasoning_and_function_call_items_whole_and_streamed(gateway):
    gw, key = gateway
    c = client(gw, key)
    tool = {"type": "function"} | WEATHER["function"]
    asked = {"model": "qwen", "input": "Weather in Oslo?", "tools": [tool]}
    whole = c.responses.create(**asked, extra_body={"mock_response": QWEN3})
    with c.responses.stream(**asked, extra_body={"mock_response": QWEN3}) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_response()
    assert {"response.reasoning_text.delta", "response.function_call_arguments.delta"} <= kinds
    for response in (whole, final):
        assert [i.type for i in response.output] == ["reasoning", "message", "function_call"]
        reasoning, message, call = response.output
        assert reasoning.content[0].text == THOUGHT and reasoning.summary == []
        assert message.content[0].text.strip() == "Let me check."
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
        assert response.usage.output_tokens_details.reasoning_tokens > 0


def test_serve_flags_choose_for_every_backend(tmp_path):
    gw = start_gateway(
        tmp_path, "--backend", "fake", "--reasoning-parser", "deepseek_r1",
        "--tool-call-parser", "pythonic",
    )  # fmt: skip
    try:
        _, key = gw.tenant_key("acme")
        auth = {"Authorization": f"Bearer {key}"}
        models = httpx.get(gw.url + "/v1/models", headers=auth).json()["data"]
        assert models[0]["kvgate"] == {
            "reasoning_parser": "deepseek_r1",
            "tool_call_parser": "pythonic",
            "parsers_from": "configured",
        }
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            headers=auth,
            json={"model": models[0]["id"], "messages": ASK, "mock_response": "hm</think>Hi."},
        )
        assert r.json()["choices"][0]["message"]["reasoning"] == "hm"
    finally:
        gw.stop()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--reasoning-parser", "qwen4"], "reasoning_parser 'qwen4' is not one of: deepseek_r1"),
        (["--tool-call-parser", "json"], "tool_call_parser 'json' is not one of: hermes"),
    ],
)
def test_an_unknown_parser_is_refused_at_start_with_the_valid_ones(tmp_path, flags, named):
    env = dict(os.environ, KVGATE_ADMIN_KEY=ADMIN_KEY)
    env["KVGATE_DATABASE_URL"] = f"sqlite+aiosqlite:///{tmp_path}/kvgate.db"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--backend", "fake"]
    done = subprocess.run(
        [*cmd, "--port", str(free_port()), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and named in done.stderr, done.stderr


def test_an_entrys_parsers_and_the_servers_are_checked_and_resolved(tmp_path):
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(
        config() + '\n[[backends]]\nname = "bad"\ntype = "fake"\ntool_call_parser = "xml"\n'
    )
    with pytest.raises(ConfigError, match="backend 'bad': tool_call_parser 'xml' is not one of"):
        load_settings(cfg, environ={})
    cfg.write_text(config())
    settings = load_settings(cfg, environ={"KVGATE_TOOL_CALL_PARSER": "pythonic"})
    parsers = {
        s.name: (s.reasoning_parser, s.tool_call_parser) for s in settings.resolved_backends()
    }
    assert parsers["qwen"] == ("qwen3", "hermes")  # its own
    assert parsers["r1"] == ("deepseek_r1", "pythonic")  # the server's where it names none
    assert parsers["plain"] == (None, "pythonic")
