"""WorkerSupervisor with real `kvgate worker` processes: start, kill -9 and restart on the
same address with a new epoch, stop without leaving a process behind; and where it
places workers (GPUs, shares of the cores)."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import psutil
import pytest

from gateway.backends import BackendSpec
from gateway.worker_pool.placement import place_workers, split_cores
from gateway.worker_pool.supervisor import WorkerStartError, WorkerSupervisor

FAKE = BackendSpec("fake", "fake", "", "m", {"tokens_per_second": 500})


async def health(url: str) -> dict:
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.get(url.removesuffix("/v1") + "/health")
        assert r.status_code == 200
        return r.json()


def alive(pids: list[int]) -> list[int]:
    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    return [pid for pid in pids if pid in ours]


async def test_a_killed_worker_is_restarted_on_its_address_with_a_new_epoch():
    restarted: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

    async def on_restart(url: str) -> None:
        await restarted.put((url, (await health(url))["epoch"]))  # it is healthy by now

    sup = WorkerSupervisor(FAKE, 2, on_restart=on_restart, backoff_s=(0.1, 1.0))
    await sup.start()
    pids = [w.proc.pid for w in sup.workers]
    try:
        assert len(set(sup.urls)) == 2
        epochs = [(await health(url))["epoch"] for url in sup.urls]
        async with httpx.AsyncClient(timeout=10) as c:
            for url in sup.urls:
                assert (await c.get(url + "/models")).status_code == 401
                auth = {"Authorization": f"Bearer {sup.remote_options()['api_key']}"}
                models = (await c.get(url + "/models", headers=auth)).json()
                assert [m["id"] for m in models["data"]] == ["m"]
        cores = sorted(os.sched_getaffinity(0))
        for w, share in zip(sup.workers, split_cores(cores, 2), strict=True):
            assert os.sched_getaffinity(w.proc.pid) == set(share)

        os.kill(pids[0], signal.SIGKILL)
        url, epoch = await asyncio.wait_for(restarted.get(), 60)
        assert url == sup.urls[0] and sup.remote_options()["urls"] == sup.urls
        assert epoch not in epochs
        assert sup.workers[0].restarts == 1 and sup.workers[0].proc.pid != pids[0]
        pids.append(sup.workers[0].proc.pid)
        assert (await health(sup.urls[1]))["epoch"] == epochs[1]  # the other one untouched
    finally:
        await sup.stop()
    assert all(w.proc.returncode is not None for w in sup.workers)
    assert alive(pids) == []


async def test_stop_kills_a_worker_that_does_not_end_on_sigterm():
    sup = WorkerSupervisor(FAKE, 1, grace_s=0.5)
    await sup.start()
    proc = sup.workers[0].proc
    os.kill(proc.pid, signal.SIGSTOP)  # a stopped process cannot act on SIGTERM
    await sup.stop()
    assert proc.returncode == -signal.SIGKILL
    assert alive([proc.pid]) == []


async def test_a_worker_that_cannot_start_fails_start_and_leaves_nothing():
    spec = BackendSpec("local", "local", "/nonexistent/model.gguf", "m", {})
    sup = WorkerSupervisor(spec, 2)
    with pytest.raises(WorkerStartError, match="model file not found"):
        await sup.start()
    assert alive([w.proc.pid for w in sup.workers if w.proc]) == []


async def test_a_relay_whose_start_was_given_up_ends_quietly():
    """Another worker failed first and start() cancelled this one's wait on `ready` while
    its process, its output already closed, was still exiting: the relay must not raise."""
    sup = WorkerSupervisor(FAKE, 1)
    proc = await asyncio.create_subprocess_exec(
        "sh", "-c", "exec >&-; sleep 0.3", stdout=asyncio.subprocess.PIPE
    )
    ready = asyncio.get_running_loop().create_future()
    relay = asyncio.create_task(sup._relay(sup.workers[0], proc, ready))
    while not proc.stdout.at_eof():
        await asyncio.sleep(0.01)
    for _ in range(3):  # a few turns of the loop: the relay, past its output, awaits the exit
        await asyncio.sleep(0)
    ready.cancel()
    await relay  # raised InvalidStateError before the relay looked at `ready` again
    assert proc.returncode == 0 and ready.cancelled()


@pytest.mark.parametrize(
    ("cores", "n", "shares"),
    [
        ([0, 1], 2, [[0], [1]]),
        ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
        ([0, 1], 3, [[0], [1], [0]]),  # fewer cores than workers: shared in turn
        ([4, 6], 1, [[4, 6]]),
    ],
)
def test_cores_are_split_between_workers(cores, n, shares):
    assert split_cores(cores, n) == shares


def test_placement_per_backend():
    local = place_workers(BackendSpec("l", "local"), 2, [0, 1, 2, 3], [])
    assert [(p.cpus, p.options, p.env) for p in local] == [
        ([0, 1], {"n_threads": 2}, {}),
        ([2, 3], {"n_threads": 2}, {}),
    ]
    # a configured thread count is kept
    pinned = place_workers(BackendSpec("l", "local", options={"n_threads": 1}), 2, [0, 1], [])
    assert [p.options for p in pinned] == [{}, {}]
    cpu_torch = place_workers(BackendSpec("g", "gpu"), 2, [0, 1, 2, 3], ["0", "1"])
    assert [(p.cpus, p.env) for p in cpu_torch] == [
        ([0, 1], {"OMP_NUM_THREADS": "2"}),
        ([2, 3], {"OMP_NUM_THREADS": "2"}),
    ]
    cuda = BackendSpec("g", "gpu", options={"device": "cuda:1"})
    per_gpu = place_workers(cuda, 3, [0, 1], ["2", "3"])
    assert [(p.env, p.options, p.cpus) for p in per_gpu] == [
        ({"CUDA_VISIBLE_DEVICES": "2"}, {"device": "cuda"}, None),
        ({"CUDA_VISIBLE_DEVICES": "3"}, {"device": "cuda"}, None),
        ({"CUDA_VISIBLE_DEVICES": "2"}, {"device": "cuda"}, None),
    ]
    one_gpu = place_workers(cuda, 2, [0, 1], ["0"])  # one GPU: they share it, split the cores
    assert [(p.env, p.cpus) for p in one_gpu] == [
        ({"OMP_NUM_THREADS": "1"}, [0]),
        ({"OMP_NUM_THREADS": "1"}, [1]),
    ]
