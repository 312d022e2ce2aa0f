"""The per-call fast path of ``allreduce`` (``Reduction._allreduce_fast``): the common case
(one contiguous CPU tensor, default options) skips staging, and every other case still
takes the full path with all its checks, on both c10d routes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.timeout(120)


def fast_and_full_paths():
    from flagos_shm import staging

    rank, n = dist.get_rank(), dist.get_world_size()
    staged = []
    real = staging.stage
    staging.stage = lambda *a, **k: staged.append(a[1]) or real(*a, **k)
    try:
        out = {}
        t = torch.full((5,), float(rank + 1))
        dist.all_reduce(t.clone())  # the first (op, dtype) pair is checked by the full path
        staged.clear()
        dist.all_reduce(t)
        out["fast"] = (t.tolist() == [n * (n + 1) / 2] * 5, len(staged))
        col = torch.arange(12, dtype=torch.float64).reshape(4, 3)[:, 1] * (rank + 1)
        dist.all_reduce(col, op=dist.ReduceOp.MAX)
        out["strided"] = (col.tolist() == [float(3 * i + 1) * n for i in range(4)], len(staged))
        try:
            dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND)
            out["band"] = None
        except TypeError as exc:
            out["band"] = str(exc)
        # async_op=True: the common case is queued without staging, the rest as before
        staged.clear()
        a = torch.full((7,), float(rank + 1))
        work = dist.all_reduce(a, async_op=True)
        fut = work.get_future()
        work.wait()
        out["async"] = (a.tolist() == [n * (n + 1) / 2] * 7, fut.wait()[0].tolist() == a.tolist(), len(staged))
        col = torch.arange(12, dtype=torch.float64).reshape(4, 3)[:, 1] * (rank + 1)
        dist.all_reduce(col, async_op=True).wait()
        out["async_strided"] = (col.tolist() == [float(3 * i + 1) * n * (n + 1) / 2 for i in range(4)], len(staged))
        i = torch.full((3,), rank + 1, dtype=torch.int32)
        dist.all_reduce(i, op=dist.ReduceOp.PRODUCT)
        out["int"] = i.tolist() == [2, 2, 2]
        return out
    finally:
        staging.stage = real


@pytest.mark.parametrize("route", ["auto", "process_group"])
def test_common_case_skips_staging_and_other_cases_keep_their_checks(worlds, backend, route):
    if backend != "flagos_shm":
        pytest.skip("flagos_shm's per-call path")
    for r in worlds(2, FLAGOS_SHM_ROUTE=route).run(fast_and_full_paths):
        assert r["fast"] == (True, 0), r
        assert r["strided"][0] and r["strided"][1] >= 1, r
        assert r["band"] and "BAND" in r["band"], r
        assert r["int"]
        assert r["async"] == (True, True, 0), r
        assert r["async_strided"][0] and r["async_strided"][1] >= 1, r
