"""OpenTelemetry traces from real processes into a real OTLP receiver: a `kvgate serve`
(the fake backend in process, behind a fair queue, and a `kvgate worker` behind a remote
entry) exporting over OTLP/HTTP to studies/otlp_collector.py, the `openai` client as
the caller sending a W3C traceparent.

Each request's server span continues the client's trace, with a child per step
(authentication, admission, routing, the engine call and its fair-queue wait); through a worker, the worker's spans join the same trace under the gateway's
call. The GenAI attributes agree with what the client was told, and nothing that was
exported holds the API key, the prompt or the completion.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.backends import BackendSpec, GenRequest, SamplingParams
from gateway.observe.tracing import GRPC, HTTP_PROTOBUF, TraceExport, Tracing, trace_export
from gateway.worker_pool.supervisor import WorkerSupervisor
from studies.harness import start_worker
from studies.otlp_collector import GrpcCollector, HttpCollector, ReceivedSpan
from tests.conftest import LiveGateway, start_gateway

TOKEN = "worker-token-" + "w" * 32
PROMPT = "The secret plan: meet at the blue door at nine."
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # ms between exports: the tests wait less
STEPS = {"kvgate.authenticate", "kvgate.admission", "kvgate.route"}


@pytest.fixture(scope="module")
def collector() -> Iterator[HttpCollector]:
    with HttpCollector() as c:
        yield c


@pytest.fixture(scope="module")
def traced(tmp_path_factory, collector: HttpCollector) -> Iterator[LiveGateway]:
    """A gateway traced through the standard variables, its worker through the flag."""
    workdir = tmp_path_factory.mktemp("tracing")
    worker = start_worker(
        workdir,
        "worker",
        TOKEN,
        *("--backend", "fake", "--served-model-name", "worker-model"),
        *("--otlp-traces-endpoint", collector.url),
        env=FAST_EXPORT,
    )
    config = f"""
[[backends]]
name = "fake"
type = "fake"
served_model_name = "fake-model"
[backends.options]
max_in_flight = 2

[[backends]]
name = "embed"
type = "fake"
served_model_name = "embed-model"
[backends.options]
task = "embed"

[[backends]]
name = "w"
type = "remote"
model = "worker-model"
[backends.options]
url = "{worker.url}/v1"
api_key = "{TOKEN}"
"""
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.url} | FAST_EXPORT
    try:
        gw = start_gateway(workdir, extra_env=env, config=config)
        try:
            yield gw
        finally:
            gw.stop()
    finally:
        worker.stop()


def _caller(gw: LiveGateway, tenant_name: str) -> tuple[dict, str, openai.OpenAI]:
    """A new tenant, its key, and the `openai` client calling the gateway with it."""
    tenant, key = gw.tenant_key(tenant_name)
    return tenant, key, openai.OpenAI(base_url=gw.url + "/v1", api_key=key)


def _traceparent() -> tuple[str, str, str]:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent}-01", trace_id, parent


def _trace(collector: HttpCollector, trace_id: str, *names: str) -> dict[str, ReceivedSpan]:
    """The trace's spans by name, once every one of `names` has come."""

    def done(spans: list[ReceivedSpan]) -> bool:
        return set(names) <= {s.name for s in spans if s.trace_id == trace_id}

    spans = collector.wait_for(done)
    mine = [s for s in spans if s.trace_id == trace_id]
    return {s.name: s for s in mine}


def _assert_no_secrets(collector: HttpCollector, *secrets_: str) -> None:
    """Nothing any process exported holds any of them, in any field."""
    for body in collector.bodies:
        for secret in secrets_:
            assert secret.encode() not in body, f"{secret[:12]}... was exported"


