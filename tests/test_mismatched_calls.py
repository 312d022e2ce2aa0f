"""Mismatched calls (issue 5): ranks that issue different collectives, sizes, dtypes or roots
raise on every rank, naming the disagreement, and the group stays usable.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from support.faults import error_info

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("flagos_only")]


# ==== 2. mismatched calls ===========================================================================

MISMATCH_BIG = 1 << 20  # float32 elements: 4 MiB, 8 chunks of the default 512 KiB slot


def _mismatch_call(case: str, odd: bool, rank: int, n: int):
    """The call of one rank in mismatch case ``case`` (``odd``: the rank that differs).
    Returns ``(call, tensors the call may write, the words that describe this rank's side)``."""
    f32 = torch.float32
    base = torch.arange(12, dtype=f32) + 10 * rank
    if case == "collective: all_reduce vs all_gather_into_tensor":
        if odd:
            out = torch.full((n * 12,), -1.0)
            return lambda: dist.all_gather_into_tensor(out, base.clone()), [out], ["allgather"]
        return lambda: dist.all_reduce(base), [base], ["allreduce"]
    if case == "collective: all_reduce vs barrier":
        if odd:
            return lambda: dist.barrier(), [], ["barrier"]
        return lambda: dist.all_reduce(base), [base], ["allreduce"]
    if case == "collective: broadcast vs reduce":
        if odd:
            return lambda: dist.reduce(base, dst=0), [base], ["reduce"]
        return lambda: dist.broadcast(base, src=0), [base], ["broadcast"]
    if case == "collective: reduce_scatter_tensor vs all_to_all_single":
        src = torch.arange(n * 4, dtype=f32) + rank
        if odd:
            out = torch.full((n * 4,), -1.0)
            return lambda: dist.all_to_all_single(out, src), [out], ["alltoall"]
        out = torch.full((4,), -1.0)
        return lambda: dist.reduce_scatter_tensor(out, src), [out], ["reduce_scatter"]
    if case == "dtype: int32 vs float32":
        t = base.to(torch.int32) if odd else base
        return lambda: dist.all_reduce(t), [t], ["int32" if odd else "float32"]
    if case == "size: 4 MiB (8 chunks) vs 48 bytes":
        t = torch.ones(MISMATCH_BIG) * rank if odd else base
        return lambda: dist.all_reduce(t), [t], [f"{t.numel()} elements"]
    if case == "reduce op: SUM vs MIN":
        op = dist.ReduceOp.MIN if odd else dist.ReduceOp.SUM
        return lambda: dist.all_reduce(base, op=op), [base], ["MIN" if odd else "SUM"]
    if case == "root: broadcast from 0 vs from 2":
        root = 2 if odd else 0
        return lambda: dist.broadcast(base, src=root), [base], [f"root {root}"]
    if case == "root: reduce to 0 vs to 1":
        root = 1 if odd else 0
        return lambda: dist.reduce(base, dst=root), [base], [f"root {root}"]
    raise ValueError(f"case: unknown {case!r}")


def rank_mismatch(case: str, odd_rank: int) -> dict:
    """Every rank issues its side of ``case`` at the same position of the group's sequence;
    report the error, whether the written-to tensors are untouched, and whether a correct
    all_reduce and a correct repeat of the collective on the same group work afterwards."""
    rank, n = dist.get_rank(), dist.get_world_size()
    call, written, mine = _mismatch_call(case, rank == odd_rank, rank, n)
    theirs = _mismatch_call(case, rank != odd_rank, rank, n)[2]
    before = [t.clone() for t in written]
    res: dict = {"mine": mine, "theirs": theirs}
    try:
        call()
        res["error"] = None
    except Exception as exc:  # noqa: BLE001
        res["error"] = error_info(exc)
    res["untouched"] = all(torch.equal(a, b) for a, b in zip(written, before))
    t = torch.arange(5, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    res["after_ok"] = torch.equal(t, torch.arange(5, dtype=torch.float32) * (n * (n + 1) // 2))
    # the same collective, now agreed by every rank
    same, written, _ = _mismatch_call(case, False, rank, n)
    same()
    if "all_reduce" in case or case.startswith(("dtype", "size", "reduce op")):
        res["repeat_ok"] = torch.equal(written[0], sum(torch.arange(12, dtype=torch.float32) + 10 * r
                                                       for r in range(n)))
    else:
        res["repeat_ok"] = None  # checked by the collective tests; here it must just not raise
    return res


MISMATCH_CASES = ["collective: all_reduce vs all_gather_into_tensor", "collective: all_reduce vs barrier",
                  "collective: broadcast vs reduce", "collective: reduce_scatter_tensor vs all_to_all_single",
                  "dtype: int32 vs float32", "size: 4 MiB (8 chunks) vs 48 bytes", "reduce op: SUM vs MIN",
                  "root: broadcast from 0 vs from 2", "root: reduce to 0 vs to 1"]


@pytest.mark.parametrize("case", MISMATCH_CASES)
def test_mismatched_calls(worlds, case):
    """Ranks that issue different collectives, dtypes, sizes, reduce ops or roots at the same
    position raise ValueError on every rank, describing their own call and the other
    side's; no output is written; the group stays usable (the next collectives are right)."""
    world = worlds(3)
    odd = 1
    try:
        results = world.run(rank_mismatch, case, odd, timeout=60)
    finally:
        world.check_health()
    problems = []
    for rank, res in enumerate(results):
        err = res["error"]
        if err is None or err["type"] != "ValueError":
            problems.append(f"rank {rank}: expected ValueError, got {err}")
            continue
        msg = err["message"]
        other = 0 if rank == odd else odd
        for word in res["mine"] + res["theirs"] + [f"rank {rank} called", f"rank {other} called"]:
            if word not in msg:
                problems.append(f"rank {rank}: message lacks {word!r}: {msg}")
        if not res["untouched"]:
            problems.append(f"rank {rank}: an output was written")
        if not res["after_ok"] or res["repeat_ok"] is False:
            problems.append(f"rank {rank}: the group gave wrong results afterwards: {res}")
    print(f"{case}: rank 0 says: {results[0]['error'] and results[0]['error']['message']}")
    assert not problems, f"{case}:\n" + "\n".join(problems)
