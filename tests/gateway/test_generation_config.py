"""A model's sampling defaults (gateway.backends.generation_config): read from its files,
overridden by its config entry, applied to what a request leaves out, on every API."""

from __future__ import annotations

import json

import httpx
import pytest

from gateway.backends.default_model import INSTRUCT_MODEL_ID, packaged_sampling
from gateway.backends.generation_config import checked, from_gguf, from_hf_dir
from gateway.config_check import ConfigError
from gateway.config_load import load_settings
from gateway.schemas.messages import MessagesRequest
from gateway.schemas.responses_api import ResponseCreateRequest
from tests.conftest import start_gateway

GREEDY_BY_DEFAULT = """
[[backends]]
name = "fake"
type = "fake"
model = "fake-model"
generation_config = { temperature = 0.0 }
"""


def test_hf_generation_config_gives_its_sampling_keys(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 9})
    )
    assert from_hf_dir(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


@pytest.mark.parametrize(
    "content",
    [
        json.dumps({"temperature": 7, "top_p": 0.0}),  # out of range: left out
        json.dumps({"do_sample": False, "temperature": 0.6}),  # greedy by its own word
        "{not json",
        json.dumps({"temperature": 0.5, "pad": "x" * 70_000}),  # past the file bound
        json.dumps([0.6]),
    ],
)
def test_a_bad_or_greedy_generation_config_gives_nothing(tmp_path, content):
    (tmp_path / "generation_config.json").write_text(content)
    assert from_hf_dir(str(tmp_path)) == {}


def test_gguf_sampling_keys_as_llama_cpp_writes_them():
    meta = {"general.sampling.temp": "0.7", "general.sampling.top_k": "40", "x": "1"}
    assert from_gguf(meta.get) == {"temperature": 0.7, "top_k": 40}
    assert from_gguf({"general.sampling.top_p": "2.5"}.get) == {}


def test_the_packaged_instruct_model_samples_as_its_card_advises():
    assert packaged_sampling(INSTRUCT_MODEL_ID) == {"temperature": 0.2, "top_p": 0.9}
    assert packaged_sampling("/some/model.gguf") == {}


@pytest.mark.parametrize(
    ("table", "words"),
    [("{ temprature = 0.1 }", "unknown key 'temprature'"), ("{ top_p = 0 }", "top_p = 0")],
)
def test_a_bad_override_is_refused_at_load(tmp_path, table, words):
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(GREEDY_BY_DEFAULT.replace("{ temperature = 0.0 }", table))
    with pytest.raises(ConfigError, match=words):
        load_settings(cfg)
    with pytest.raises(ValueError, match="out of range"):
        checked({"top_k": 0}, "here")


@pytest.fixture(scope="module")
def greedy_gateway(tmp_path_factory):
    gw = start_gateway(tmp_path_factory.mktemp("genconf"), config=GREEDY_BY_DEFAULT)
    _, key = gw.tenant_key("genconf")
    yield gw, {"Authorization": f"Bearer {key}"}
    gw.stop()


def _chat(http: httpx.Client, **fields) -> str:
    body = {
        "model": "fake-model",
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "hi"}],
    }
    r = http.post("/v1/chat/completions", json=body | fields)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_a_request_without_temperature_takes_the_models_default(greedy_gateway):
    """The entry makes the model greedy: the seed no longer matters unless the request
    names a temperature of its own (the fake backend's text follows the seed only when
    it samples)."""
    gw, headers = greedy_gateway
    with httpx.Client(base_url=gw.url, headers=headers, timeout=30) as http:
        assert _chat(http, seed=1) == _chat(http, seed=2) == _chat(http, seed=3)
        sampled = {_chat(http, seed=s, temperature=1.0) for s in (1, 2, 3)}
        assert len(sampled) > 1


@pytest.mark.parametrize("given", [{}, {"temperature": 0.5}])
def test_messages_and_responses_leave_it_to_the_model_too(given):
    """Their bodies become a chat body: one that named no temperature names none there
    either, so the model's default applies as on chat (their own default is the same
    1.0 otherwise)."""
    messages = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]} | given
    ).chat
    responses = ResponseCreateRequest.model_validate({"model": "m", "input": "hi"} | given).chat()
    for chat in (messages, responses):
        assert ("temperature" in chat.model_fields_set) == bool(given)
        assert chat.temperature == given.get("temperature", 1.0)
