"""What a benchmark record must not keep: the API keys a run was given. Records are
files that outlive the run and `bench history` prints them, so the values of the key
options in a record's command line and config are replaced, when a record is made and
again when one is read (records written before this kept them), and so is the password
of a URL with one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

REDACTED = "<redacted>"
# the options whose value is a key: bench serve, sweep (--api-key2) and noisy (--key-*)
SECRET_OPTIONS = ("--api-key", "--api-key2", "--key-a", "--key-b", "--key-heavy")
# their names in a config taken from argparse's namespace (api_key, key_a, ...)
SECRET_FIELDS = frozenset(option[2:].replace("-", "_") for option in SECRET_OPTIONS)
_URL_PASSWORD = re.compile(r"(://[^/@:\s]*:)[^/@\s]+@")


def _names_secret_option(token: str) -> bool:
    """Whether `token` is a key option, whole or shortened as argparse accepts it (a
    prefix of one long option; one that fits several is an error there, no harm here)."""
    return (
        token.startswith("--")
        and len(token) > 3
        and any(o.startswith(token) for o in SECRET_OPTIONS)
    )


def redact_text(text: str) -> str:
    """A URL's password replaced (http://user:PASSWORD@host)."""
    return _URL_PASSWORD.sub(rf"\g<1>{REDACTED}@", text)


def redact_command(command: Sequence[str]) -> list[str]:
    """The command line with every key option's value replaced, `--api-key KEY` and
    `--api-key=KEY` alike."""
    out: list[str] = []
    value_next = False
    for token in command:
        name, equals, _ = token.partition("=")
        if value_next:
            out.append(REDACTED)
            value_next = False
        elif _names_secret_option(name):
            out.append(f"{name}={REDACTED}" if equals else token)
            value_next = not equals
        else:
            out.append(redact_text(token))
    return out


def redact_config(config: dict) -> dict:
    """The config with the key fields' values replaced, nested dicts too."""
    out = {}
    for name, value in config.items():
        if name in SECRET_FIELDS and value is not None:
            value = REDACTED
        elif isinstance(value, dict):
            value = redact_config(value)
        elif isinstance(value, str):
            value = redact_text(value)
        out[name] = value
    return out


def redact_record(record: dict) -> dict:
    """A history record with nothing secret in its command or config."""
    out = dict(record)
    if isinstance(record.get("command"), list):
        out["command"] = redact_command([str(token) for token in record["command"]])
    if isinstance(record.get("config"), dict):
        out["config"] = redact_config(record["config"])
    return out
