"""``dist.reduce_scatter`` (list form) with parts of different sizes, as Gloo allows: rank
r's output receives the reduction of every rank's ``input_list[r]``, whose size is rank
r's own. flagos_shm runs it as one coalesced allreduce of all the parts
(``Reduction._reduce_scatter_uneven``); it used to refuse it ("expected the output's 1
elements, got 2")."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.timeout(120)

SIZES = (1, 3, 2, 5)


def _part(rank: int, i: int, dtype) -> torch.Tensor:
    return (torch.arange(SIZES[i]) * 10 + 7 * rank + i).to(dtype)


def uneven_calls() -> dict:
    """Each case: (output equals the reference, inputs unchanged)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype, op in ((torch.float32, dist.ReduceOp.SUM), (torch.int64, dist.ReduceOp.MAX),
                      (torch.float64, dist.ReduceOp.AVG)):
        ins = [_part(rank, i, dtype) for i in range(n)]
        keep = [t.clone() for t in ins]
        got = torch.full((SIZES[rank],), -1, dtype=dtype)
        dist.reduce_scatter(got, ins, op=op)
        every = torch.stack([_part(q, rank, torch.float64) for q in range(n)])
        want = {dist.ReduceOp.SUM: every.sum(0), dist.ReduceOp.MAX: every.max(0).values,
                dist.ReduceOp.AVG: every.mean(0)}[op].to(dtype)
        out[f"{dtype} {op}"] = (torch.equal(got, want), all(torch.equal(a, b) for a, b in zip(ins, keep)))
    # a strided output (every other element of a buffer), written back by staging
    ins = [_part(rank, i, torch.float32) for i in range(n)]
    buf = torch.zeros(2 * SIZES[rank])
    dist.reduce_scatter(buf[::2], ins)
    want = sum(_part(q, rank, torch.float32) for q in range(n))
    out["strided output"] = (torch.equal(buf[::2], want) and not buf[1::2].any().item(), True)
    return out


def mismatched_lists() -> dict:
    """Rank 1 passes other part sizes (same total, its own part still its output's size):
    every rank must raise, and the group must go on working."""
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = [1, 3, 2] if rank != 1 else [2, 3, 1]
    try:
        dist.reduce_scatter(torch.zeros(sizes[rank]), [torch.ones(s) for s in sizes])
        raised = None
    except ValueError as exc:
        raised = str(exc)
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return {"raised": raised, "after": t.tolist() == [n * (n + 1) / 2] * 3}


@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_parts_match_the_reference(worlds, backend, world_size):
    for r in worlds(world_size).run(uneven_calls):
        assert all(ok and kept for ok, kept in r.values()), r


def test_ranks_with_different_lists_fail_on_every_rank(worlds, backend):
    if backend != "flagos_shm":
        pytest.skip("what a rank sees of a mismatch is flagos_shm's")
    results = worlds(3).run(mismatched_lists)
    for r in results:
        assert r["raised"] is not None and r["after"], results
