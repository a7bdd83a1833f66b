"""llama.cpp's log at the right levels: its load warnings stay off a new user's screen
(INFO, for --verbose), its errors do not (issue 31)."""

from __future__ import annotations

import logging

import pytest

from backend_local import llama_log


@pytest.fixture
def quiet_routing():
    llama_log._State.verbose = False
    yield
    llama_log._State.pending = ""


def test_warnings_are_info_errors_are_errors_and_lines_are_joined(quiet_routing, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="llama.cpp")
    warn, error, cont, info = 3, 4, 5, 2
    llama_log.handle(warn, "load: control-looking token: 212 '</s>' was not control-type\n")
    llama_log.handle(error, "failed to load ")
    llama_log.handle(cont, "the model\n")
    llama_log.handle(info, "llama_kv_cache: size = 1 MiB\n")
    got = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert got == [
        (logging.INFO, "load: control-looking token: 212 '</s>' was not control-type"),
        (logging.ERROR, "failed to load the model"),
        (logging.DEBUG, "llama_kv_cache: size = 1 MiB"),
    ]


def test_verbose_prints_llama_cpps_text_as_it_is(capsys, caplog) -> None:
    llama_log._State.verbose = True
    try:
        llama_log.handle(3, "a warning\n")
    finally:
        llama_log._State.verbose = False
    assert capsys.readouterr().err == "a warning\n" and caplog.records == []
