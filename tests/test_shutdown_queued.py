"""Shutdown with queued work: ``destroy_process_group`` (which calls the group's
``shutdown``) on a rank with asynchronous collectives that its peers never issue returns
promptly instead of waiting the group timeout for each; the queued works raise
``RuntimeError`` saying so, the running one is cut short by the abort.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from support.harness import World

pytestmark = pytest.mark.timeout(240)

GROUP_TIMEOUT_S = 60.0
PROMPT_S = 10.0


def rank_shutdown_with_queued_work() -> dict:
    rank = dist.get_rank()
    if rank != 0:
        return {}
    works = [dist.all_reduce(torch.ones(16), async_op=True) for _ in range(3)]
    t0 = time.monotonic()
    dist.destroy_process_group()
    shutdown_s = time.monotonic() - t0
    errors = []
    for w in works:
        try:
            w.wait()
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    return {"shutdown_s": shutdown_s, "all_s": time.monotonic() - t0, "errors": errors}


def test_destroy_with_unmatched_queued_collectives_is_prompt(backend):
    if backend != "flagos_shm":
        pytest.skip("measures flagos_shm's shutdown")
    world = World(2, backend, group_timeout_s=GROUP_TIMEOUT_S)
    try:
        res = world.run(rank_shutdown_with_queued_work, timeout=3 * GROUP_TIMEOUT_S)[0]
    finally:
        world.close()
        world.remove_files()
    print(f"shutdown with 3 unmatched queued all_reduce: {res['shutdown_s']:.3f} s "
          f"(all works done after {res['all_s']:.3f} s; group timeout {GROUP_TIMEOUT_S:.0f} s)")
    assert res["all_s"] < PROMPT_S, res
    assert all(e is not None for e in res["errors"]), res
    queued = [e for e in res["errors"] if "shut down with this collective still queued" in e]
    assert len(queued) >= 2, res
