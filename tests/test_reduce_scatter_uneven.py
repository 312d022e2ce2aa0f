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
    if dist.get_backend() == "gloo":  # Gloo writes a strided output as if it were contiguous
        return out
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


def disagreeing_parts(case: str) -> dict:
    """Ranks that disagree on the parts of one list-form reduce_scatter: the message on
    every rank must name ``input_tensors[0]`` and this rank's part sizes (the core sees
    an ``allreduce_coalesced`` or a ``reduce_scatter`` and names only that), and the group
    must go on working."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dtype = torch.float32
    if case == "even_vs_uneven":  # rank 0 even parts, the others uneven
        sizes = [2] * n if rank == 0 else [2] + [3] * (n - 1)
    elif case == "dtypes":  # same uneven sizes, rank 1 another dtype
        sizes, dtype = [1, 3, 2][:n], (torch.float64 if rank == 1 else torch.float32)
    else:  # "uneven_lists": the lists of mismatched_lists
        sizes = [1, 3, 2] if rank != 1 else [2, 3, 1]
    try:
        dist.reduce_scatter(torch.zeros(sizes[rank], dtype=dtype), [torch.ones(s, dtype=dtype) for s in sizes])
        raised = None
    except ValueError as exc:
        raised = str(exc)
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return {"raised": raised, "sizes": sizes, "after": t.tolist() == [n * (n + 1) / 2] * 3}


@pytest.mark.parametrize("case", ["even_vs_uneven", "dtypes", "uneven_lists"])
def test_a_disagreement_names_the_input_list_on_every_rank(worlds, backend, case):
    if backend != "flagos_shm":
        pytest.skip("what a rank sees of a mismatch is flagos_shm's")
    results = worlds(3).run(disagreeing_parts, case)
    for r in results:
        assert r["after"] and r["raised"] is not None, results
        assert f"input_tensors[0] (parts of {r['sizes']} elements" in r["raised"], results
