"""A thread that owns one llama context: the generating Worker's and the EmbedWorker's.

llama.cpp's contexts are not thread-safe, so one thread makes every call on a context and
others only hand it work, aborts and a stop, through one condition. What that takes
(queueing, aborting, stopping with or without draining, telling every waiting request
that the thread died) is the same for both loops; each says what a step is and what it
frees at the end.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Generic, TypeVar

from engine_api.errors import EngineDeadError

log = logging.getLogger(__name__)
W = TypeVar("W")  # the work a caller hands the thread


class ContextThread(Generic[W]):
    label = "worker"  # how its messages name it: "the llama.cpp <label> crashed"

    def __init__(self, thread_name: str) -> None:
        self.error: BaseException | None = None  # why the loop ended, if it crashed
        self._cond = threading.Condition()
        self._inbox: deque[W] = deque()
        self._aborts: set[str] = set()
        self._stopping = False
        self._drain = True
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    # -- called from other threads -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, work: W) -> None:
        with self._cond:
            if not self.alive:
                raise EngineDeadError(self._dead_reason())
            self._inbox.append(work)
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.add(request_id)
            self._cond.notify()

    def stop(self, drain: bool, timeout: float | None = None) -> bool:
        """Stop taking work; finish what is queued and running (drain) or drop it; join.
        True once the thread has ended (and freed the context)."""
        with self._cond:
            self._stopping = True
            self._drain = drain
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _dead_reason(self) -> str:
        if self.error is not None:
            return f"the llama.cpp {self.label} crashed: {self.error!r}"
        return "the llama.cpp engine is shut down"

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as exc:  # every request must learn that the thread died
            log.exception("llama.cpp %s crashed", self.label)
            self.error = exc
        finally:
            with self._cond:
                self._stopping = True
                orphans = list(self._inbox)
                self._inbox.clear()
            self._close(orphans, EngineDeadError(self._dead_reason()))

    def _step(self) -> bool:
        """One step of the loop; False when it should end."""
        raise NotImplementedError

    def _close(self, orphans: list[W], dead: EngineDeadError) -> None:
        """Tell `orphans` (queued, never taken) and whatever is in flight that the thread
        died or stopped, and free the context."""
        raise NotImplementedError
