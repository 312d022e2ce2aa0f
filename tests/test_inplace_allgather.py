"""FSDP's in-place all-gather: ``all_gather_into_tensor(out, out[rank * k:(rank + 1) * k])``.

The core reads an input that is exactly the rank's piece of the output where it lies
instead of copying it first, on the fast path (``_all_gather_single_fast``: nothing staged)
and on the full one (``_stage_pair(..., own_piece=True)``, taken here by passing a per-call
timeout); an input that overlaps the output any other way is still copied. Checked against
the per-rank formula, on the slot path (one chunk and several) and on the single-copy path."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.stage_probe import counting_stages

pytestmark = pytest.mark.timeout(180)


def rank_in_place(k: int) -> dict:
    from datetime import timedelta

    from torch._C import _distributed_c10d as c10d

    from flagos_shm.backend import shm_part

    rank, n = dist.get_rank(), dist.get_world_size()
    with counting_stages() as staged:
        want = torch.cat([torch.arange(k, dtype=torch.float32) + 1000 * r for r in range(n)])
        out = torch.full((n * k,), -1.0)
        out[rank * k:(rank + 1) * k] = torch.arange(k, dtype=torch.float32) + 1000 * rank
        dist.all_gather_into_tensor(out, out[rank * k:(rank + 1) * k])
        exact = (torch.equal(out, want), len(staged))
        # the full path (a per-call timeout is not the fast path's common case)
        staged.clear()
        out3 = torch.full((n * k,), -1.0)
        out3[rank * k:(rank + 1) * k] = torch.arange(k, dtype=torch.float32) + 1000 * rank
        opts = c10d.AllgatherOptions()
        opts.timeout, opts.asyncOp = timedelta(seconds=60), False
        work = shm_part(dist.group.WORLD).all_gather_single(out3, out3[rank * k:(rank + 1) * k], opts)
        if work is not None:
            work.wait()
        exact_full = (torch.equal(out3, want), len(staged))
        # an input overlapping the output but not as this rank's piece: copied first
        staged.clear()
        out2 = torch.full((n * k + 1,), -1.0)
        src = torch.arange(k, dtype=torch.float32) + 1000 * rank
        out2[1:k + 1] = src
        dist.all_gather_into_tensor(out2[:n * k], out2[1:k + 1])
        shifted = (torch.equal(out2[:n * k], want), len(staged))
        return {"exact": exact, "exact_full": exact_full, "shifted": shifted}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("env", [{}, {"FLAGOS_SHM_SLOT_BYTES": "4096", "FLAGOS_SHM_CMA": "0"},
                                 {"FLAGOS_SHM_PLAN": "single_copy=1K"}], ids=["slots", "many_chunks", "single_copy"])
def test_in_place_all_gather_reads_the_input_where_it_lies(worlds, backend, world_size, env):
    if backend != "flagos_shm":
        pytest.skip("flagos_shm's staging")
    for r in worlds(world_size, **env).run(rank_in_place, 3000):
        assert r["exact"] == (True, 0), r  # the fast path: nothing staged
        assert r["exact_full"] == (True, 2), r  # output and input staged, no copy of the input
        assert r["shifted"][0] and r["shifted"][1] == 3, r  # the overlapping input copied
