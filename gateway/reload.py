"""Live reload: SIGHUP and POST /admin/reload read the config file again and apply it
to the running gateway, with no restart and no request dropped.

What a reload changes: prices, the fairness policy, the router policy, the prefill
threshold and timeout, the drain timeout, and the backends: an entry (a [[backends]]
table, or the one --backend) that is new is started, then routed to; one that is gone
leaves the router at once and is stopped once its requests in flight have finished (or
after `drain_timeout_s`); one whose spec changed (a remote upstream's options, say) is
both, its successor started before its predecessor leaves. Tenants and keys live in
the database and need no reload.

A config that does not parse or validate is refused as a whole, checked exactly as at
start-up (a wrong type, a value out of range, a config file with no backend left:
gateway/config_check.py), and so is one that changes a setting that only a restart can
(the port, the database, ...), or one with a new backend that fails to start: the
running config stays, the error is logged, and the caller hears which field. A gateway
started without a config file has none to read again, and says so. Everything is read, checked and started before the swap, and
the swap itself has no await in it, so a request sees the old config or the new one,
never half of each (docs/design.md, "Live reload").
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from gateway.backends import Backend, BackendSpec
from gateway.config import Settings
from gateway.config_backends import ENGINE_SETTINGS
from gateway.config_check import ConfigError
from gateway.lifecycle import Started, add_entry_adapters, route, start_entries
from gateway.ondemand import ModelsDir
from gateway.state import GatewayState
from gateway.tenancy import audit

log = logging.getLogger("kvgate")
SIGNAL_ACTOR = "signal:SIGHUP"  # who the audit log names for a SIGHUP's reload
NO_CONFIG_FILE = (
    "this gateway was started without a config file, so there is no file to read again "
    "and nothing was changed: start it with --config FILE (or KVGATE_CONFIG) to reload"
)

# the settings a reload applies; any other that differs needs a restart
RELOADABLE = frozenset(
    {
        "prices",
        "fairness",
        "router_policy",
        "prefill_threshold",
        "prefill_timeout_s",
        "drain_timeout_s",
        # the backends, in either form: [[backends]], or the one --backend and its settings
        "backends",
        "backend",
        "model",
        "served_model_name",
        "replicas",
        "lora_modules",
        *ENGINE_SETTINGS,
    }
)


class ReloadError(ValueError):
    """The new config was refused; `field` names what is wrong when it is known."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class Reload:
    """What a reload did: the settings it changed and the backend entries it touched."""

    changed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    # a models directory's models that appear or go (its files, read again)
    models_added: list[str] = field(default_factory=list)
    models_removed: list[str] = field(default_factory=list)


async def reload_config(gw: GatewayState, actor: str) -> Reload:
    """Read the config again and apply it, or log and raise ReloadError and change
    nothing. `actor`: the admin key's id (or SIGNAL_ACTOR), for the audit log."""
    try:
        return await _reload(gw, actor)
    except ReloadError as e:
        log.error("config reload refused; the running config stays: %s", e)
        raise


async def reload_on_signal(gw: GatewayState) -> None:
    """SIGHUP's reload: no caller to answer, the log says how it went (whatever failed:
    a signal's task has no one to raise to)."""
    try:
        await reload_config(gw, SIGNAL_ACTOR)
    except ReloadError:
        pass  # logged
    except Exception:
        log.exception("config reload failed; the running config stays")


async def _reload(gw: GatewayState, actor: str) -> Reload:
    async with gw.reload_lock:
        if gw.source is None:
            raise ReloadError("this gateway was not started from a config it can read again")
        if gw.source.config_file is None and gw.models_dir is not None:
            return await _rescan(gw, Reload())  # the directory is all there is to read again
        if gw.source.config_file is None:  # flags and KVGATE_* are as they were at start
            raise ReloadError(NO_CONFIG_FILE)
        if gw.drain.draining:  # what it would start would only be stopped again
            raise ReloadError("the gateway is shutting down")
        try:
            new = gw.source.load()
            configured = new.resolved_backends(starter=True)
        except ConfigError as e:
            raise ReloadError(f"the config was refused: {e}", field=e.key) from None
        except (OSError, ValueError, TypeError) as e:  # TypeError: a wrong type unforeseen
            raise ReloadError(f"the config was refused: {e}") from None
        done = Reload(changed=_changed(gw.settings, new))
        old = {spec.name: spec for spec in gw.settings.resolved_backends(starter=True)}
        now = {spec.name: spec for spec in configured}
        done.added = [n for n in now if n not in old]
        done.removed = [n for n in old if n not in now]
        done.replaced = [n for n in now if n in old and now[n] != old[n]]
        starting = [now[n] for n in now if n in done.added or n in done.replaced]
        started = await _start(gw, starting)
        try:  # the row first: the swap cannot fail, so no reload goes without its row
            before, after = _audited(gw.settings, new, done)
            await audit.record(gw.db, actor, "config.reload", "config", before, after)
        except BaseException:
            await _stop([b for b, _ in started.backends], started)
            raise
        _swap(gw, new, started, done.removed + done.replaced)
        if starting:
            await add_entry_adapters(gw, starting, started)
            await gw.pins.prefill_all()  # the new replicas start with empty caches
        log.info(
            "config reloaded: settings changed %s; backends added %s, removed %s, replaced %s",
            *(done.changed, done.added, done.removed, done.replaced),
        )
        return await _rescan(gw, done) if gw.models_dir is not None else done


