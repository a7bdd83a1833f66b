"""`kvgate serve --models-dir` as Ollama's users expect it, the `ollama` client as the
caller against one real gateway: a directory of three GGUF files (the packaged SmolLM2
135M Instruct twice, under two names, and Gemma 3 270M) listed before anything loads,
each loaded by its first request, at most one resident (--models-max 1: the least
recently used goes), keep_alive 0 unloading and a negative one keeping, /api/ps with
each model's real expiry, a memory budget (0.2 GB) that Gemma's 250 MB file does not
fit, and the directory's files changed by an admin's /api/copy and /api/delete (a
tenant's key: 403) or by hand and a reload. Then a directory of a vision model whose
projector goes with it, by llama-server's router's layout and by name."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import time
from datetime import UTC, datetime, timedelta

import httpx
import ollama
import openai
import pytest

from gateway.backends.default_model import INSTRUCT_MODEL_ID, default_model_path, model_path
from tests.backend_gpu.tiny_models import save_tiny_model
from tests.conftest import ADMIN_KEY, start_gateway

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Say hello."}]
SHORT = {"num_predict": 3, "temperature": 0, "seed": 1}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models")
    smollm2 = model_path(INSTRUCT_MODEL_ID)
    os.symlink(smollm2, directory / "smollm2.gguf")
    os.symlink(smollm2, directory / "smollm2-b.gguf")
    os.symlink(default_model_path(), directory / "gemma3.gguf")
    save_tiny_model("llama", str(directory))  # a Hugging Face directory: the gpu backend's
    return directory


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, models):
    args = ["--models-dir", str(models), "--models-max", "1", "--models-memory-gb", "0.2"]
    args += ["--n-ctx", "512", "--n-parallel", "1", "--n-threads", "1"]
    gw = start_gateway(tmp_path_factory.mktemp("models-dir"), *args, timeout=120)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def client(gateway) -> ollama.Client:
    _, key = gateway.tenant_key("models-dir")
    return ollama.Client(host=gateway.url, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="module")
def admin(gateway) -> ollama.Client:
    return ollama.Client(host=gateway.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})


def loaded(client: ollama.Client) -> list[str]:
    return sorted(m.model for m in client.ps().models)


def test_listed_before_any_load_then_loaded_by_its_first_request(client, gateway):
    names = {m.model for m in client.list().models}
    assert names == {"smollm2:latest", "smollm2-b:latest", "gemma3:latest", "tiny-llama:latest"}
    assert loaded(client) == []  # nothing loaded by listing
    openai = httpx.get(f"{gateway.url}/v1/models", headers=client._client.headers).json()
    assert {m["id"] for m in openai["data"]} == {"smollm2", "smollm2-b", "gemma3", "tiny-llama"}
    (listed,) = [m for m in openai["data"] if m["id"] == "smollm2"]
    assert listed["max_model_len"] == 512  # --n-ctx 512 --n-parallel 1, before it loads
    # the output parsers are chosen once a model is up, not guessed (and kept) before
    assert "detecting the output parsers" not in gateway.log.read_text()
    first = client.chat("smollm2", HI, stream=False, options=SHORT)
    assert first.done and first.eval_count == 3 and first.load_duration > 0
    again = client.chat("smollm2", HI, stream=False, options=SHORT)
    assert again.load_duration == 0 and again.message.content == first.message.content
    (ps,) = client.ps().models
    assert ps.model == "smollm2:latest" and ps.context_length == 512
    # Ollama's default keep-alive: five minutes from the last request
    expected = datetime.now(UTC) + timedelta(minutes=5)
    assert abs((ps.expires_at - expected).total_seconds()) < 60


def test_models_max_unloads_the_least_recently_used(client):
    client.chat("smollm2", HI, stream=False, options=SHORT)
    assert loaded(client) == ["smollm2:latest"]
    streamed = list(client.chat("smollm2-b", HI, stream=True, options=SHORT))
    assert streamed[-1].done and streamed[-1].load_duration > 0
    assert loaded(client) == ["smollm2-b:latest"]  # --models-max 1: smollm2 went
    back = client.chat("smollm2", HI, stream=False, options=SHORT)
    assert back.load_duration > 0 and loaded(client) == ["smollm2:latest"]


def test_a_load_runs_beside_the_event_loop(client, gateway):
    """The gateway answers while a model loads (the load is in a thread): /api/ps shows
    the load begun (a model is listed from its load's start) and then /admin/backends
    its engine not loaded yet (and not a failure: healthy), two answers made inside the
    load. A stalled event loop would answer neither until the load was done."""
    client.generate("smollm2-b", "", keep_alive=0)  # unloaded, whatever came before
    seen_inside = False
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        load = pool.submit(client.generate, "smollm2-b", "Hi", raw=True, options=SHORT)
        while not load.done() and not seen_inside:
            if "smollm2-b:latest" in loaded(client):
                rows = httpx.get(f"{gateway.url}/admin/backends", headers=gateway.admin_headers)
                (row,) = [b for b in rows.json()["data"] if b["name"] == "dir-smollm2-b"]
                seen_inside = not row["loaded"] and row["healthy"]
        assert load.result().load_duration > 0
    assert seen_inside


def test_a_model_not_loaded_reads_as_available_not_failed(client, gateway):
    """A directory's model not loaded is healthy with loaded false in /admin/backends,
    kvgate:backend_healthy 1 and kvgate:backend_loaded 0 in /metrics; once loaded, 1 and
    1; /health lists it as down neither way, /ready's map as up."""
    client.generate("smollm2-b", "", keep_alive=0)  # unloaded, whatever came before
    headers = gateway.admin_headers

    def seen() -> tuple[dict, str]:
        rows = httpx.get(f"{gateway.url}/admin/backends", headers=headers).json()["data"]
        (row,) = [b for b in rows if b["name"] == "dir-smollm2-b"]
        metrics = httpx.get(f"{gateway.url}/metrics", headers=headers).text
        return row, metrics

    row, metrics = seen()
    assert row["healthy"] and not row["loaded"] and row["error"] is None
    ready = httpx.get(f"{gateway.url}/ready").json()
    assert ready["ready"] and ready["backends"]["dir-smollm2-b"] is True
    assert 'kvgate:backend_healthy{backend="dir-smollm2-b"} 1.0' in metrics
    assert 'kvgate:backend_loaded{backend="dir-smollm2-b"} 0.0' in metrics
    client.generate("smollm2-b", "Hi", raw=True, options=SHORT, keep_alive=-1)
    row, metrics = seen()
    assert row["healthy"] and row["loaded"]
    assert 'kvgate:backend_loaded{backend="dir-smollm2-b"} 1.0' in metrics
    health = httpx.get(f"{gateway.url}/health").json()
    assert "dir-smollm2-b" not in str(health["down"])
    client.generate("smollm2-b", "", keep_alive=0)


def test_keep_alive_zero_unloads_and_a_negative_one_keeps(client):
    client.chat("smollm2", HI, stream=False, options=SHORT, keep_alive=-1)
    (ps,) = client.ps().models
    assert ps.expires_at.year > 2200  # never
    client.chat("smollm2", HI, stream=False, options=SHORT, keep_alive="10m")
    expected = datetime.now(UTC) + timedelta(minutes=10)
    assert abs((client.ps().models[0].expires_at - expected).total_seconds()) < 60
    done = client.chat("smollm2", HI, stream=False, options=SHORT, keep_alive=0)
    assert done.done and loaded(client) == []
    # a keep-alive that runs out: the sweep unloads the idle model (within seconds)
    client.chat("smollm2", HI, stream=False, options=SHORT, keep_alive="1s")
    deadline = time.monotonic() + 60
    while loaded(client) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert loaded(client) == []
    client.generate("smollm2", "")  # Ollama's way to load a model
    assert loaded(client) == ["smollm2:latest"]
    unloaded = client.generate("smollm2", "", keep_alive=0)  # and to unload it
    assert unloaded.done_reason == "unload" and loaded(client) == []
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("smollm2", HI, keep_alive="5 minutes")
    assert e.value.status_code == 400 and "keep_alive" in e.value.error


def test_a_hugging_face_directory_is_served_by_the_gpu_backend(client):
    (listed,) = [m for m in client.list().models if m.model == "tiny-llama:latest"]
    assert listed.details.format == "safetensors" and listed.size > 0
    done = client.generate("tiny-llama", "Once upon a time", raw=True, options=SHORT)
    assert done.done and done.eval_count == 3 and done.load_duration > 0
    assert loaded(client) == ["tiny-llama:latest"]  # --models-max 1: it took the place


def test_an_admin_keys_chat_loads_nothing(admin, client):
    client.generate("smollm2-b", "", keep_alive=0)  # unloaded
    with pytest.raises(ollama.ResponseError) as e:
        admin.chat("smollm2-b", HI, options=SHORT)
    assert e.value.status_code == 403 and "smollm2-b:latest" not in loaded(client)


def test_a_model_over_the_memory_budget_is_a_clear_503(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.generate("gemma3", "Once upon a time", raw=True, options=SHORT)
    assert e.value.status_code == 503 and "memory budget" in e.value.error
    assert "gemma3" in e.value.error and "models_memory_gb" in e.value.error
    assert client.chat("smollm2", HI, stream=False, options=SHORT).done  # the rest serve


def test_the_directory_changed_by_an_admin_or_by_hand(client, admin, gateway, models):
    with pytest.raises(ollama.ResponseError) as e:
        client.copy("smollm2", "mine")
    assert e.value.status_code == 403 and e.value.error  # Ollama's {"error": ...}
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("smollm2")
    assert e.value.status_code == 403
    admin.copy("smollm2", "smollm2-copy")
    assert "smollm2-copy:latest" in {m.model for m in client.list().models}
    assert client.chat("smollm2-copy", HI, stream=False, options=SHORT).done
    admin.delete("smollm2-copy")
    assert "smollm2-copy:latest" not in {m.model for m in client.list().models}
    assert admin.create("smollm2-made", from_="smollm2").status == "success"
    assert "smollm2-made:latest" in {m.model for m in client.list().models}
    admin.delete("smollm2-made")
    with pytest.raises(ollama.ResponseError) as e:
        admin.delete("tiny-llama")  # a directory: by hand
    assert e.value.status_code == 400 and (models / "tiny-llama").is_dir()
    assert not (models / "smollm2-copy.gguf").exists()
    with pytest.raises(ollama.ResponseError) as e:
        admin.delete("smollm2-copy")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        admin.copy("smollm2", "../outside")
    assert e.value.status_code == 400 and not (models.parent / "outside.gguf").exists()
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3.2")
    assert e.value.status_code == 501 and "models directory" in e.value.error
    # by hand: a file copied in appears on a reload (or the watch's next look, whichever
    # comes first), one removed goes
    shutil.copyfile(models / "smollm2.gguf", models / "by-hand.gguf")
    reload = httpx.post(f"{gateway.url}/admin/reload", headers=gateway.admin_headers)
    assert reload.status_code == 200 and reload.json()["reloaded"]
    assert "by-hand:latest" in {m.model for m in client.list().models}
    (models / "by-hand.gguf").unlink()
    # a file that is no model: listed, and its first request a 503 that says so
    (models / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    assert httpx.post(f"{gateway.url}/admin/reload", headers=gateway.admin_headers).is_success
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("broken", HI)
    assert e.value.status_code == 503 and "failed to load" in e.value.error
    assert str(models) not in e.value.error  # the server's paths are its own
    (models / "broken.gguf").unlink()
    assert httpx.post(f"{gateway.url}/admin/reload", headers=gateway.admin_headers).is_success
    assert "by-hand:latest" not in {m.model for m in client.list().models}
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("by-hand", HI)
    assert e.value.status_code == 404


def test_langchains_chat_ollama_calls_a_directory_model(gateway, client):
    from langchain_ollama import ChatOllama

    headers = dict(client._client.headers)
    chat = ChatOllama(
        model="smollm2",
        base_url=gateway.url,
        num_predict=4,
        temperature=0,
        client_kwargs={"headers": {"Authorization": headers["authorization"]}},
    )
    answer = chat.invoke("Say hello.")
    assert answer.content.strip() and answer.response_metadata["model"] == "smollm2"
    assert answer.usage_metadata["output_tokens"] <= 4


def test_a_vision_projector_goes_with_its_model(tmp_path_factory, vision_gguf):
    """The tiny Gemma 3 vision model twice, its projector paired as llama-server's router
    pairs one (a subdirectory of the model and `mmproj-F16.gguf`) and by name
    (`NAME.gguf` beside `mmproj-NAME.gguf`): the projectors are listed as no model, both
    models' cards say vision before they load, and each answers a chat's image (the
    same greedy answer, its usage counting the image's tokens)."""
    from tests.backend_local.test_mmproj import picture

    text_model, mmproj = vision_gguf
    directory = tmp_path_factory.mktemp("vision-models")
    (directory / "tiny-vl").mkdir()
    os.symlink(text_model, directory / "tiny-vl" / "tiny-gemma3-vision.gguf")
    os.symlink(mmproj, directory / "tiny-vl" / "mmproj-F16.gguf")
    os.symlink(text_model, directory / "tiny-vl2.gguf")
    os.symlink(mmproj, directory / "mmproj-tiny-vl2.gguf")
    args = ["--models-dir", str(directory), "--n-ctx", "512", "--n-parallel", "1"]
    gw = start_gateway(tmp_path_factory.mktemp("serve-vision"), *args, "--n-threads", "1")
    try:
        _, key = gw.tenant_key("vision")
        client = ollama.Client(host=gw.url, headers={"Authorization": f"Bearer {key}"})
        assert sorted(m.model for m in client.list().models) == [
            "tiny-vl2:latest",
            "tiny-vl:latest",
        ]
        listed = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        assert {m.id: m.vision for m in listed.models.list().data} == {
            "tiny-vl": True,
            "tiny-vl2": True,
        }
        assert loaded(client) == []  # said before any load
        assert "vision" in client.show("tiny-vl").capabilities  # (it loads the model)
        url = picture(1)[1]
        parts = [{"type": "text", "text": "A picture: "}]
        parts += [{"type": "image_url", "image_url": {"url": url}}]
        answers = []
        for model in ("tiny-vl", "tiny-vl2"):
            reply = listed.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": parts}],
                max_tokens=6,
                temperature=0,
            )
            assert reply.usage.prompt_tokens_details.image_tokens == 4
            answers.append(reply.choices[0].message.content)
        assert answers[0] == answers[1]
    finally:
        gw.stop()
