"""One `kvgate tune` candidate served: its settings written as the TOML file `kvgate
serve --config` reads, a real `kvgate serve` process started on it, and an API key.

A process per candidate, not an engine in the tuner's process: a candidate's settings
(KV dtype, weight format, speculation) are fixed when its engine starts; a process gives
every candidate a clean device (the CUDA allocator's cache, the graphs' pool and a
crashed or out-of-memory candidate go with it); and what is measured is exactly what
the chosen TOML file will serve, through the same gateway.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

PROGRESS_S = 10.0  # while a candidate starts, a line this often (none if it is quicker)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # a progress bar's cursor moves


@dataclass(frozen=True)
class Candidate:
    """The engine settings `kvgate tune` searches (EngineConfig's names)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_dtype: str = "auto"
    quantization: str | None = None  # weights: None, "int8", "fp8"
    num_speculative_tokens: int = 0  # n-gram speculation's length; 0: off
    enable_prefix_caching: bool = True

    @property
    def name(self) -> str:
        spec = f"ngram{self.num_speculative_tokens}" if self.num_speculative_tokens else "nospec"
        return (
            f"seqs{self.max_num_seqs}-tok{self.max_num_batched_tokens}-kv{self.kv_cache_dtype}"
            f"-w{self.quantization or 'auto'}-{spec}-{'pc' if self.enable_prefix_caching else 'nopc'}"
        )

    def engine_options(self) -> dict:
        options = asdict(self)
        spec = options.pop("num_speculative_tokens")
        if options["quantization"] is None:
            del options["quantization"]
        if spec:
            options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec}
        return options


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string is JSON's escapes
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise ValueError(f"no TOML form for {value!r}")


def config_toml(model: str, base: dict, candidate: Candidate, header: str = "") -> str:
    """A `kvgate serve --config` file serving `model` on the gpu backend with the base
    options (device, dtype, max_model_len, ...) and the candidate's."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines += ["[[backends]]", 'name = "tuned"', 'type = "gpu"', f"model = {toml_value(model)}"]
    options = {k: v for k, v in base.items() if v is not None} | candidate.engine_options()
    lines += [f"{key} = {toml_value(value)}" for key, value in options.items()]
    return "\n".join(lines) + "\n"


def newest_line(log: str, width: int = 100) -> str:
    """The last line a log shows, as a terminal would: after its last carriage return
    (a progress bar redraws its line), without escape sequences, cut to `width`."""
    lines = [line.strip() for line in re.split(r"[\r\n]", ANSI.sub("", log))]
    line = next((line for line in reversed(lines) if line), "")
    return line if len(line) <= width else line[: width - 3] + "..."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, admin_key: str, body: dict) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {admin_key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


class CandidateServer:
    """`kvgate serve --config FILE` on a free port, until stop(); its log in `workdir`.
    While it starts (a model loaded, a first one's minutes on a CPU), `progress` is told
    every PROGRESS_S how long it has taken and its log's newest line."""

    def __init__(
        self,
        config_file: Path,
        workdir: Path,
        start_timeout: float,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_key = "kvg-tune-" + secrets.token_hex(20)
        self.log = workdir / f"{config_file.stem}.log"
        env = dict(os.environ, KVGATE_ADMIN_KEY=self.admin_key)
        env.setdefault("KVGATE_DATABASE_URL", f"sqlite+aiosqlite:///{workdir / 'tune.db'}")
        cmd = [sys.executable, "-m", "gateway.cli", "--config", str(config_file), "serve"]
        cmd += ["--port", str(self.port)]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready(start_timeout, progress or (lambda line: None))

    def _wait_ready(self, timeout: float, progress: Callable[[str], None]) -> None:
        started = time.monotonic()
        deadline, told, said = started + timeout, started, ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvgate serve exited: {self.log_tail()}")
            text = self.log.read_text(errors="replace")
            now = time.monotonic()
            if "kvgate: listening on" in text:
                progress(f"started in {now - started:.0f} s")
                return
            if now - told >= PROGRESS_S:
                line = newest_line(text)
                progress(f"{now - started:.0f} s" + (f": {line}" if line != said else ""))
                told, said = now, line
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"kvgate serve did not start in {timeout:.0f}s: {self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])

    def api_key(self, tenant: str) -> str:
        """A key of a new tenant, made through the admin API."""
        made = _post(f"{self.url}/admin/tenants", self.admin_key, {"name": tenant})
        return _post(f"{self.url}/admin/tenants/{made['id']}/keys", self.admin_key, {})["key"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> CandidateServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
