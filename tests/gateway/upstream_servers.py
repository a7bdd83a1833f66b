"""Third-party servers for `remote` entries to front, started as real processes on the
default GGUF: llama-cpp-python's server and llama.cpp's own llama-server.

llama-server is a C++ binary built by `make llama-server` (studies/build_llama_server.sh,
about 10 minutes on two cores). A test finds it at $KVGATE_LLAMA_SERVER, in the clone's
.cache/llama-server (where `make llama-server` puts it), or in ~/.cache/kvgate/llama-server
(a build shared by fresh clones on one machine: `OUT=~/.cache/kvgate/llama-server make
llama-server`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from gateway.backends.default_model import default_model_path
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
LLAMA_SERVER_PLACES = (
    REPO / ".cache" / "llama-server" / "llama-server",
    Path.home() / ".cache" / "kvgate" / "llama-server" / "llama-server",
)


def llama_server_binary() -> Path | None:
    """Where llama.cpp's llama-server is built, or None."""
    configured = os.environ.get("KVGATE_LLAMA_SERVER")
    places = (Path(configured),) if configured else LLAMA_SERVER_PLACES
    return next((p for p in places if p.is_file() and os.access(p, os.X_OK)), None)


@contextlib.contextmanager
def serving(
    cmd: list[str], log: Path, root: str, probe: str, timeout: float = 120
) -> Iterator[str]:
    """`cmd`, listening at `root`, once its `probe` path answers 200; ended afterwards."""
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(root + probe).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"{cmd[0]} did not answer:\n{log.read_text()}"
            time.sleep(0.2)
        yield root
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def llama_cpp_python_server(
    tmp: Path, alias: str, n_ctx: int = 2048, chat_format: str | None = None
) -> Iterator[str]:
    """llama-cpp-python's own server on the default GGUF. interrupt_requests off: by
    default it cuts a stream whenever another request arrives. The GGUF has no chat
    template: without `chat_format` ("gemma") its chats take Llama 2's turns."""
    port = free_port()
    cmd = [
        *(sys.executable, "-m", "llama_cpp.server", "--model", str(default_model_path())),
        *("--model_alias", alias, "--n_ctx", str(n_ctx), "--n_threads", "1"),
        *("--interrupt_requests", "False", "--port", str(port)),
        *(("--chat_format", chat_format) if chat_format else ()),
    ]
    root = f"http://127.0.0.1:{port}"
    with serving(cmd, tmp / "llama-cpp-python.log", root, "/v1/models") as url:
        yield url


@contextlib.contextmanager
def llama_cpp_server(
    binary: Path, tmp: Path, alias: str, n_ctx: int = 2048, *flags: str
) -> Iterator[str]:
    """llama.cpp's llama-server on the default GGUF, one slot, with any further `flags`."""
    port = free_port()
    cmd = [
        *(str(binary), "--model", str(default_model_path()), "--alias", alias),
        *("--ctx-size", str(n_ctx), "--threads", "1", "--parallel", "1"),
        *("--host", "127.0.0.1", "--port", str(port), *flags),
    ]
    root = f"http://127.0.0.1:{port}"
    with serving(cmd, tmp / "llama-server.log", root, "/health") as url:
        yield url
