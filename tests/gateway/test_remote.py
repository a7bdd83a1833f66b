"""`type = "remote"` backends on real processes: a `kvgate serve` in front of
llama-cpp-python's own server (a third-party upstream, with the gateway's tokenizer)
and in front of two `kvgate worker`s, the `openai` client as the caller.

Through either, a tenant's quotas hold and its usage rows add up to what the client was
told; where the upstream sends no usage the rows say the gateway counted.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.backends.default_model import default_model_path
from tests.conftest import LiveGateway, free_port, start_gateway
from tests.gateway.upstream_servers import llama_cpp_python_server

MODEL = "remote-model"
TOKEN = "worker-token-" + "x" * 20
PROMPT = "The capital of France is"


def remote_config(urls: list[str], **options: object) -> str:
    """A config with one remote entry over `urls`, quick to notice failures; an option
    given as None is left out."""
    opts = {
        "urls": urls,
        "context_length": 4096,
        "health_interval_s": 0.3,
        "read_timeout_s": 1.5,
        "connect_timeout_s": 1,
    } | options
    head = ["[[backends]]", 'name = "up"', 'type = "remote"', f'model = "{MODEL}"']
    body = [f"{k} = {json.dumps(v)}" for k, v in opts.items() if v is not None]
    return "\n".join([*head, "[backends.options]", *body])


def backend_health(gw: LiveGateway) -> dict[str, bool]:
    data = httpx.get(gw.url + "/admin/backends", headers=gw.admin_headers).json()["data"]
    return {b["name"]: b["healthy"] for b in data}


def name_of(gw: LiveGateway, port: int) -> str:
    return next(n for n in backend_health(gw) if n.endswith(f":{port}"))


def wait_until(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def start_worker(tmp_path: Path, port: int, tokens_per_second: int = 50) -> subprocess.Popen:
    """A real `kvgate worker` of the fake engine that needs TOKEN."""
    log = tmp_path / f"worker-{port}.log"
    options = json.dumps({"tokens_per_second": tokens_per_second})
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "worker",
        "--backend",
        "fake",
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--worker-token",
        TOKEN,
        "--options",
        options,
    ]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "listening on" in log.read_text() or proc.poll() is not None, "up")
        assert proc.poll() is None, log.read_text()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


@contextlib.contextmanager
def gateway_over_workers(
    tmp_path: Path, n: int, healthy: bool = True, **options: object
) -> Iterator[tuple[LiveGateway, list[int], list[subprocess.Popen]]]:
    """n real workers and a gateway with a remote entry over them (waiting until every
    replica is healthy); every process is ended afterwards, also the ones a test adds
    to the list."""
    ports = [free_port() for _ in range(n)]
    workers: list[subprocess.Popen] = []
    gw = None
    try:
        for port in ports:
            workers.append(start_worker(tmp_path, port))
        urls = [f"http://127.0.0.1:{p}/v1" for p in ports]
        gw = start_gateway(tmp_path, config=remote_config(urls, **{"api_key": TOKEN} | options))
        if healthy:
            wait_until(lambda: all(backend_health(gw).values()), "every worker is healthy")
        yield gw, ports, workers
    finally:
        if gw is not None:
            gw.stop()
        for w in workers:
            w.kill()
            w.wait()


def worker_stats(port: int) -> dict:
    return httpx.get(
        f"http://127.0.0.1:{port}/kvgate/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"}
    ).json()


def usage_rows(tmp_path: Path, tenant_id: str) -> list[tuple]:
    db = sqlite3.connect(tmp_path / "kvgate.db")
    return db.execute(
        "SELECT prompt_tokens, completion_tokens, status, counted_by FROM "
        "usage_records WHERE tenant_id = ? ORDER BY id",
        (tenant_id,),
    ).fetchall()


# -- llama-cpp-python's server -----------------------------------------------------------


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory) -> Iterator[str]:
    with llama_cpp_python_server(tmp_path_factory.mktemp("llama"), MODEL) as url:
        yield url


@pytest.fixture(scope="module")
def llama_gateway(tmp_path_factory, llama_server) -> Iterator[tuple[LiveGateway, Path]]:
    tmp = tmp_path_factory.mktemp("gateway")
    config = remote_config(
        [llama_server + "/v1"],
        context_length=2048,
        tokenizer=str(default_model_path()),
        read_timeout_s=60,
    )
    gw = start_gateway(tmp, config=config, timeout=300)  # the first run converts the tokenizer
    try:
        wait_until(lambda: all(backend_health(gw).values()), "the upstream is healthy")
        yield gw, tmp
    finally:
        gw.stop()


def test_llama_cpp_server_upstream_keeps_quotas_and_usage(llama_server, llama_gateway):
    gw, tmp = llama_gateway
    tenant, key = gw.tenant_key("llama", rpm=2)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    first_minute = int(time.time() // 60)  # rpm counts per UTC minute
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    # the same request sent straight to it: the gateway's prompt and sampling arrived as sent
    direct = httpx.post(
        llama_server + "/v1/completions",
        timeout=120,
        json={
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "top_k": 0,
            "top_p": 1,
            "min_p": 0,
            "repeat_penalty": 1,
        },
    ).json()
    assert comp.choices[0].text == direct["choices"][0]["text"]
    assert comp.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
    assert comp.usage.completion_tokens == direct["usage"]["completion_tokens"]

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert 0 < usage.completion_tokens <= 6
    # rendered in Gemma's turn format (the GGUF has no template), as llama.cpp tokenizes it
    turn = "<start_of_turn>user\nSay hello.<end_of_turn>\n<start_of_turn>model\n"
    tokens = httpx.post(llama_server + "/extras/tokenize", json={"input": turn}).json()["tokens"]
    assert usage.prompt_tokens == len(tokens)
    expected = [
        (comp.usage.prompt_tokens, comp.usage.completion_tokens, 200, "gateway"),
        (usage.prompt_tokens, usage.completion_tokens, 200, "gateway"),
    ]
    if int(time.time() // 60) == first_minute:
        with pytest.raises(openai.RateLimitError):  # rpm = 2, both used this minute
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    else:  # a slow machine crossed into the next minute: its window admits the third
        third = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        expected.append((third.usage.prompt_tokens, third.usage.completion_tokens, 200, "gateway"))

    # no usage from llama-cpp-python: the gateway counted, and the rows say so
    assert usage_rows(tmp, tenant["id"]) == expected
    total = httpx.get(
        gw.url + "/admin/usage", params={"tenant_id": tenant["id"]}, headers=gw.admin_headers
    ).json()["total"]
    assert total["completion_tokens"] == sum(row[1] for row in expected)


def test_logit_bias_reaches_a_llama_cpp_server_upstream(llama_server, llama_gateway):
    gw, _ = llama_gateway
    _, key = gw.tenant_key("llama-bias")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    _, banana = httpx.post(llama_server + "/extras/tokenize", json={"input": " banana"}).json()[
        "tokens"
    ]
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert "banana" not in client.completions.create(**ask).choices[0].text
    text = client.completions.create(**ask, logit_bias={str(banana): 100}).choices[0].text
    want = httpx.post(llama_server + "/extras/detokenize", json={"tokens": [banana] * 3}).json()
    assert text == want["text"]
    # the gateway holds the model's tokenizer: it judges ids before the upstream sees them
    with pytest.raises(openai.BadRequestError, match="logit_bias has token ids outside"):
        client.completions.create(**ask, logit_bias={"9999999": 1})


# -- kvgate workers --------------------------------------------------------------------


@pytest.fixture
def two_workers(tmp_path) -> Iterator[tuple[LiveGateway, list[int]]]:
    # no context_length: it is read from the workers
    with gateway_over_workers(tmp_path, 2, context_length=None) as (gw, ports, _):
        yield gw, ports


def test_two_workers_serve_through_the_gateway(two_workers, tmp_path):
    gw, ports = two_workers
    assert set(backend_health(gw)) == {f"up@127.0.0.1:{p}" for p in ports}
    tenant, key = gw.tenant_key("acme")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    [model] = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()[
        "data"
    ]
    assert (model["id"], model["max_model_len"]) == (MODEL, 4096)  # the workers' own
    comps = [
        client.completions.create(model=MODEL, prompt=f"hello {i} there", max_tokens=3)
        for i in range(4)
    ]
    assert all(worker_stats(p)["prefix_queries"] > 0 for p in ports)  # both served
    # a chat goes through the worker's template: the fake's is "user: ...\nassistant:"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.usage.prompt_tokens == 3
    expected = [(3, 3, 200, "engine")] * 4 + [(3, 2, 200, "engine")]
    assert [c.usage.completion_tokens for c in comps] == [3] * 4
    assert usage_rows(tmp_path, tenant["id"]) == expected


def test_client_hanging_up_aborts_the_request_in_the_worker(two_workers):
    gw, ports = two_workers
    _, key = gw.tenant_key("acme")
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 2000, "stream": True}
    with (
        httpx.Client(base_url=gw.url, timeout=60) as http,
        http.stream(
            "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp,
    ):
        lines = resp.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert sum(worker_stats(p)["running"] for p in ports) == 1
    wait_until(lambda: sum(worker_stats(p)["running"] for p in ports) == 0, "it is aborted")


def test_wrong_worker_token_fails_the_entry_plainly(tmp_path):
    port = free_port()
    worker = start_worker(tmp_path, port)
    try:
        options = {"api_key": "kvg-wrong-token", "context_length": None, "start_timeout_s": 1}
        config = remote_config([f"http://127.0.0.1:{port}/v1"], **options)
        # the entry fails to start (the worker refuses the token): with nothing else to
        # serve, the gateway stops at once and says why
        with pytest.raises(RuntimeError, match="exited early") as failed:
            start_gateway(tmp_path, config=config)
        message = str(failed.value)
        assert "refused the gateway's api_key (HTTP 401)" in message
        assert "nothing to serve" in message and "Traceback" not in message
    finally:
        worker.kill()
        worker.wait()


def test_worker_refusal_reaches_the_client_as_its_400(tmp_path):
    # the gateway believes in a longer context than the worker has: the worker refuses
    with gateway_over_workers(tmp_path, 1, context_length=100_000) as (gw, _, _):
        _, key = gw.tenant_key("acme")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="a b c", max_tokens=5000)
        # rebuilt from the worker's numbers (its context, the prompt, the tokens asked)
        assert "maximum context length is 4096 tokens, but the prompt has 3 tokens and 5000" in (
            e.value.message
        )
