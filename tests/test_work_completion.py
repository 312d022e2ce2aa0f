"""Works tell the truth (issue 24, item 3): ``is_completed()`` turns True once a call is done,
``get_future()`` completes with the outputs, and an error raises from ``wait()`` and fails the
future, for collectives, barrier and point-to-point, on CPU and (emulated) flagos tensors.

A caller that polls (``while not w.is_completed(): ...``, as overlap schedulers and async
checkpoint writers do) must get out of its loop: each poll here has a deadline far above what
the call needs (:data:`POLL_DEADLINE_S`), so a work that never reports completion fails the
test instead of hanging it, and nothing depends on how fast the machine is. Results are
checked against values each rank computes from every rank's inputs.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from support.flagos import CALL_TIMEOUT_S, EMU_ENV

pytestmark = pytest.mark.timeout(240)

#: How long a poll of is_completed() may take before the work counts as stuck (seconds).
POLL_DEADLINE_S = 30.0


def _poll(work) -> dict:
    """Poll ``work.is_completed()`` until True or :data:`POLL_DEADLINE_S`; report what the
    work says then."""
    deadline = time.monotonic() + POLL_DEADLINE_S
    polls = 0
    while not work.is_completed():
        polls += 1
        if time.monotonic() > deadline:
            return {"completed": False, "polls": polls}
        time.sleep(0.0005)
    # (work.exception() is not asked: torch 2.10's binding of it cannot return its value)
    return {"completed": True, "success": work.is_success()}


def rank_polls(device: str) -> dict:
    """Every kind of call with ``async_op=True``, each polled to completion before its value
    is read (no wait() first)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device(device, rank) if device != "cpu" else torch.device("cpu")
    if device != "cpu":
        torch.get_device_module(device).set_device(rank)
    out = {}

    t = torch.arange(1000, dtype=torch.float32, device=dev) + rank
    work = dist.all_reduce(t, async_op=True)
    out["all_reduce"] = _poll(work)
    fut = work.get_future()
    value = fut.wait()
    out["all_reduce_future"] = [v.cpu().tolist()[:3] for v in value]
    out["all_reduce_value"] = t.cpu().tolist()[:3]
    # a work that is complete when made (a small synchronous-looking call) reports it too
    u = torch.full((4,), float(rank), device=dev)
    work = dist.all_reduce(u, async_op=True)
    work.wait()
    out["after_wait"] = {"completed": work.is_completed(), "future_done": work.get_future().done()}

    b = torch.full((3,), float(rank + 7), device=dev)
    work = dist.broadcast(b, src=n - 1, async_op=True)
    out["broadcast"] = _poll(work)
    out["broadcast_value"] = b.cpu().tolist()

    work = dist.barrier(async_op=True)
    out["barrier"] = _poll(work)

    g = torch.empty(2 * n, device=dev)
    work = dist.all_gather_into_tensor(g, torch.full((2,), float(rank), device=dev), async_op=True)
    out["all_gather"] = _poll(work)
    out["all_gather_value"] = g.cpu().tolist()

    # point-to-point around the ring
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    send = dist.isend(torch.full((5,), float(rank), device=dev), nxt)
    recv_buf = torch.empty(5, device=dev)
    recv = dist.irecv(recv_buf, prv)
    out["isend"] = _poll(send)
    out["irecv"] = _poll(recv)
    out["irecv_value"] = recv_buf.cpu().tolist()
    return out


def rank_error_fails_work_and_future(device: str) -> dict:
    """Ranks disagree on the element count of an async allreduce: the work completes
    unsuccessfully, ``wait()`` raises ValueError, the future fails; the group stays usable."""
    rank = dist.get_rank()
    dev = torch.device(device, rank) if device != "cpu" else torch.device("cpu")
    if device != "cpu":
        torch.get_device_module(device).set_device(rank)
    t = torch.ones(4 + rank, device=dev)
    work = dist.all_reduce(t, async_op=True)
    out = {"poll": _poll(work)}
    try:
        work.wait()
        out["wait"] = "no error"
    except ValueError as exc:
        out["wait"] = f"ValueError: {exc}"
    try:
        work.get_future().wait()
        out["future"] = "no error"
    except Exception as exc:  # noqa: BLE001  the type torch re-raises with is reported
        out["future"] = f"{type(exc).__name__}: {exc}"
    after = torch.full((2,), float(rank), device=dev)
    dist.all_reduce(after)
    out["after"] = after.cpu().tolist()
    return out


@pytest.fixture(params=["cpu", "flagos"])
def device_world(request, worlds, backend, emulator_built):  # noqa: F811
    if backend != "flagos_shm":
        pytest.skip("flagos_shm's works")
    env = EMU_ENV if request.param == "flagos" else {}
    return request.param, worlds(2, **env)


def test_polling_is_completed_returns_for_every_kind_of_call(device_world):
    device, world = device_world
    n = 2
    results = world.run(rank_polls, device, timeout=CALL_TIMEOUT_S)
    for rank, res in enumerate(results):
        for kind in ("all_reduce", "broadcast", "barrier", "all_gather", "isend", "irecv"):
            assert res[kind] == {"completed": True, "success": True}, (kind, res)
        total = [float(sum(i + q for q in range(n))) for i in range(3)]
        assert res["all_reduce_value"] == total, res
        assert res["all_reduce_future"] == [total], res  # the future's value: the output tensors
        assert res["after_wait"] == {"completed": True, "future_done": True}, res
        assert res["broadcast_value"] == [float(n - 1 + 7)] * 3, res
        assert res["all_gather_value"] == [float(q) for q in range(n) for _ in range(2)], res
        assert res["irecv_value"] == [float((rank - 1) % n)] * 5, res


def test_an_error_completes_the_work_unsuccessfully_and_fails_its_future(device_world):
    device, world = device_world
    for res in world.run(rank_error_fails_work_and_future, device, timeout=CALL_TIMEOUT_S):
        assert res["poll"] == {"completed": True, "success": False}, res
        assert res["wait"].startswith("ValueError") and "4" in res["wait"] and "5" in res["wait"], res
        assert res["future"] != "no error" and "4" in res["future"], res
        assert res["after"] == [1.0, 1.0], res
