"""Bad input: a rank with invalid arguments raises ValueError/TypeError naming the argument;
its peers raise too (instead of hanging), naming it as well; the group keeps working.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from support.checks import rank_and_size


# ---- bad input ------------------------------------------------------------------------------------

def _try(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None


def rank_bad_input(case: str, bad_rank: int) -> dict:
    """One rank (``bad_rank``; -1 for all) passes invalid arguments; report what each rank
    raised, and whether the group still computes a correct all_reduce afterwards."""
    rank, n = rank_and_size()
    bad = rank == bad_rank or bad_rank == -1
    f32 = torch.float32
    if case == "all_gather_into_tensor output size":
        out = torch.zeros(n * 4 + (1 if bad else 0))
        err = _try(lambda: dist.all_gather_into_tensor(out, torch.ones(4)))
    elif case == "reduce_scatter_tensor input size":
        err = _try(lambda: dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(n * 4 - (1 if bad else 0))))
    elif case == "all_gather list length":
        outs = [torch.zeros(4) for _ in range(n + (1 if bad else 0))]
        err = _try(lambda: dist.all_gather(outs, torch.ones(4)))
    elif case == "reduce_scatter list length":
        ins = [torch.ones(4) for _ in range(n + (1 if bad else 0))]
        err = _try(lambda: dist.reduce_scatter(torch.zeros(4), ins))
    elif case == "all_gather_into_tensor mixed dtypes":
        out = torch.zeros(n * 4, dtype=torch.float64 if bad else f32)
        err = _try(lambda: dist.all_gather_into_tensor(out, torch.ones(4)))
    elif case == "all_to_all_single output size":
        out = torch.zeros(n * 2 + (n if bad else 0), dtype=torch.int64)
        err = _try(lambda: dist.all_to_all_single(out, torch.ones(n * 2, dtype=torch.int64)))
    elif case == "reduce_scatter_tensor mixed dtypes":
        out = torch.zeros(4, dtype=torch.float64 if bad else f32)
        err = _try(lambda: dist.reduce_scatter_tensor(out, torch.ones(n * 4)))
    elif case == "all_gather_into_tensor count differs between ranks":
        k = 5 if bad else 4
        err = _try(lambda: dist.all_gather_into_tensor(torch.zeros(n * k), torch.ones(k)))
    elif case == "all_reduce_coalesced mixed dtypes":
        # torch checks dtypes of all_reduce_coalesced itself, so use the coalescing manager
        def go():
            with dist._coalescing_manager(group=dist.group.WORLD):
                dist.all_reduce(torch.ones(3))
                dist.all_reduce(torch.ones(3, dtype=torch.float64 if bad else f32))
        err = _try(go)
    elif case == "all_reduce count differs between ranks":
        err = _try(lambda: dist.all_reduce(torch.ones(5 + (1 if bad else 0))))
    elif case == "all_reduce dtype differs between ranks":
        err = _try(lambda: dist.all_reduce(torch.ones(5, dtype=torch.float64 if bad else f32)))
    elif case == "all_reduce op differs between ranks":
        err = _try(lambda: dist.all_reduce(torch.ones(5), op=dist.ReduceOp.MAX if bad else dist.ReduceOp.SUM))
    elif case == "broadcast root differs between ranks":
        err = _try(lambda: dist.broadcast(torch.ones(5), src=(rank + 1) % n if bad else 0))
    elif case == "all_to_all_single split sizes differ between ranks":
        rows = [1, 2, 3] if bad else [2] * n
        err = _try(lambda: dist.all_to_all_single(torch.zeros(2 * n), torch.ones(2 * n), rows[::-1], rows))
    elif case == "all_reduce premul_sum factor differs between ranks":
        err = _try(lambda: dist.all_reduce(torch.ones(5), op=dist._make_nccl_premul_sum(3.0 if bad else 2.0)))
    elif case == "bitwise op on float, all ranks":
        err = _try(lambda: dist.all_reduce(torch.ones(5), op=dist.ReduceOp.BAND))
    elif case == "avg on bool, all ranks":
        err = _try(lambda: dist.all_reduce(torch.ones(5, dtype=torch.bool), op=dist.ReduceOp.AVG))
    else:
        raise ValueError(f"unknown case {case!r}")
    t = torch.arange(6, dtype=f32) + rank
    after = _try(lambda: dist.all_reduce(t))
    expected = torch.arange(6, dtype=f32) * n + n * (n - 1) / 2
    return {"error": err, "after": after or (None if torch.equal(t, expected) else f"wrong result {t.tolist()}")}


BAD_INPUT_CASES = {
    # case: (bad rank (-1: all ranks), the argument the bad rank's error message must name,
    #        accepted error types). Only cases that torch.distributed passes on to the backend:
    # torch validates some arguments itself before (e.g. mixed dtypes of all_to_all_single)
    # and then only that rank raises, whatever the backend.
    "all_gather_into_tensor output size": (1, "output", ("ValueError",)),
    "reduce_scatter_tensor input size": (0, "input", ("ValueError",)),
    "all_gather list length": (1, "output_tensors", ("ValueError",)),
    "reduce_scatter list length": (0, "input_tensors", ("ValueError",)),
    "all_gather_into_tensor mixed dtypes": (1, "dtype", ("TypeError", "ValueError")),
    "all_to_all_single output size": (0, "output", ("ValueError",)),
    "reduce_scatter_tensor mixed dtypes": (2, "dtype", ("TypeError", "ValueError")),
    "all_gather_into_tensor count differs between ranks": (1, "", ("ValueError",)),
    "all_reduce_coalesced mixed dtypes": (1, "dtype", ("TypeError", "ValueError")),
    "all_reduce count differs between ranks": (1, "", ("ValueError",)),
    "all_reduce dtype differs between ranks": (1, "", ("ValueError",)),
    "all_reduce op differs between ranks": (0, "", ("ValueError",)),
    "broadcast root differs between ranks": (1, "", ("ValueError",)),
    "all_to_all_single split sizes differ between ranks": (1, "split sizes", ("ValueError",)),
    "all_reduce premul_sum factor differs between ranks": (0, "factor", ("ValueError",)),
    "bitwise op on float, all ranks": (-1, "BAND", ("TypeError",)),
    "avg on bool, all ranks": (-1, "AVG", ("TypeError",)),
}


@pytest.mark.parametrize("case", list(BAD_INPUT_CASES))
def test_bad_input_raises_on_every_rank(worlds, backend, case):
    """A rank with invalid arguments raises ValueError/TypeError naming the argument; its
    peers raise too (instead of hanging) naming it as well; the group keeps working."""
    if backend == "gloo":
        pytest.skip("gloo hangs or crashes on mismatched arguments")
    bad_rank, argument, types = BAD_INPUT_CASES[case]
    world_size = 3
    world = worlds(world_size)
    try:
        results = world.run(rank_bad_input, case, bad_rank, timeout=90)
    finally:
        world.check_health()  # a group left unusable is replaced, not passed to the next test
    problems = []
    for rank, rep in enumerate(results):
        err = rep["error"]
        if err is None:
            problems.append(f"rank {rank}: nothing raised")
            continue
        if err[0] not in types:
            problems.append(f"rank {rank}: raised {err[0]} (expected {'/'.join(types)}): {err[1]}")
        if rank == bad_rank or bad_rank == -1:
            if argument not in err[1]:
                problems.append(f"rank {rank} (bad input): message does not name {argument!r}: {err[1]}")
        elif bad_rank >= 0 and f"rank {bad_rank}" not in err[1]:
            problems.append(f"rank {rank} (peer): message does not name rank {bad_rank}: {err[1]}")
        if rep["after"] is not None:
            problems.append(f"rank {rank}: all_reduce afterwards: {rep['after']}")
    assert not problems, f"{case}:\n" + "\n".join(problems)
