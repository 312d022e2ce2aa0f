"""The fast paths after an asynchronous call that wrote its outputs back late (a list form,
a staged output): once that work has completed, the next calls take the fast paths again.
They used to test only that the group's list of such works (``_pending``) was empty, and
only the full path forgot completed works, so after one ``all_gather(list, ...,
async_op=True)`` every later fast-path call (allreduce, all_to_all_single, ...) staged its
tensors until some call took the full path."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.stage_probe import counting_stages

pytestmark = pytest.mark.timeout(120)


def fast_after_async_write_back() -> dict:
    """Each case: (result as expected, tensors staged by the fast-path call)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    dist.all_reduce(torch.ones(4))  # a first (op, dtype) takes the full path once (check_op)
    with counting_stages() as staged:
        for name in ("allreduce", "all_to_all_single", "broadcast", "all_gather_into_tensor"):
            pieces = [torch.zeros(3) for _ in range(n)]
            dist.all_gather(pieces, torch.full((3,), float(rank)), async_op=True).wait()
            ok = all(p.tolist() == [float(r)] * 3 for r, p in enumerate(pieces))
            staged.clear()
            if name == "allreduce":
                t = torch.full((4,), float(rank + 1))
                dist.all_reduce(t)
                ok = ok and t.tolist() == [n * (n + 1) / 2] * 4
            elif name == "all_to_all_single":
                t = torch.empty(2 * n)
                dist.all_to_all_single(t, torch.arange(2 * n, dtype=torch.float32) + 10 * rank)
                ok = ok and t.tolist() == [float(2 * rank + j + 10 * q) for q in range(n) for j in range(2)]
            elif name == "broadcast":
                t = torch.full((4,), float(rank + 7))
                dist.broadcast(t, 0)
                ok = ok and t.tolist() == [7.0] * 4
            else:
                t = torch.empty(2 * n)
                dist.all_gather_into_tensor(t, torch.full((2,), float(rank)))
                ok = ok and t.tolist() == [float(q) for q in range(n) for _ in range(2)]
            out[name] = (ok, len(staged))
    return out


def test_a_completed_async_write_back_does_not_keep_calls_off_the_fast_paths(worlds, backend):
    if backend != "flagos_shm":
        pytest.skip("the fast paths are flagos_shm's")
    for r in worlds(2).run(fast_after_async_write_back):
        assert r == {name: (True, 0) for name in r}, r
