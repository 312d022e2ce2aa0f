"""flagos_shm on the (emulated) ``flagos`` device: issue 3's reproducer, in the session's pools at
world sizes 2 and 3 and in a fresh process at world size 1 with a ``HashStore``.

The set-up these files share (the emulated device on ``flagos:<rank>``, references computed
another way in the same rank, skipped under ``--backend gloo``): ``support/flagos.py``.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.flagos import CALL_TIMEOUT_S, EMU_ENV, check_close, check_device, check_equal, setup_device

pytestmark = pytest.mark.timeout(240)


# ==== 9. the reproducer =================================================================

REPRO_SEED = 4242


def _repro_input(rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``x`` of the reproducer, regenerated on CPU."""
    torch.manual_seed(REPRO_SEED + rank)
    return torch.randn(10)


def rank_reproducer() -> dict:
    """The issue's reproducer on ``x = torch.randn(10, device="flagos")``: every collective
    with its values checked against references built from every rank's ``x`` on CPU.
    Returns the names of the checks that ran."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = setup_device()
    done = []
    torch.manual_seed(REPRO_SEED + rank)
    x = torch.randn(10, device="flagos")
    xs = [_repro_input(r) for r in range(n)]
    check_device(x, dev, "randn")
    check_equal(x, xs[rank], "randn on flagos vs CPU (premise of the references)")
    stacked = torch.stack(xs).double()
    last = n - 1  # root of the rooted collectives: the last rank, so not always 0

    expected = {
        dist.ReduceOp.SUM: stacked.sum(0), dist.ReduceOp.AVG: stacked.mean(0),
        dist.ReduceOp.PRODUCT: stacked.prod(0), dist.ReduceOp.MIN: stacked.amin(0),
        dist.ReduceOp.MAX: stacked.amax(0),
    }
    for op, ref in expected.items():
        y = x.clone()
        dist.all_reduce(y, op=op)
        check_device(y, dev, f"all_reduce {op}")
        check_close(y, ref, f"all_reduce {op}")
        done.append(f"all_reduce_{op}")
    y = x.clone()
    dist.all_reduce(y, op=dist._make_nccl_premul_sum(0.5))
    check_close(y, 0.5 * stacked.sum(0), "all_reduce PREMUL_SUM(0.5)")
    done.append("all_reduce_PREMUL_SUM")
    xi = (x * 100).to(torch.int64)
    ints = [(t * 100).to(torch.int64) for t in xs]
    for op, fn in ((dist.ReduceOp.BAND, torch.bitwise_and), (dist.ReduceOp.BOR, torch.bitwise_or),
                   (dist.ReduceOp.BXOR, torch.bitwise_xor)):
        y = xi.clone()
        dist.all_reduce(y, op=op)
        ref = ints[0]
        for t in ints[1:]:
            ref = fn(ref, t)
        check_device(y, dev, f"all_reduce {op}")
        check_equal(y, ref, f"all_reduce {op}")
        done.append(f"all_reduce_{op}")

    outs = [torch.full_like(x, -7.0) for _ in range(n)]
    dist.all_gather(outs, x)
    for r in range(n):
        check_device(outs[r], dev, "all_gather")
        check_equal(outs[r], xs[r], f"all_gather [{r}]")
    done.append("all_gather")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 2.13 renamed these two
        out = torch.full((n * 10,), -7.0, device=dev)
        dist.all_gather_into_tensor(out, x)
        check_device(out, dev, "all_gather_into_tensor")
        check_equal(out, torch.cat(xs), "all_gather_into_tensor")
        done.append("all_gather_into_tensor")

        # Rank r's input chunk j is x_r + j, so rank j receives sum_r(x_r) + n * j.
        big = torch.cat([x + j for j in range(n)])
        out = torch.full_like(x, -7.0)
        dist.reduce_scatter_tensor(out, big)
        check_device(out, dev, "reduce_scatter_tensor")
        check_close(out, stacked.sum(0) + n * rank, "reduce_scatter_tensor")
        done.append("reduce_scatter_tensor")

    out = torch.full_like(x, -7.0)
    dist.reduce_scatter(out, [x + j for j in range(n)], op=dist.ReduceOp.MAX)
    check_device(out, dev, "reduce_scatter")
    check_close(out, stacked.amax(0) + rank, "reduce_scatter MAX")
    done.append("reduce_scatter")

    y = x.clone()
    dist.broadcast(y, src=last)
    check_device(y, dev, "broadcast")
    check_equal(y, xs[last], "broadcast")
    done.append("broadcast")

    y = x.clone()
    dist.reduce(y, dst=last, op=dist.ReduceOp.SUM)
    check_device(y, dev, "reduce")
    if rank == last:
        check_close(y, stacked.sum(0), "reduce (root)")
    else:
        check_equal(y, xs[rank], "reduce (non-root input unchanged)")
    done.append("reduce")

    glist = [torch.full_like(x, -7.0) for _ in range(n)] if rank == last else None
    dist.gather(x, glist, dst=last)
    if rank == last:
        for r in range(n):
            check_device(glist[r], dev, "gather")
            check_equal(glist[r], xs[r], f"gather [{r}]")
    done.append("gather")

    out = torch.full_like(x, -7.0)
    dist.scatter(out, [x + j for j in range(n)] if rank == last else None, src=last)
    check_device(out, dev, "scatter")
    check_equal(out, xs[last] + rank, "scatter")
    done.append("scatter")

    # all_to_all_single, equal splits: rank r's row j is x_r + j; rank r receives x_j + r.
    inp = torch.stack([x + j for j in range(n)])
    out = torch.full_like(inp, -7.0)
    dist.all_to_all_single(out, inp)
    check_device(out, dev, "all_to_all_single")
    check_equal(out, torch.stack([xs[j] + rank for j in range(n)]), "all_to_all_single")
    # Uneven splits: rank r sends r + j + 1 rows (all x_r + j) to rank j.
    in_splits = [rank + j + 1 for j in range(n)]
    inp = torch.cat([(x + j).expand(k, 10) for j, k in enumerate(in_splits)])
    out = torch.full((sum(in_splits), 10), -7.0, device=dev)  # receives j + rank + 1 rows from j
    dist.all_to_all_single(out, inp, output_split_sizes=in_splits, input_split_sizes=in_splits)
    check_device(out, dev, "all_to_all_single (splits)")
    check_equal(out, torch.cat([(xs[j] + rank).expand(k, 10) for j, k in enumerate(in_splits)]),
                 "all_to_all_single (splits)")
    done.append("all_to_all_single")

    outs = [torch.full_like(x, -7.0) for _ in range(n)]
    dist.all_to_all(outs, [x + j for j in range(n)])
    for j in range(n):
        check_device(outs[j], dev, "all_to_all")
        check_equal(outs[j], xs[j] + rank, f"all_to_all [{j}]")
    done.append("all_to_all")

    dist.barrier()
    done.append("barrier")

    objs = [{"from": rank, "x": x.cpu().tolist()}]
    dist.broadcast_object_list(objs, src=last)
    if objs != [{"from": last, "x": xs[last].tolist()}]:
        raise AssertionError(f"broadcast_object_list: got {objs}")
    gathered = [None] * n
    dist.all_gather_object(gathered, ("rank", rank, xs[rank].tolist()))
    if gathered != [("rank", r, xs[r].tolist()) for r in range(n)]:
        raise AssertionError(f"all_gather_object: got {gathered}")
    glist = [None] * n if rank == last else None
    dist.gather_object({"r": rank}, glist, dst=last)
    if rank == last and glist != [{"r": r} for r in range(n)]:
        raise AssertionError(f"gather_object: got {glist}")
    received = [None]
    dist.scatter_object_list(received, [f"to {r}" for r in range(n)] if rank == last else None, src=last)
    if received != [f"to {rank}"]:
        raise AssertionError(f"scatter_object_list: got {received}")
    done.append("object_collectives")
    return {"device": str(dev), "checks": done}


REPRO_CHECKS = 21  # entries of rank_reproducer's "checks" (9 all_reduce ops + 12 collectives)


@pytest.mark.parametrize("world_size", [2, 3])
def test_reproducer(flagos_world, world_size):
    results = flagos_world(world_size).run(rank_reproducer, timeout=CALL_TIMEOUT_S)
    for rank, res in enumerate(results):
        assert res["device"] == f"flagos:{rank}"
        assert len(res["checks"]) == REPRO_CHECKS, res["checks"]


def child_reproducer_world1(rank: int, world_size: int, tmp: str) -> dict:
    """The reproducer verbatim: world size 1, a HashStore, device "flagos"."""
    import flagos_shm  # noqa: F401  (FLAGOS_SHM_EMULATE=1: enables the emulator)

    dist.init_process_group(backend="flagos_shm", world_size=1, rank=0, store=dist.HashStore())
    try:
        return rank_reproducer()
    finally:
        dist.destroy_process_group()


def test_reproducer_world_size_1(fresh):
    (res,) = fresh(child_reproducer_world1, 1, env=EMU_ENV)
    assert res["device"] == "flagos:0"
    assert len(res["checks"]) == REPRO_CHECKS, res["checks"]
