"""llama.cpp's own server in router mode (`llama-server --models-dir DIR`, no model named):
issue 51's peer where no `ollama` binary can be had. The router lists the directory's GGUF
files by stem, starts a child llama-server per model on its first request (or on
`POST /models/load`), forwards each request by its `model` field, and stops the child on
`POST /models/unload`: the same models-directory shape as `kvgate serve --models-dir`, so
that studies/ollama_local.py can time the same cold first request and chat on both.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx

from studies.harness import free_port, stop_process, wait_http


class Router:
    """`binary` in router mode over `models` on a free port, each model's child with the
    same context cells, sequences and threads as kvgate's engine; `url` once it answers."""

    def __init__(self, binary: Path, models: Path, workdir: Path, n_ctx: int, threads: int):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / "llama-server.log"
        argv = [str(binary), "--no-webui", "--port", str(port), "--models-dir", str(models)]
        argv += ["--models-max", "2", "-c", str(n_ctx), "-np", "1"]
        argv += ["-t", str(threads), "-tb", str(threads)]
        self.proc = subprocess.Popen(argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        try:
            wait_http(self.url, self.proc, self.log)
        except BaseException:
            stop_process(self.proc)
            raise

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_process(self.proc)


def status(http: httpx.Client, model: str) -> str:
    """The router's word for `model`: unloaded, loading, loaded, sleeping."""
    r = http.get("/models")
    r.raise_for_status()
    for entry in r.json()["data"]:
        if entry["id"] == model:
            return entry["status"]["value"]
    raise KeyError(f"the router lists no {model!r}")


def unload(http: httpx.Client, model: str, timeout: float = 60) -> None:
    """`model`'s child stopped, waiting until the router says so."""
    if status(http, model) != "unloaded":
        http.post("/models/unload", json={"model": model}).raise_for_status()
    deadline = time.monotonic() + timeout
    while status(http, model) != "unloaded":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{model} still loaded after {timeout} s")
        time.sleep(0.05)


def cold_first_request(http: httpx.Client, model: str) -> float:
    """Seconds of one completion of one token of `model` unloaded (the router starts its
    child and waits for its load), the model unloaded again afterwards."""
    unload(http, model)
    body = {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    r = http.post("/v1/completions", json=body)
    seconds = time.perf_counter() - started
    r.raise_for_status()
    unload(http, model)
    return seconds


def api_chat_status(http: httpx.Client, model: str) -> int:
    """The status code of Ollama's `/api/chat` on the router (404: it has none)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "stream": False}
    return http.post("/api/chat", json=body | {"options": {"num_predict": 1}}).status_code
