"""`kvgate chat` through a pseudo-terminal, against a real `kvgate serve` process.

The fake backend is deterministic: its reply depends only on the end of the prompt, and
it counts one prompt token per word of "role: content" lines, so the gateway's usage
shows exactly what history each turn carried."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import LiveGateway, start_gateway

# A slow backend, so that a long reply is still streaming when Ctrl-C comes.
CONFIG = """
[[backends]]
name = "fake"
type = "fake"
served_model_name = "chat-model"
tokens_per_second = 20
"""
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\r")


class Terminal:
    """`kvgate chat` on a pseudo-terminal of its own (its controlling terminal, so that
    Ctrl-C there is a SIGINT to it, as in a shell)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "gateway.cli", "chat", *args]
        full_env = dict(os.environ, TERM="dumb") | (env or {})
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: only exec
            os.execvpe(cmd[0], cmd, full_env)
        self.text = ""  # all output so far, without escape sequences or \r
        self.seen = 0  # where the next expect() starts looking
        self.exit_code: int | None = None

    def expect(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        """Read until `pattern` matches the output after the last match."""
        deadline = time.monotonic() + timeout
        while (m := re.compile(pattern).search(self.text, self.seen)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"no {pattern!r} in the output:\n{self.text}")
        self.seen = m.end()
        return m

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def wait(self, timeout: float = 30) -> int:
        """The exit code, once the output is read to its end."""
        deadline = time.monotonic() + timeout
        while self._read(max(deadline - time.monotonic(), 0.01)):
            pass
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                self.exit_code = os.waitstatus_to_exitcode(status)
                return self.exit_code
            time.sleep(0.05)
        raise AssertionError(f"kvgate chat did not exit:\n{self.text}")

    def kill(self) -> None:
        if self.exit_code is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            os.close(self.fd)

    def _read(self, timeout: float) -> bool:
        """False at the end of the output (the child closed the terminal) or on timeout."""
        if not select.select([self.fd], [], [], timeout)[0]:
            return False
        try:
            data = os.read(self.fd, 4096)
        except OSError:  # EIO: no process holds the terminal any more
            return False
        self.text += ANSI.sub("", data.decode(errors="replace"))
        return bool(data)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[LiveGateway]:
    gw = start_gateway(tmp_path_factory.mktemp("chat"), config=CONFIG)
    yield gw
    gw.stop()


@pytest.fixture
def chat(gateway):
    """Start `kvgate chat` for a fresh tenant: (terminal, tenant id)."""
    terminals: list[Terminal] = []

    def start(*args: str) -> tuple[Terminal, str]:
        tenant, key = gateway.tenant_key(f"chat-{len(terminals)}-{time.monotonic_ns()}")
        # the key and URL come from the environment, as a user would set them
        env = {"KVGATE_API_KEY": key, "KVGATE_URL": gateway.url}
        terminals.append(Terminal(*args, env=env))
        return terminals[-1], tenant["id"]

    yield start
    for t in terminals:
        t.kill()


def usage(gateway: LiveGateway, tenant_id: str) -> dict[str, int]:
    params = {"tenant_id": tenant_id}
    r = httpx.get(f"{gateway.url}/admin/usage", params=params, headers=gateway.admin_headers)
    assert r.status_code == 200, r.text
    return r.json()["total"]


def words(messages: list[tuple[str, str]]) -> int:
    """The fake backend's prompt tokens for these chat messages."""
    return len(("".join(f"{role}: {text}\n" for role, text in messages) + "assistant:").split())


def turn(term: Terminal, message: str) -> str:
    """Type a message; the reply line printed under it."""
    term.send(message + "\n")
    return term.expect(re.escape(message) + r"\n([^\n]*)\n>>> ").group(1)


def test_chat_streams_keeps_history_and_exits(gateway, chat):
    term, tenant = chat("--max-tokens", "6")
    term.expect(r"kvgate chat: chat-model at http://127\.0\.0\.1:\d+\. .*\n>>> ")
    first = turn(term, "hello there")
    assert len(first.split()) == 6  # the fake's six words, streamed as they came
    second = turn(term, "tell me more")
    assert usage(gateway, tenant)["prompt_tokens"] == (
        words([("user", "hello there")])
        + words([("user", "hello there"), ("assistant", first), ("user", "tell me more")])
    )
    # /clear forgets: the same first message gets the same reply as at the start
    term.send("/clear\n")
    term.expect(r"\(conversation cleared\)\n>>> ")
    assert turn(term, "hello there") == first != second
    assert usage(gateway, tenant)["requests"] == 3
    term.send("/exit\n")
    assert term.wait() == 0


def test_ctrl_c_stops_a_reply_and_ctrl_d_quits(gateway, chat):
    term, tenant = chat("--max-tokens", "2000", "--system", "be brief")
    term.expect(r">>> ")
    term.send("write a long story\n")
    term.expect(r"write a long story\n\w+ \w+")  # streaming has begun
    term.send("\x03")
    term.expect(r"\(stopped\)\n>>> ")
    # the gateway saw the hang-up: the request ended long before its 2000 tokens
    deadline = time.monotonic() + 30
    while (total := usage(gateway, tenant))["requests"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert total["requests"] == 1 and 2 <= total["completion_tokens"] < 2000
    # the chat goes on, with the cut reply in its history
    term.send("and then?\n")
    term.expect(r"and then\?\n\w+")
    term.send("\x03")
    term.expect(r"\(stopped\)\n>>> ")
    term.send("\x04")  # Ctrl-D at the prompt
    assert term.wait() == 0


def test_bad_key_and_no_gateway_are_one_line_errors(gateway):
    term = Terminal(env={"KVGATE_API_KEY": "kvg-wrong", "KVGATE_URL": gateway.url})
    assert term.wait() == 1
    assert re.search(r"kvgate chat: http://127\.0\.0\.1:\d+: .*key", term.text, re.I)
    assert "Traceback" not in term.text and ">>>" not in term.text

    term = Terminal("--api-key", "kvg-x", "--url", "http://127.0.0.1:9")
    assert term.wait() == 1
    assert "cannot reach a gateway at http://127.0.0.1:9" in term.text
    assert "Traceback" not in term.text


@pytest.mark.slow
def test_model_file_runs_here_and_ctrl_c_stops_it():
    """--model-file: the default GGUF on llama.cpp in the chat's own process, no gateway.
    Greedy, the base model rambles on well past the Ctrl-C."""
    from gateway.backends.default_model import default_model_path

    path = str(default_model_path())
    term = Terminal("--model-file", path, "--max-tokens", "2000", "--temperature", "0")
    term.expect(r"kvgate chat: gemma-3-270m\S* from .*\(llama\.cpp, in this process\)", 120)
    term.expect(r">>> ")
    term.send("Write a long story about a dragon.\n")
    term.expect(r"dragon\.\n\S")  # its first words
    term.send("\x03")
    term.expect(r"\(stopped\)\n>>> ")
    term.send("/exit\n")
    assert term.wait() == 0
    assert "Traceback" not in term.text
