"""llama.cpp's own log, routed into Python's `logging` at the right levels.

llama-cpp-python installs a log callback whose table is one level off for this llama.cpp
(its WARN counts as ERROR, its ERROR as DEBUG), so a model's load warnings ("control-looking
token ... probably a bug in the model", the SWA cache line) reached every user's terminal
while real errors were hidden. Here llama.cpp's errors are the `llama.cpp` logger's
errors; its warnings are INFO, shown by `kvgate serve --verbose` (a new user's first screen
stays the admin key); its info and debug lines are DEBUG. `verbose=True` (the local
engine's option) prints everything, as llama.cpp would by itself. libmtmd (a vision
projector's library) logs through the same callback.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading

import llama_cpp

log = logging.getLogger("llama.cpp")

# ggml.h: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous line)
_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.DEBUG, 3: logging.INFO, 4: logging.ERROR}
_CONT = 5


class _State:
    verbose = False
    level = logging.INFO  # the level of the line being continued
    pending = ""  # text of a line not yet ended
    lock = threading.Lock()  # llama.cpp logs from its own threads too


def route_llama_log(verbose: bool) -> None:
    """Send llama.cpp's log through `_callback` (once per process; `verbose` may change)."""
    _State.verbose = verbose
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))


def route_mtmd_log() -> None:
    """libmtmd's log (a vision projector's, backend_local.vision) the same way; it
    loads libmtmd, so only an engine with a projector calls it."""
    from llama_cpp import mtmd_cpp

    mtmd_cpp.mtmd_log_set(_callback, ctypes.c_void_p(0))
    mtmd_cpp.mtmd_helper_log_set(_callback, ctypes.c_void_p(0))


def handle(level: int, text: str) -> None:
    """One piece of llama.cpp's log: printed whole (verbose), or logged line by line."""
    if _State.verbose:
        print(text, end="", flush=True, file=sys.stderr)
        return
    with _State.lock:
        if level != _CONT:
            _State.level = _LEVELS.get(level, logging.DEBUG)
        _State.pending += text
        *lines, _State.pending = _State.pending.split("\n")
        at = _State.level
    for line in lines:
        if line.strip():
            log.log(at, "%s", line)


@llama_cpp.llama_log_callback
def _callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    handle(level, text.decode("utf-8", "replace"))
