"""`kvgate serve --workers N`: the gateway's engines as N supervised worker processes.

Each in-process engine spec becomes N `kvgate worker` children (gateway/worker/
supervisor.py places them on GPUs or shares of the cores) and one `remote` backend
spec with a replica per worker, so the router, the catalog and the quotas see them
as they see any remote upstream. A restarted worker's cache is empty: the gateway
prefills the pins again (`on_restart`), and the worker's new epoch makes the remote
replica resync its catalog rows.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp

from gateway.backends import BackendSpec
from gateway.backends.kv_transfer import DECODE, PREFILL
from gateway.worker_pool.supervisor import WorkerStartError, WorkerSupervisor

IN_PROCESS = ("fake", "gpu", "local")


async def start_workers(
    specs: list[BackendSpec],
    workers: int,
    on_restart: Callable[[str], Awaitable[None]],
    prefill_workers: int = 0,
    env: dict[str, str] | None = None,
) -> tuple[list[BackendSpec], list[WorkerSupervisor]]:
    """The specs to build, with each in-process engine spec replaced by a remote one in
    front of its started workers (two with `prefill_workers`: the prefill workers' and
    the decode workers', each entry's role in its options); and the supervisors, for
    `stop_workers`. `env`: variables the workers get beyond the gateway's own."""
    if prefill_workers and any(s.type in IN_PROCESS and s.type != "gpu" for s in specs):
        raise WorkerStartError("--prefill-workers needs the gpu backend (it moves KV blocks)")
    if workers <= 0:
        return specs, []
    out: list[BackendSpec] = []
    supervisors: list[WorkerSupervisor] = []
    try:
        for spec in specs:
            if spec.type not in IN_PROCESS:
                out.append(spec)
                continue
            supervisor = WorkerSupervisor(
                spec, workers, on_restart=on_restart, prefill=prefill_workers, env=env
            )
            await supervisor.start()
            supervisors.append(supervisor)
            options = supervisor.remote_options()
            model = await _served_model(supervisor.urls[0], supervisor.token)
            if not prefill_workers:
                out.append(BackendSpec(spec.name, "remote", model, "", options))
                continue
            for role in (PREFILL, DECODE):
                urls = supervisor.urls_of(role)
                out.append(
                    BackendSpec(
                        spec.name, "remote", model, "", options | {"urls": urls, "role": role}
                    )
                )
    except BaseException:
        await stop_workers(supervisors)
        raise
    return out, supervisors


async def _served_model(url: str, token: str) -> str:
    """The model id the workers serve (what the engine named it), as clients will ask."""
    headers = {"Authorization": f"Bearer {token}"}
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.get(url + "/models", headers=headers) as r,
    ):
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


async def stop_workers(supervisors: list[WorkerSupervisor]) -> None:
    for supervisor in supervisors:
        await supervisor.stop()
