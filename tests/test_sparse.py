"""Sparse (COO) allreduce on flagos_shm, SUM as Gloo does it: the
result equals the dense sum of every rank's tensor (each rank builds all ranks' inputs
itself to compute it), for uncoalesced inputs with duplicates, hybrid (sparse + dense
dimensions) tensors, a rank with no entries, several dtypes; bad calls raise on every rank.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(240)
CALL_TIMEOUT_S = 120.0
ROUTES = {"adapter": {}}  # one c10d adapter on every torch


def _sparse(rank: int, case: str, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(17 * rank + len(case))
    if case == "empty_on_rank_1" and rank == 1:
        nnz = 0
    else:
        nnz = 3 + 2 * rank
    shape = (7, 5) if case != "hybrid" else (6, 4, 3)
    idx = torch.stack([torch.randint(0, shape[0], (nnz,), generator=g),
                       torch.randint(0, shape[1], (nnz,), generator=g)])
    if case == "duplicates" and nnz:
        idx[:, -1] = idx[:, 0]  # uncoalesced: a repeated index
        idx = idx[:, :nnz]
    if case == "hybrid":
        val = torch.randint(-4, 5, (nnz, 3), generator=g)
        return torch.sparse_coo_tensor(idx[:2], val.to(dtype), shape)
    val = torch.randint(-4, 5, (nnz,), generator=g).to(dtype)
    return torch.sparse_coo_tensor(idx, val, shape)


CASES = ["duplicates", "hybrid", "empty_on_rank_1"]
DTYPES = [torch.float32, torch.float64, torch.int64]


def rank_sparse_sum() -> dict:
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for case in CASES:
        for dtype in DTYPES:
            t = _sparse(rank, case, dtype)
            want = sum(_sparse(r, case, dtype).to_dense() for r in range(n))
            work = dist.all_reduce(t, async_op=(dtype == torch.float64))
            if work is not None:
                work.wait()
            out[f"{case}/{dtype}"] = (t.is_sparse and t.is_coalesced() and torch.equal(t.to_dense(), want)
                                      and t._values().dtype == dtype)
    return out


def rank_sparse_errors() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    try:
        dist.all_reduce(_sparse(rank, "duplicates", torch.float32), op=dist.ReduceOp.MAX)
        out["max"] = None
    except (ValueError, RuntimeError) as exc:
        out["max"] = f"{type(exc).__name__}: {exc}"
    bad = torch.sparse_coo_tensor(torch.zeros((2, 1), dtype=torch.int64), torch.ones(1), (3 + rank, 3))
    try:
        dist.all_reduce(bad)
        out["shape"] = None
    except (ValueError, RuntimeError) as exc:
        out["shape"] = f"{type(exc).__name__}: {exc}"
    x = torch.ones(3)
    dist.all_reduce(x)  # the group is still usable
    out["after"] = x.tolist()
    return out


@pytest.fixture(params=list(ROUTES))
def route_env(request, backend):
    if backend != "flagos_shm":
        pytest.skip("flagos_shm's own sparse allreduce")
    return ROUTES[request.param]


@pytest.mark.parametrize("world_size", [2, 3])
def test_sparse_allreduce_sum_matches_dense_sum(worlds, route_env, world_size):
    for res in worlds(world_size, **route_env).run(rank_sparse_sum, timeout=CALL_TIMEOUT_S):
        assert res and all(res.values()), res


def test_sparse_allreduce_bad_calls_raise_on_every_rank(worlds, route_env):
    n = 2
    for res in worlds(n, **route_env).run(rank_sparse_errors, timeout=CALL_TIMEOUT_S):
        assert res["max"] and "SUM" in res["max"], res
        assert res["shape"] and "disagree" in res["shape"], res
        assert res["after"] == [float(n)] * 3
