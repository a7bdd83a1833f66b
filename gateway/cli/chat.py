"""`kvgate chat`: talk to a model in the terminal, as `ollama run` does.

The first thing a new user wants after `make serve` is to see the model answer; curl and
a Python snippet are a detour. Against a running gateway this is an ordinary `openai`
client, so a chat goes through the same auth, quotas and usage rows as any other caller.
With `--model-file` it loads the model in this process through the gateway's own backend
adapter (the chat template and sampling `kvgate serve` uses) and needs no gateway,
database or key.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.cli.parsing import Parser

DEFAULT_URL = "http://127.0.0.1:8000"
COMMANDS = "/exit (or Ctrl-D) quits, /clear forgets the conversation, Ctrl-C stops a reply"
# One conversation needs one llama.cpp sequence, with room for a long history.
LOCAL_OPTIONS = {"n_parallel": 1, "n_ctx": 8192}

Messages = list[dict[str, str]]


class ChatError(Exception):
    """Something the user should read as one line: no traceback."""


@dataclass
class Sampling:
    max_tokens: int
    temperature: float | None  # None: the server's (or engine's) default


class RemoteChat:
    """Streams chat completions from a running gateway (or any OpenAI-compatible server)."""

    def __init__(self, url: str, api_key: str, model: str | None, sampling: Sampling) -> None:
        from openai import OpenAI

        self.url = url.rstrip("/").removesuffix("/v1")
        # no retries: a chat should say at once that the gateway is gone or refused it
        self.client = OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)
        self.model = model or ""
        self.sampling = sampling

    def start(self) -> str:
        """Check the key (and find the model when none was named); the banner's text."""
        listed = self._call(lambda: list(self.client.models.list()))
        # the ones that chat: an embedding model (task "embed") cannot
        models = [m.id for m in listed if getattr(m, "task", "generate") != "embed"]
        if not self.model:
            if not models:
                raise ChatError(f"{self.url} serves no models to chat with")
            self.model = models[0]
        return f"{self.model} at {self.url}"

    def reply(self, messages: Messages) -> Iterator[str]:
        extra: dict[str, Any] = {}
        if self.sampling.temperature is not None:
            extra["temperature"] = self.sampling.temperature
        stream = self._call(
            lambda: self.client.chat.completions.create(
                model=self.model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=self.sampling.max_tokens,
                stream=True,
                **extra,
            )
        )
        try:
            chunks = iter(stream)
            with _ctrl_c_cancels(interrupt=True) as ctrl_c:
                while (chunk := self._call(lambda: next(chunks, None))) is not None:
                    # a library under the read that caught the interrupt still stops here
                    ctrl_c.stop_if_pressed()
                    if chunk.choices:
                        yield chunk.choices[0].delta.content or ""
        finally:
            stream.close()  # early (Ctrl-C): the gateway sees the hang-up and stops generating

    def close(self) -> None:
        self.client.close()

    def _call(self, fn: Callable[[], Any]) -> Any:
        import openai

        try:
            return fn()
        except openai.APIStatusError as e:
            body = e.body if isinstance(e.body, dict) else {}
            hint = " (--api-key or $KVGATE_API_KEY)" if e.status_code == 401 else ""
            raise ChatError(f"{self.url}: {body.get('message') or e.message}{hint}") from None
        except openai.APIConnectionError:
            raise ChatError(
                f"cannot reach a gateway at {self.url}: is `kvgate serve` running there? "
                "A gateway elsewhere: --url URL or $KVGATE_URL"
            ) from None
        except openai.APIError as e:  # an error event in the middle of a stream
            raise ChatError(f"{self.url}: {e.message}") from None


class LocalChat:
    """Runs a model file in this process: a GGUF file on llama.cpp, an HF directory on the
    gpu engine (CUDA, or the CPU). Each step runs the adapter's coroutines on one event loop,
    so Ctrl-C cancels the step and closing the stream aborts the request in the engine."""

    def __init__(self, path: str, sampling: Sampling) -> None:
        self.path = path
        self.kind = "gpu" if Path(path).is_dir() else "local"
        self.sampling = sampling
        self.runner = asyncio.Runner()
        self.backend: Any = None
        self.model = ""

    def start(self) -> str:
        from engine_api.errors import BackendError
        from gateway.backends import BackendSpec, build_backend

        if not Path(self.path).exists():
            raise ChatError(f"no such model file or directory: {self.path}")
        options = LOCAL_OPTIONS if self.kind == "local" else {}
        self.backend = build_backend(BackendSpec("chat", self.kind, self.path, "", dict(options)))
        try:
            self.runner.run(self.backend.start())
        except BackendError as e:
            raise ChatError(str(e)) from None
        self.model = self.backend.models()[0].id
        engine = "llama.cpp" if self.kind == "local" else "the gpu engine"
        return f"{self.model} from {self.path} ({engine}, in this process)"

    def reply(self, messages: Messages) -> Iterator[str]:
        from engine_api.errors import BackendError, BadRequestError
        from engine_api.records import GenRequest
        from engine_api.sampling import SamplingParams

        sampling = SamplingParams(max_tokens=self.sampling.max_tokens)
        if self.sampling.temperature is not None:
            sampling.temperature = self.sampling.temperature
        try:
            ids = self.runner.run(self.backend.render(self.model, messages))
            sampling.validate()
        except BadRequestError as e:
            raise ChatError(str(e)) from None
        req = GenRequest(f"chat-{uuid.uuid4().hex}", self.model, ids, sampling)
        stream = self.backend.generate(req)
        loop = self.runner.get_loop()
        try:
            with _ctrl_c_cancels() as ctrl_c:
                while True:
                    ctrl_c.stop_if_pressed()
                    ctrl_c.task = loop.create_task(anext(stream, None))
                    try:
                        chunk = loop.run_until_complete(ctrl_c.task)
                    except asyncio.CancelledError:
                        raise KeyboardInterrupt from None
                    finally:
                        ctrl_c.task = None
                    if chunk is None:
                        return
                    yield chunk.text
        except (BackendError, BadRequestError) as e:
            raise ChatError(str(e)) from None
        finally:
            # a step cut short may leave the stream unable to close cleanly: that must
            # not mask the interrupt, which stops the reply
            with contextlib.suppress(BackendError):
                self.runner.run(stream.aclose())

    def close(self) -> None:
        if self.backend is not None:
            self.runner.run(self.backend.stop(drain=False))
        self.runner.close()


