"""Many groups (issue 5): 32 overlapping groups on 4 ranks (a data x tensor-parallel grid
made several times, plus other subsets) running a random schedule of collectives, each
result checked against a reference computed on the rank.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from support import faults

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("flagos_only")]


# ==== 5. many groups ===================================================================================

#: 32 groups on 4 ranks: a 2 x 2 data-parallel x tensor-parallel grid whose groups are each
#: created 6 times (24 groups), plus 8 other subsets.
TP, DP = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
GROUP_RANKS = (TP + DP) * 6 + [[0, 1, 2], [1, 2, 3], [0, 3], [0, 1, 2, 3]] * 2
SCHEDULE_OPS = 240


def _reference(kind: str, members: list, numel: int, seed: int, me: int, root: int):
    """Expected result on global rank ``me`` of ``kind`` over ``members`` (global ranks,
    sorted) with inputs ``faults.rank_input(numel, seed, global rank)``."""
    ins = [faults.rank_input(numel, seed, r) for r in members]
    if kind == "all_reduce":
        return torch.stack(ins).sum(0)
    if kind == "all_gather_into_tensor":
        return torch.cat(ins)
    if kind == "broadcast":
        return faults.rank_input(numel, seed, root)
    if kind == "reduce_scatter_tensor":
        big = [faults.rank_input(len(members) * numel, seed, r) for r in members]
        i = members.index(me)
        return torch.stack(big).sum(0)[i * numel:(i + 1) * numel]
    raise ValueError(kind)


def _issue(kind: str, group, members: list, numel: int, seed: int, me: int, root: int, async_op: bool = False):
    """Issue ``kind`` on ``group``; return ``(work or None, result tensor)``."""
    if kind == "all_reduce":
        t = faults.rank_input(numel, seed, me)
        return dist.all_reduce(t, group=group, async_op=async_op), t
    if kind == "all_gather_into_tensor":
        out = torch.full((len(members) * numel,), -1.0)
        return dist.all_gather_into_tensor(out, faults.rank_input(numel, seed, me), group=group,
                                           async_op=async_op), out
    if kind == "broadcast":
        t = faults.rank_input(numel, seed, me)
        return dist.broadcast(t, src=root, group=group, async_op=async_op), t
    if kind == "reduce_scatter_tensor":
        out = torch.full((numel,), -1.0)
        return dist.reduce_scatter_tensor(out, faults.rank_input(len(members) * numel, seed, me), group=group,
                                          async_op=async_op), out
    raise ValueError(kind)


KINDS = ["all_reduce", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor"]


def rank_many_groups(seed: int) -> dict:
    """Create the 32 groups of GROUP_RANKS; run a shuffled schedule of SCHEDULE_OPS
    collectives over them (each rank runs, in schedule order, those of its groups: the
    same global order on every rank, so no deadlock); then two threads per rank issuing
    async_op=True collectives (4 in flight before waiting) on a TP and a DP group; then
    abort one group and mismatch another and check that the rest are unaffected."""
    import random

    me, n = dist.get_rank(), dist.get_world_size()
    assert n == 4
    backend = dist.get_backend()
    failures: list = []
    checked = 0
    maps_before = faults.segment_maps()
    t0 = time.monotonic()
    groups = [dist.new_group(ranks, backend=backend) for ranks in GROUP_RANKS]
    mine = [i for i, ranks in enumerate(GROUP_RANKS) if me in ranks]
    try:
        rng = random.Random(seed)
        for step in range(SCHEDULE_OPS):
            gi = rng.randrange(len(groups))
            kind = rng.choice(KINDS)
            numel = rng.choice([1, 7, 1000, 70_001])
            members = GROUP_RANKS[gi]
            root = rng.choice(members)
            if gi not in mine:
                continue
            _, got = _issue(kind, groups[gi], members, numel, step, me, root)
            checked += 1
            if not torch.equal(got, _reference(kind, members, numel, step, me, root)):
                failures.append(f"schedule op {step}: {kind} on group {gi} {members} numel={numel}: wrong values")
        dist.barrier()

        # two threads, each with its own group (a TP group and a DP group), async ops
        tp = next(i for i in mine if GROUP_RANKS[i] in TP)
        dp = next(i for i in mine if GROUP_RANKS[i] in DP)
        counts = [0, 0]

        def worker(idx: int, gi: int) -> None:
            members = GROUP_RANKS[gi]
            for it in range(6):
                pending = []
                for j in range(4):  # four in flight before the first wait
                    kind = KINDS[(it + j) % len(KINDS)]
                    seed_ = 10_000 * (idx + 1) + 10 * it + j
                    work, got = _issue(kind, groups[gi], members, 5000, seed_, me, members[j % 2], async_op=True)
                    pending.append((work, got, kind, seed_, members[j % 2]))
                for work, got, kind, seed_, root in pending:
                    work.wait()
                    counts[idx] += 1
                    if not torch.equal(got, _reference(kind, members, 5000, seed_, me, root)):
                        failures.append(f"thread {idx} group {gi} {members} {kind} seed {seed_}: wrong values")

        threads = [threading.Thread(target=worker, args=(i, gi)) for i, gi in enumerate((tp, dp))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        checked += sum(counts)
        if counts != [24, 24]:
            failures.append(f"async threads completed {counts} operations, expected [24, 24]")
        dist.barrier()

        # private state: abort the first TP group everywhere it exists (rank 0 of it
        # aborts, its peer learns it), mismatch in the first DP group; the others are fine
        aborted, mismatched = 0, 2
        if me in GROUP_RANKS[aborted]:
            if me == GROUP_RANKS[aborted][0]:
                groups[aborted].abort()
            dist.barrier(group=groups[12])  # a fresh copy of the same TP group: both ranks past the abort
            try:
                dist.all_reduce(torch.ones(3), group=groups[aborted])
                failures.append("all_reduce on the aborted group did not raise")
            except RuntimeError as exc:
                checked += 1
                if "aborted" not in str(exc):
                    failures.append(f"aborted group raised {exc}")
        if me in GROUP_RANKS[mismatched]:
            try:
                dist.all_reduce(torch.ones(3 + me), group=groups[mismatched])
                failures.append("mismatched all_reduce did not raise")
            except ValueError:
                checked += 1
        dist.barrier()
        for gi in mine:
            if gi == aborted:
                continue
            members = GROUP_RANKS[gi]
            _, got = _issue("all_reduce", groups[gi], members, 33, 777 + gi, me, members[0])
            checked += 1
            if not torch.equal(got, _reference("all_reduce", members, 33, 777 + gi, me, members[0])):
                failures.append(f"group {gi} {members} after the abort/mismatch elsewhere: wrong values")
    finally:
        dist.barrier()
        for g in groups:
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)
    dist.barrier()
    return {"checked": checked, "failures": failures, "elapsed": time.monotonic() - t0,
            "maps": sorted(set(faults.segment_maps()) - set(maps_before)),
            "left": faults.segments_in(os.environ["FLAGOS_SHM_DIR"])}


def test_many_overlapping_groups(worlds):
    """32 overlapping groups on 4 ranks (2 x 2 DP x TP grid created 6 times + 8 other
    subsets) in a shuffled interleaving, async ops from two threads on different groups,
    and an abort and a mismatch confined to their own groups: all values right; every
    segment is gone after destroy_process_group."""
    world = worlds(4)
    try:
        results = world.run(rank_many_groups, 5, timeout=120)
    finally:
        world.check_health()
    for rank, res in enumerate(results):
        print(f"rank {rank}: {res['checked']} checks in {res['elapsed']:.2f} s")
        assert res["failures"] == [] and res["checked"] > 100, (rank, res)
        assert res["maps"] == [] and res["left"] == [], (rank, res)
