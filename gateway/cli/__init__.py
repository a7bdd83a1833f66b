"""The `kvgate` command: `main` parses and dispatches (main.py); `serve` runs the gateway,
`admin` works on the database straight (tenants, keys, usage, db), `chat` talks to a
model. `top` and `bench` live in their own packages and are handed their arguments.
"""

from gateway.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