class _CtrlC:
    """A Ctrl-C seen while a reply streams: it cancels the step in flight, if any, or
    (`interrupt`) raises KeyboardInterrupt in a blocking read, as Python's own handler."""

    def __init__(self, interrupt: bool) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.pressed = False
        self.interrupt = interrupt

    def on_signal(self, _signum: int, _frame: Any) -> None:
        self.pressed = True
        if self.task is not None:
            self.task.get_loop().call_soon_threadsafe(self.task.cancel)
        if self.interrupt:
            raise KeyboardInterrupt

    def stop_if_pressed(self) -> None:
        if self.pressed:
            raise KeyboardInterrupt


@contextlib.contextmanager
def _ctrl_c_cancels(interrupt: bool = False) -> Iterator[_CtrlC]:
    """Turn Ctrl-C into a cancelled step while a reply streams.

    asyncio.Runner.run raises KeyboardInterrupt wherever the signal lands, even between
    creating a step's task and running it, which leaves a task never awaited (and its
    warnings on the terminal). Here the signal only marks the reply stopped and cancels
    the step in flight, so the reply stops at a step's edge. Either way the mark stays,
    for a caller to stop at its next chunk should a library under a read swallow the
    interrupt.
    """
    ctrl_c = _CtrlC(interrupt)
    previous = signal.signal(signal.SIGINT, ctrl_c.on_signal)
    try:
        yield ctrl_c
    finally:
        signal.signal(signal.SIGINT, previous)


def chat_loop(chat: RemoteChat | LocalChat, system: str | None) -> int:
    """Read a line, stream the reply, keep the history; 0 on /exit or end of input."""
    start: Messages = [{"role": "system", "content": system}] if system else []
    history = list(start)
    while True:
        try:
            line = input(">>> ").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print(f"\n({COMMANDS})")
            continue
        if not line:
            continue
        if line in ("/exit", "/bye", "/quit"):
            return 0
        if line == "/clear":
            history = list(start)
            print("(conversation cleared)")
            continue
        if line.startswith("/"):
            print(f"unknown command {line.split()[0]}: {COMMANDS}")
            continue
        history.append({"role": "user", "content": line})
        answer = _stream_reply(chat, history)
        if answer:
            history.append({"role": "assistant", "content": answer})
        else:  # nothing came back: forget the question, so turns keep alternating
            history.pop()


def _stream_reply(chat: RemoteChat | LocalChat, history: Messages) -> str:
    """Print the reply as it arrives; what was printed (all of it, or up to a Ctrl-C)."""
    parts: list[str] = []
    pieces = chat.reply(history)
    try:
        for piece in pieces:
            parts.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        print()
    except KeyboardInterrupt:
        print("\n(stopped)")
    except ChatError as e:
        print(f"\nkvgate chat: {e}", file=sys.stderr)
        return ""
    finally:
        pieces.close()
    return "".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvgate chat",
        description="Chat with a model in the terminal: against a running gateway (the "
        "openai client, streaming), or with --model-file, loading the model in this process "
        f"(no gateway, no key). {COMMANDS}.",
    )
    parser.add_argument("--url", help=f"the gateway (default: $KVGATE_URL, else {DEFAULT_URL})")
    parser.add_argument(
        "--api-key", help="a tenant's key (default: $KVGATE_API_KEY, else $OPENAI_API_KEY)"
    )
    parser.add_argument(
        "--model-file",
        metavar="PATH",
        help="run this model here instead: a GGUF file (llama.cpp) or an HF directory "
        "(the gpu engine)",
    )
    parser.add_argument("--model", help="the model id to ask for (default: the first served)")
    parser.add_argument("--max-tokens", type=int, default=256, help="per reply (default 256)")
    parser.add_argument("--system", metavar="TEXT", help="a system prompt")
    parser.add_argument(
        "--temperature",
        type=float,
        help="default: the model's (its generation config), else 1.0",
    )
    return parser


def _make_chat(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RemoteChat | LocalChat:
    sampling = Sampling(args.max_tokens, args.temperature)
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    if args.model_file:
        if args.url or args.api_key or args.model:
            parser.error(
                "--model-file runs the model here: it takes no --url, --api-key or --model"
            )
        return LocalChat(args.model_file, sampling)
    key = args.api_key or os.environ.get("KVGATE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    if not key:
        parser.error("no API key: pass --api-key or set KVGATE_API_KEY (or --model-file PATH)")
    url = args.url or os.environ.get("KVGATE_URL") or DEFAULT_URL
    return RemoteChat(url, key, args.model, sampling)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    chat = _make_chat(parser, args)
    if sys.stdin.isatty():
        import readline  # noqa: F401  line editing and history for input()
    try:
        print(f"kvgate chat: {chat.start()}. {COMMANDS}.", flush=True)
        return chat_loop(chat, args.system)
    except ChatError as e:
        print(f"kvgate chat: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:
        chat.close()


if __name__ == "__main__":
    sys.exit(main())
