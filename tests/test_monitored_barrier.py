"""monitored_barrier's failures, in Gloo's words (PyTorch's distributed_test matches them).

Three ranks on CPU, each scenario on its own group (a rank that skips a monitored_barrier
would otherwise be one call behind on the next): one rank missing, two missing with
``wait_all_ranks=True``, and a zero timeout, which rank 0 must honour at once instead of
waiting for the group's timeout.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.spawn import spawn  # noqa: E402

pytestmark = pytest.mark.timeout(200)


def _timed(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - t0}


def child_failures(rank: int, world_size: int, tmp: str) -> dict:
    import flagos_shm  # noqa: F401  (registers the backend)

    dist.init_process_group("flagos_shm", init_method="file://" + os.path.join(tmp, "store"), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=40))
    store = dist.distributed_c10d._get_default_store()
    res = {}
    try:
        one, both, zero = (dist.new_group(list(range(world_size))) for _ in range(3))
        if rank != 2:  # rank 2 never comes; rank 1 waits with a long timeout of its own
            res["one"] = _timed(lambda: dist.monitored_barrier(one, timedelta(seconds=1 if rank == 0 else 30)))
        if rank == 0:
            res["both"] = _timed(lambda: dist.monitored_barrier(both, timedelta(seconds=1), wait_all_ranks=True))
            res["zero"] = _timed(lambda: dist.monitored_barrier(zero, timedelta(seconds=0)))
        store.set(f"done_{rank}", "1")
        store.wait([f"done_{r}" for r in range(world_size)], timedelta(seconds=60))
        return res
    finally:
        dist.destroy_process_group()


def test_monitored_barrier_reports_in_gloo_words():
    # Through torch's own monitored_barrier where it accepts the group (newer torch), through
    # flagos_shm's replacement of it where torch refuses every group not named "gloo" (2.10).
    r0, r1, _ = spawn(child_failures, 3)
    assert "Rank 2 failed to pass monitoredBarrier in 1000 ms" in r0["one"]["error"], r0
    assert "Ranks 1, 2 failed to pass monitoredBarrier" in r0["both"]["error"], r0
    assert "Rank 0 timed out in monitoredBarrier after 0 ms" in r0["zero"]["error"], r0
    assert r0["zero"]["seconds"] < 10, r0  # not the group's 40 s
    # Rank 1 arrived: it learns of rank 0's failure without waiting out its own 30 s.
    assert ("Rank 1 successfully reached monitoredBarrier, but received errors while waiting for "
            "send/recv from rank 0") in r1["one"]["error"], r1
    assert r1["one"]["seconds"] < 20, r1
