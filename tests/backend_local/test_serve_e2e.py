"""`kvgate serve` with the local backend and the default model, driven by the openai client."""

import httpx
import openai
import pytest

from gateway.backends.default_model import DEFAULT_MODEL_ID
from tests.conftest import start_gateway

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"

CONFIG = """
[[backends]]
name = "local"
type = "local"
options = { n_ctx = 1024, n_parallel = 2, n_batch = 128, n_threads = 1 }
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, model_path):
    gw = start_gateway(tmp_path_factory.mktemp("serve-local"), config=CONFIG, timeout=120)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def client(gateway):
    _, key = gateway.tenant_key("local-e2e")
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def test_models_lists_the_default_model(client):
    assert DEFAULT_MODEL_ID in [m.id for m in client.models.list()]


def test_chat_gets_a_real_reply_streamed_and_not(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=messages, max_tokens=24, temperature=0
    )
    text = reply.choices[0].message.content
    assert text.strip() and "<end_of_turn>" not in text
    assert reply.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # Not asserted equal to `text`: the reused prefix leaves only the last prompt token to
    # compute, in a batch of one, and llama.cpp's CPU kernels are not batch-invariant.
    assert streamed.strip() and "<end_of_turn>" not in streamed
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    # The second identical request found its prompt in the KV cells of the first.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completion_stops_at_a_stop_string(client):
    prompt = "one, two, three, four,"
    full = client.completions.create(
        model=DEFAULT_MODEL_ID, prompt=prompt, max_tokens=16, temperature=0
    ).choices[0]
    assert len(full.text) >= 8
    stop = full.text[5:8]
    cut = client.completions.create(
        model=DEFAULT_MODEL_ID, prompt=prompt, max_tokens=16, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_prompt_longer_than_the_context_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=DEFAULT_MODEL_ID, prompt="word " * 600, max_tokens=8)
    assert "context length" in str(info.value)
    reply = client.completions.create(model=DEFAULT_MODEL_ID, prompt="Hello", max_tokens=4)
    assert reply.choices[0].text  # still serving


def test_another_tenant_gets_no_cached_tokens_from_this_ones_prompt(gateway, client):
    prompt = "Internal notes of tenant A: the launch moves to May; tell nobody. " * 3
    ask = dict(model=DEFAULT_MODEL_ID, prompt=prompt, max_tokens=2, temperature=0)
    client.completions.create(**ask)
    again = client.completions.create(**ask)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # A reuses its own cells
    _, key = gateway.tenant_key("local-e2e-other")
    other = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
    reply = other.completions.create(**ask)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # B never hits A's cells
    assert reply.usage.prompt_tokens == again.usage.prompt_tokens


def token_ids(gateway, client, text: str) -> list[int]:
    """The ids /tokenize gives `text`, without the BOS it puts first."""
    r = httpx.post(
        gateway.url + "/tokenize",
        json={"model": DEFAULT_MODEL_ID, "prompt": text},
        headers={"Authorization": f"Bearer {client.api_key}"},
    )
    assert r.status_code == 200, r.text
    return r.json()["tokens"][1:]


def detokenize(gateway, client, ids: list[int]) -> str:
    r = httpx.post(
        gateway.url + "/detokenize",
        json={"model": DEFAULT_MODEL_ID, "tokens": ids},
        headers={"Authorization": f"Bearer {client.api_key}"},
    )
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_logit_bias_forces_a_token_and_logprobs_stay_the_models(gateway, client):
    (banana,) = token_ids(gateway, client, " banana")
    forced = {str(banana): 100}
    comp = client.completions.create(
        model=DEFAULT_MODEL_ID,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=1,
        logit_bias=forced,
    ).choices[0]
    assert comp.text == detokenize(gateway, client, [banana] * 4)
    assert len(set(comp.logprobs.tokens)) == 1 and "".join(comp.logprobs.tokens) == comp.text
    # the model's own logprob, not the biased one (near 0): banana is no capital
    assert comp.logprobs.token_logprobs[0] < -1
    chat = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=3,
        temperature=0.8,
        seed=3,
        logit_bias=forced,
    )
    assert chat.choices[0].message.content == detokenize(gateway, client, [banana] * 3)
    assert chat.usage.completion_tokens == 3


@pytest.mark.parametrize(
    "logit_bias",
    [
        {"abc": 1},
        {"-1": 1},
        {"5": 101},
        {str(i): 1 for i in range(1025)},
        {"5": 1, "05": -1},  # one token twice
        {str(2**31 - 1): 1},  # past the vocabulary
        {"5": 1, "10000000": -1},
    ],
)
def test_bad_logit_bias_is_a_400_naming_it(client, logit_bias):
    ask = dict(model=DEFAULT_MODEL_ID, max_tokens=2, logit_bias=logit_bias)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(prompt=PROMPT, **ask)
    assert "logit_bias" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **ask)
    assert "logit_bias" in info.value.message


def test_echo_with_logprobs_scores_a_continuation_as_lm_eval_does(gateway, client):
    """lm-eval's loglikelihood request: echo, logprobs and max_tokens 1 over context +
    continuation; the continuation token's logprob among the prompt's equals the logprob
    the engine reports for that token generated after the context alone (forced by a
    bias, which leaves logprobs the model's own), up to llama.cpp's batch drift."""
    (paris,) = token_ids(gateway, client, " Paris")
    scored = client.completions.create(
        model=DEFAULT_MODEL_ID,
        prompt=PROMPT + " Paris",
        max_tokens=1,
        temperature=0,
        logprobs=2,
        echo=True,
    )
    choice = scored.choices[0]
    lp = choice.logprobs
    prompt_tokens = scored.usage.prompt_tokens
    assert choice.text.startswith(PROMPT + " Paris")
    assert len(lp.tokens) == len(lp.token_logprobs) == prompt_tokens + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert "".join(lp.tokens[1:prompt_tokens]) == PROMPT + " Paris"  # after BOS
    assert lp.text_offset == sorted(lp.text_offset)
    generated = client.completions.create(
        model=DEFAULT_MODEL_ID,
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        logprobs=1,
        logit_bias={str(paris): 100},
    ).choices[0]
    assert generated.logprobs.tokens == [" Paris"]
    paris_in_prompt = lp.token_logprobs[prompt_tokens - 1]
    assert abs(paris_in_prompt - generated.logprobs.token_logprobs[0]) < 0.25
    # streamed: the echo first, with the prompt's logprobs
    stream = client.completions.create(
        model=DEFAULT_MODEL_ID, prompt=PROMPT, max_tokens=2, logprobs=0, echo=True, stream=True
    )
    chunks = [c.choices[0] for c in stream]
    assert chunks[0].text == PROMPT and chunks[0].logprobs.token_logprobs[0] is None
    assert len(chunks[0].logprobs.tokens) == len(token_ids(gateway, client, PROMPT)) + 1
    assert "".join(c.text for c in chunks).startswith(PROMPT) and len(chunks) >= 3