async def _rescan(gw: GatewayState, done: Reload) -> Reload:
    """The models directory read again (its files added or removed)."""
    models: ModelsDir = gw.models_dir
    try:
        scanned = await models.rescan()
    except OSError as e:
        raise ReloadError(f"the models directory cannot be read: {e.strerror}") from None
    done.models_added, done.models_removed = scanned.added, scanned.removed
    return done


def _audited(old: Settings, new: Settings, done: Reload) -> tuple[dict, dict]:
    """The reload as the audit log keeps it: each changed setting before and after, prices
    in USD per million tokens, and the backend entries by name only (an entry's options
    may hold an upstream's key)."""

    def view(settings: Settings) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in (n for n in done.changed if n != "backends"):
            value = getattr(settings, name)
            if name == "prices":
                out[name] = {
                    m: {f: v / 1e6 for f, v in asdict(p).items()} for m, p in value.items()
                }
            elif isinstance(value, list | tuple):
                out[name] = [str(v) for v in value]
            else:
                out[name] = (
                    value if isinstance(value, str | int | float | bool | None) else str(value)
                )
        backends = settings.resolved_backends(starter=True)
        return out | {"backends": sorted(spec.name for spec in backends)}

    return view(old), view(new) | {"replaced": done.replaced}


def _changed(old: Settings, new: Settings) -> list[str]:
    """The settings that differ, all of them reloadable (else ReloadError)."""
    changed = [f.name for f in fields(Settings) if getattr(old, f.name) != getattr(new, f.name)]
    fixed = [name for name in changed if name not in RELOADABLE]
    if fixed:
        raise ReloadError(
            f"{fixed[0]} cannot change on a reload (restart the gateway to change "
            f"{', '.join(fixed)}); nothing was changed",
            field=fixed[0],
        )
    return changed


async def _start(gw: GatewayState, specs: list[BackendSpec]) -> Started:
    """The new entries' replicas started, or ReloadError with all of them stopped again:
    a reload adds only what can serve."""
    try:
        started = await start_entries(gw, specs)
    except Exception as e:  # --workers: a worker that did not come up
        raise ReloadError(f"a new backend did not start: {e}", field="backends") from None
    if started.broken:
        await _stop([b for b, _ in started.backends], started)
        name, why = next(iter(started.broken.items()))
        raise ReloadError(f"{why}; nothing was changed", field=f"backends.{name}")
    return started


def _swap(gw: GatewayState, new: Settings, started: Started, leaving: list[str]) -> None:
    """The new config in effect, in one step (no await): the settings object, the
    router's replicas and models, and the fair queues' policy."""
    gone = [b for name in leaving for b in gw.entries.pop(name, [])]
    ids = {id(b) for b in gone}
    gw.router.remove(gone)
    gw.backends[:] = [b for b in gw.backends if id(b) not in ids]
    names = {b.name for b in gw.backends} | {b.name for b, _ in started.backends}
    for b in gone:
        if b.name not in names:
            gw.queues.pop(b.name, None)
            gw.backend_types.pop(b.name, None)
    retired = [s for s in gw.supervisors if s.spec.name in leaving]
    gw.supervisors[:] = [s for s in gw.supervisors if s.spec.name not in leaving]
    gw.settings = new
    gw.router.policy = new.router_policy
    for queue in gw.queues.values():
        queue.set_fairness(new.fairness or "vtc")
    route(gw, started, new.fairness)
    if gone:
        task = asyncio.create_task(_retire(gw, gone, Started(supervisors=retired)))
        gw.retiring.add(task)
        task.add_done_callback(gw.retiring.discard)


async def _retire(gw: GatewayState, gone: list[Backend], started: Started) -> None:
    """Stop removed replicas once their requests in flight have finished, or after the
    drain timeout."""
    loop = asyncio.get_running_loop()
    end = loop.time() + gw.settings.drain_timeout_s
    while any(gw.router.holding.get(id(b)) for b in gone) and loop.time() < end:
        await asyncio.sleep(0.05)  # as a remote replica's own stop waits for its requests
    await _stop(gone, started)
    log.info("backends %s stopped", ", ".join(b.name for b in gone))


async def _stop(backends: list[Backend], started: Started) -> None:
    for backend in backends:
        try:
            await backend.stop(drain=True)
        except Exception:
            log.exception("backend %s failed to stop", backend.name)
    for supervisor in started.supervisors:
        await supervisor.stop()