def test_a_request_continues_the_clients_trace_step_by_step(
    traced: LiveGateway, collector: HttpCollector
) -> None:
    tenant, key, client = _caller(traced, "traced")
    header, trace_id, client_span = _traceparent()
    resp = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        extra_headers={"traceparent": header},
    )
    spans = _trace(collector, trace_id, "POST /v1/chat/completions", "chat fake-model")
    root = spans["POST /v1/chat/completions"]
    assert (root.kind, root.parent_id, root.service) == ("server", client_span, "kvgate")
    for name in STEPS | {"chat fake-model"}:
        assert spans[name].parent_id == root.span_id, name
    call = spans["chat fake-model"]
    assert call.kind == "client"
    assert spans["kvgate.queue"].parent_id == call.span_id  # the fair queue's wait
    usage = resp.usage
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.request.model"] == "fake-model"
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.response.id"] == resp.id
    assert root.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert root.attributes["gen_ai.usage.cache_read.input_tokens"] == 0
    assert root.attributes["gen_ai.latency.time_to_first_token"] > 0
    assert root.attributes["kvgate.tenant.id"] == tenant["id"]
    assert call.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert call.attributes["gen_ai.response.finish_reasons"] == (resp.choices[0].finish_reason,)
    route = spans["kvgate.route"]
    assert route.attributes["kvgate.replica"] == call.attributes["kvgate.replica"] == "fake"
    assert route.attributes["kvgate.route.reason"] == "the only healthy replica"
    assert not any(s.error for s in spans.values())
    # a wrong key: a new trace, its authentication failed by status, the key nowhere
    bad_key = "sk-not-a-key-" + secrets.token_hex(8)
    r = httpx.post(
        traced.url + "/v1/chat/completions",
        json={"model": "fake-model", "messages": [{"role": "user", "content": PROMPT}]},
        headers={"Authorization": f"Bearer {bad_key}"},
    )
    assert r.status_code == 401

    def refused(spans: list[ReceivedSpan]) -> bool:
        return any(s.name == "kvgate.authenticate" and s.error for s in spans)

    auth = next(s for s in collector.wait_for(refused) if s.error)
    assert auth.attributes["error.type"] == "401"
    _assert_no_secrets(collector, key, bad_key, PROMPT, resp.choices[0].message.content)


def test_a_workers_spans_join_the_gateways_trace(
    traced: LiveGateway, collector: HttpCollector
) -> None:
    tenant, key, client = _caller(traced, "through-worker")
    header, trace_id, _ = _traceparent()
    stream = client.completions.create(
        model="worker-model",
        prompt=PROMPT,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"traceparent": header},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = chunks[-1].usage
    gen = "POST /kvgate/v1/generate"
    spans = _trace(collector, trace_id, "POST /v1/completions", "text_completion worker-model", gen)
    call, served = spans["text_completion worker-model"], spans[gen]
    assert (served.service, served.kind) == ("kvgate-worker", "server")
    assert served.parent_id == call.span_id  # the traceparent the remote adapter sent
    assert served.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert served.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert served.attributes["kvgate.tenant.id"] == tenant["id"]
    assert call.attributes["kvgate.replica"].startswith("w@")
    # rendering asked the worker's /tokenize, within the gateway's request
    tokenize = _trace(collector, trace_id, "POST /tokenize")["POST /tokenize"]
    assert tokenize.parent_id == spans["POST /v1/completions"].span_id
    _assert_no_secrets(collector, key, PROMPT, text, TOKEN)


def test_an_embedding_request_is_traced_without_its_input(
    traced: LiveGateway, collector: HttpCollector
) -> None:
    tenant, key, client = _caller(traced, "embedder")
    header, trace_id, _ = _traceparent()
    resp = client.embeddings.create(
        model="embed-model", input=PROMPT, extra_headers={"traceparent": header}
    )
    spans = _trace(collector, trace_id, "POST /v1/embeddings", "embeddings embed-model")
    call, root = spans["embeddings embed-model"], spans["POST /v1/embeddings"]
    for name in ("kvgate.authenticate", "kvgate.admission", "embeddings embed-model"):
        assert spans[name].parent_id == root.span_id, name
    assert call.attributes["gen_ai.usage.input_tokens"] == resp.usage.prompt_tokens
    assert call.attributes["kvgate.tenant.id"] == tenant["id"]
    _assert_no_secrets(collector, key, PROMPT)


def test_a_trace_the_client_does_not_sample_is_not_exported_anywhere(
    traced: LiveGateway, collector: HttpCollector
) -> None:
    _, _, client = _caller(traced, "unsampled")
    gen = "POST /kvgate/v1/generate"
    generated = len([s for s in collector.spans if s.name == gen])
    unsampled, _, _ = _traceparent()
    sampled, trace_id, _ = _traceparent()
    for header in (unsampled.removesuffix("-01") + "-00", sampled):
        client.completions.create(
            model="worker-model", prompt="hi", max_tokens=2, extra_headers={"traceparent": header}
        )
    # spans go out in order: once the later trace came from both processes, the first
    # would have too
    _trace(collector, trace_id, "POST /v1/completions", gen)
    assert not [s for s in collector.spans if s.trace_id == unsampled.split("-")[1]]
    # nor did the worker start a trace of its own: it was told "not sampled" too
    assert len([s for s in collector.spans if s.name == gen]) == generated + 1


