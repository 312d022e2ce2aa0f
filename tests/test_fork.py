"""Fork safety: a child forked after ``init_process_group`` that calls a collective on the
inherited group gets a clear ``RuntimeError`` (it must not take its parent's place among the
peers), and the parent's group stays correct.
"""

from __future__ import annotations

import os
import select
import signal
import time

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.timeout(120)

CHILD_TIMEOUT_S = 30.0


def _child(write_fd: int) -> None:
    """In the forked child: try a collective on the inherited group, report, exit."""
    try:
        t = torch.full((8,), 100.0)
        try:
            dist.all_reduce(t)
            msg = f"no error; result {t[0].item()}"
        except RuntimeError as e:
            msg = f"RuntimeError: {e}"
        except BaseException as e:  # noqa: BLE001  anything else is a failure to report
            msg = f"{type(e).__name__}: {e}"
        os.write(write_fd, msg.encode()[:4000])
    finally:
        os._exit(0)


def _fork_and_collect() -> str:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(w)
    os.close(w)
    chunks, deadline = [], time.monotonic() + CHILD_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            data = os.read(r, 4096)
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(r)
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == 0:  # still running after the deadline (or after reporting): kill it
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return b"".join(chunks).decode() or "child reported nothing within the timeout"


def rank_fork_then_collective() -> dict:
    rank = dist.get_rank()
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t)  # the group works before the fork
    child = None
    if rank == 0:
        child = _fork_and_collect()
    # Rank 1 is already waiting here; it must pair with rank 0, not with rank 0's child.
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t)
    return {"child": child, "after": t.tolist(), "pid": os.getpid()}


def test_forked_child_gets_runtime_error_and_parent_group_stays_correct(worlds, backend):
    if backend != "flagos_shm":
        pytest.skip("checks flagos_shm's fork guard")
    t0 = time.monotonic()
    results = worlds(2).run(rank_fork_then_collective)
    child = results[0]["child"]
    assert child.startswith("RuntimeError:"), child
    assert f"created by pid {results[0]['pid']}" in child, child
    assert "forked child must create its own process group" in child, child
    for rank, res in enumerate(results):
        assert res["after"] == [3.0] * 8, (rank, res)
    assert time.monotonic() - t0 < 60
