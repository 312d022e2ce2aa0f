"""Subgroups: the world group and subgroups interleaved, and two threads issuing collectives
on two groups at once, checked against references (``support.checks.Checker``): no state
leaks between groups.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from support.checks import Checker, assert_clean, rank_and_size
from support.reference import all_inputs, compare, reference_reduce, sizes, tname


# ---- subgroups ----------------------------------------------------------------------------------

def rank_subgroups() -> dict:
    """Two subgroups (even and odd ranks, ``new_group(backend=<the world's backend>)``) used
    interleaved with the world group, then destroyed; each group gets its own segment and
    none is left in ``FLAGOS_SHM_DIR``."""
    rank, n = rank_and_size()
    ck = Checker()
    backend = dist.get_backend()
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    g_even = dist.new_group(evens, backend=backend)
    g_odd = dist.new_group(odds, backend=backend) if odds else None
    mine, members = (g_even, evens) if rank in evens else (g_odd, odds)
    try:
        dist.barrier()  # every rank has attached to both subgroups' segments
        if backend != "gloo":
            left = sorted(f for f in os.listdir(os.environ["FLAGOS_SHM_DIR"]) if f.startswith("flagos_shm-"))
            ck.check_true("segments after new_group", not left, f"segment files not unlinked: {left}")
        for step in range(3):
            for dtype in (torch.float32, torch.int64, torch.bfloat16):
                for numel in (5, sizes(dtype)[-1]) if step == 0 else (5,):
                    tag = f"step {step} {tname(dtype)} numel={numel}"
                    # world all_reduce
                    inputs = all_inputs(dtype, numel, n, "sub_world", step)
                    t = inputs[rank].clone()
                    if ck.call(f"world all_reduce {tag}", lambda: dist.all_reduce(t)):
                        ck.check(f"world all_reduce {tag}", t, reference_reduce(inputs, "SUM"), op="SUM",
                                 inputs=inputs)
                    # subgroup all_reduce
                    sub_inputs = all_inputs(dtype, numel, n, "sub_group", step)
                    t = sub_inputs[rank].clone()
                    mine_inputs = [sub_inputs[r] for r in members]
                    case = f"subgroup {members} all_reduce {tag}"
                    if ck.call(case, lambda: dist.all_reduce(t, group=mine)):
                        ck.check(case, t, reference_reduce(mine_inputs, "SUM"), op="SUM", inputs=mine_inputs)
                    # world all_gather_into_tensor
                    out = torch.ones(n * numel, dtype=dtype)
                    case = f"world all_gather_into_tensor {tag}"
                    if ck.call(case, lambda: dist.all_gather_into_tensor(out, inputs[rank].clone())):
                        ck.check(case, out, torch.cat(inputs))
                    # subgroup broadcast from its last member (group-local rank len-1)
                    t = sub_inputs[rank].clone()
                    src = members[-1]
                    case = f"subgroup {members} broadcast from {src} {tag}"
                    if ck.call(case, lambda: dist.broadcast(t, src=src, group=mine)):
                        ck.check(case, t, sub_inputs[src])
                    # subgroup all_gather
                    out = torch.ones(len(members) * numel, dtype=dtype)
                    case = f"subgroup {members} all_gather_into_tensor {tag}"
                    if ck.call(case, lambda: dist.all_gather_into_tensor(out, sub_inputs[rank].clone(), group=mine)):
                        ck.check(case, out, torch.cat(mine_inputs))
            if ck.call(f"world barrier step {step}", dist.barrier):
                ck.checked += 1
    finally:
        dist.barrier()
        for g in (g_even, g_odd):
            if g is not None:
                dist.destroy_process_group(g)
    if backend != "gloo":
        left = sorted(f for f in os.listdir(os.environ["FLAGOS_SHM_DIR"]) if f.startswith("flagos_shm-"))
        ck.check_true("segments after destroying the subgroups", not left, f"segment files left: {left}")
    # the world group still works
    t = torch.ones(4)
    if ck.call("world all_reduce after destroying subgroups", lambda: dist.all_reduce(t)):
        ck.check("world all_reduce after destroying subgroups", t, torch.full((4,), float(n)))
    return ck.report()


def rank_threads(iterations: int) -> dict:
    """Two threads per rank, each issuing collectives (sync and ``async_op=True``) on its
    own process group over the same ranks, at the same time: groups must not share state."""
    import threading

    rank, n = rank_and_size()
    backend = dist.get_backend()
    groups = [dist.new_group(list(range(n)), backend=backend) for _ in range(2)]
    ck = Checker()
    failures: list = [[], []]
    counts = [0, 0]

    def worker(idx: int) -> None:
        group = groups[idx]
        for it in range(iterations):
            numel = (3, 1000, 70_001)[it % 3]
            inputs = all_inputs(torch.float32, numel, n, "threads", idx, it)
            t = inputs[rank].clone()
            out = torch.ones(n * numel)
            try:
                work = dist.all_reduce(t, group=group, async_op=(it % 2 == 1))
                if work is not None:
                    work.wait()
                dist.all_gather_into_tensor(out, inputs[rank].clone(), group=group)
            except Exception as exc:  # noqa: BLE001
                failures[idx].append(f"thread {idx} iteration {it}: raised {type(exc).__name__}: {exc}")
                return
            for what, got, exp in (("all_reduce", t, reference_reduce(inputs, "SUM")),
                                   ("all_gather_into_tensor", out, torch.cat(inputs))):
                msg = compare(got, exp, op="SUM" if what == "all_reduce" else None, exact=ck.exact, inputs=inputs)
                counts[idx] += 1
                if msg:
                    failures[idx].append(f"thread {idx} iteration {it} {what} numel={numel}: {msg}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dist.barrier()
    for g in groups:
        dist.destroy_process_group(g)
    ck.checked += sum(counts)
    ck.failures += failures[0] + failures[1]
    return ck.report()


@pytest.mark.parametrize("world_size", [3, 4])
def test_subgroups_interleaved(worlds, world_size):
    assert_clean(worlds(world_size).run(rank_subgroups), f"subgroups at world size {world_size}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_two_threads_two_groups(worlds, world_size):
    assert_clean(worlds(world_size).run(rank_threads, 12), f"two threads at world size {world_size}")
