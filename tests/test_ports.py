"""The suite's ports (studies/ports.py) come from outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

from studies.ports import _ephemeral_low, free_port


def test_ports_are_free_distinct_and_never_an_outgoing_connections():
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    low = _ephemeral_low()
    assert all(1024 <= p < low for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # each is free to bind


def test_a_taken_port_is_passed_over():
    held = socket.socket()
    held.bind(("127.0.0.1", free_port()))
    held.listen()
    try:
        taken = held.getsockname()[1]
        assert all(free_port() != taken for _ in range(1500))
    finally:
        held.close()