async def test_supervised_workers_trace_where_the_gateway_does(collector: HttpCollector) -> None:
    """`serve --workers N` hands its trace endpoint (flag, file or variable) to its workers."""
    spec = BackendSpec("fake", "fake", "", "m")
    sup = WorkerSupervisor(spec, 1, env={"KVGATE_OTLP_TRACES_ENDPOINT": collector.url})
    await sup.start()
    try:
        header, trace_id, parent = _traceparent()
        req = GenRequest("r-1", "m", [1, 2, 3], SamplingParams(max_tokens=2))
        headers = {"Authorization": f"Bearer {sup.token}", "traceparent": header}
        async with httpx.AsyncClient(timeout=30) as http:
            url = sup.urls[0].removesuffix("/v1") + "/kvgate/v1/generate"
            r = await http.post(url, json=req.to_dict(), headers=headers)
            assert r.status_code == 200, r.text
    finally:
        await sup.stop()
    served = _trace(collector, trace_id, "POST /kvgate/v1/generate")["POST /kvgate/v1/generate"]
    assert (served.service, served.parent_id) == ("kvgate-worker", parent)


def test_tracing_is_off_unless_an_endpoint_is_configured() -> None:
    assert trace_export(None, "kvgate", {}) is None
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert trace_export(None, "kvgate", on) == TraceExport(None, HTTP_PROTOBUF, "kvgate")
    assert trace_export(None, "kvgate", on | {"OTEL_SDK_DISABLED": "true"}) is None
    assert trace_export(None, "kvgate", on | {"OTEL_TRACES_EXPORTER": "none"}) is None
    named = {"OTEL_SERVICE_NAME": "gw-eu", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}
    assert trace_export("http://c:4317", "kvgate", named) == TraceExport(
        "http://c:4317", GRPC, "gw-eu"
    )
    with pytest.raises(ValueError, match="http/json"):
        trace_export("http://c:4318", "kvgate", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


async def test_spans_go_out_over_grpc() -> None:
    with GrpcCollector() as collector:
        tracing = Tracing(TraceExport(collector.endpoint, GRPC, "kvgate"))
        with tracing.step("kvgate.authenticate") as span:
            span.set_attribute("kvgate.tenant.id", "t-1")
        await tracing.close()  # exports what is buffered
        [span] = collector.wait_for(lambda spans: bool(spans))
    assert (span.name, span.service, span.attributes) == (
        "kvgate.authenticate",
        "kvgate",
        {"kvgate.tenant.id": "t-1"},
    )


async def test_the_standard_sampler_variables_choose_the_traces(
    monkeypatch: pytest.MonkeyPatch, collector: HttpCollector
) -> None:
    """OTEL_TRACES_SAMPLER(_ARG): a ratio of 0 starts no trace of its own, yet a caller's
    sampled trace is continued (parent-based), its steps with it."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    tracing = Tracing(TraceExport(collector.url, HTTP_PROTOBUF, "sampler-test"))
    header, trace_id, parent = _traceparent()
    try:
        with tracing.server_span("GET /own", {}, {}) as own:
            assert not own.is_recording()
            with tracing.step("kvgate.own-step") as step:
                assert not step.is_recording()
        with tracing.server_span("GET /continued", {"traceparent": header}, {}) as root:
            assert root.is_recording()
            with tracing.step("kvgate.authenticate"):
                pass
    finally:
        await tracing.close()  # exports what is buffered, the unsampled too were there any
    spans = _trace(collector, trace_id, "GET /continued", "kvgate.authenticate")
    assert (spans["GET /continued"].parent_id, spans["GET /continued"].service) == (
        parent,
        "sampler-test",
    )
    assert spans["kvgate.authenticate"].parent_id == spans["GET /continued"].span_id
    assert not {"GET /own", "kvgate.own-step"} & {s.name for s in collector.spans}


def test_the_config_file_turns_tracing_on(tmp_path: Path) -> None:
    from gateway.config_load import load_settings

    cfg = tmp_path / "kvgate.toml"
    cfg.write_text('[server]\notlp_traces_endpoint = "http://collector:4318/v1/traces"\n')
    settings = load_settings(cfg, environ={})
    assert settings.otlp_traces_endpoint == "http://collector:4318/v1/traces"
    env = {"KVGATE_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}
    assert load_settings(environ=env).otlp_traces_endpoint == "http://c:4318/v1/traces"
    with pytest.raises(ValueError, match="PROTOCOL"):
        load_settings(cfg, environ={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "thrift"})
