"""Calibration: every rank of a node times each collective's variants at a grid of sizes,
in lockstep, and every rank ends up holding the same figures."""

from __future__ import annotations

import time
from typing import Dict, List, Tuple

from ... import _core
from .keys import FALLBACK, KEYS, SINGLE_COPY_KEYS, SINGLE_COPY_OPS

#: Sizes S (bytes) the calibration measures (larger messages follow the largest): a 4x
#: grid, so a threshold falls at the geometric middle (2x) between two measured sizes.
GRID = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
ROUNDS = 5  # timed rounds (each runs every variant of every case once, alternating)
#: Calls per variant and round, back to back; the last one is timed. The first call after
#: a switch of algorithm finds the slots in the state the other algorithm left (which
#: lines the peer holds), so a single call measured the switch, not the algorithm: on the
#: AMD EPYC VM single calls had the one-shot allreduce ahead at 1 MiB in 1 MiB slots,
#: where back-to-back calls run the two-step one in 91-96 us against 126-131 us.
BURST = 2
_NEVER = None


def _variants(single_copy: bool) -> Dict[str, List[Tuple[str, dict]]]:
    """Per op, the variants to time, each as the plan that forces it."""
    slots = dict(FALLBACK, **{k: _NEVER for k in KEYS[1:]})
    big = 1 << 62
    out = {"allreduce": [("one_shot", dict(slots, one_shot_max_bytes=big)),
                         ("two_step", dict(slots, one_shot_max_bytes=0))],
           **{op: [("slots", slots)] for op in SINGLE_COPY_OPS[1:]}}
    if single_copy:
        for op, key in zip(SINGLE_COPY_OPS, SINGLE_COPY_KEYS):
            out[op].append(("single_copy", dict(slots, **{key: 0})))  # from 0 B, no end
    return out


def _set(comm, plan: dict) -> None:
    comm.set_plan({k: plan[k] for k in KEYS})


def calibrate(comm, grid=GRID, rounds: int = ROUNDS, burst: int = BURST) -> Dict[str, Dict[str, List[float]]]:
    """Time every variant of allreduce, allgather, reduce-scatter, broadcast (root 0) and
    all-to-all (float32, SUM where it reduces) at each
    size of ``grid`` on ``comm``, all ranks together: one warm-up round, then ``rounds``
    rounds alternating the variants, each variant run ``burst`` times back to back with
    the last call timed (see :data:`BURST`). Returns ``{op: {variant: [us per size]}}``: each
    variant's fastest round (other processes can only add time, so the minimum is the
    least disturbed estimate), the same on every rank (MAX over ranks). Leaves the
    fallback plan set.

    In ``FLAGOS_SHM_STREAM=auto`` (the default) each slot variant is timed with plain and
    with streaming stores into the slots and keeps the faster (``rust/stream.rs``: at run
    time each rank's streamer chooses the faster kind, and on the AMD EPYC VM which one
    that is changes with the placement of the vCPUs: a calibration timing plain stores only
    in the slow placement found single-copy ahead where streaming slots were faster).

    Every call reads input this rank has just written (the allgather's input is rewritten
    before each call, untimed), as gradients are in training: a single-copy transfer
    reading data that stayed clean in both CPUs' caches looks faster than it is. On the
    AMD EPYC 2-vCPU VM, in one of its slow phases, a 1 MiB single-copy allgather took
    67 us on clean input and 110-122 us on freshly written input (slots: 260-330 us);
    docs/benchmark.md, "The VM's placements".

    Must be called by every rank of the group at the same point of its sequence."""
    import torch

    n = comm.world_size
    variants = _variants(bool(comm.single_copy_available))
    # In auto mode the streamer would need more calls than the calibration makes to find
    # the faster kind of store: time both and keep the faster (restored to auto after).
    both_stores = getattr(comm, "stream_mode", None) == "auto"
    top = max(grid)
    buf = torch.zeros(top // 4, dtype=torch.float32)
    out = torch.zeros_like(buf)  # the all-to-all's output
    half = torch.zeros(max(1, top // 4 // n), dtype=torch.float32)
    fresh = torch.ones_like(half)
    cases = []  # (op, variant, size index, plan, call, pre, kind of store)
    for i, s in enumerate(grid):
        count = s // 4
        per = max(1, count // n)
        ar = lambda c=count: comm.allreduce(buf.data_ptr(), c * 4, c, "float32", 0)  # noqa: E731
        ag = lambda p=per: comm.allgather(half.data_ptr(), p * 4, buf.data_ptr(), p * 4 * n, p, "float32")  # noqa: E731
        rs = lambda p=per: comm.reduce_scatter(buf.data_ptr(), p * 4 * n, half.data_ptr(), p * 4, p,  # noqa: E731
                                               "float32", 0)
        bc = lambda c=count: comm.broadcast(buf.data_ptr(), c * 4, c, "float32", 0)  # noqa: E731
        a2a = lambda p=per: comm.alltoall(buf.data_ptr(), p * 4 * n, out.data_ptr(), p * 4 * n, p,  # noqa: E731
                                          "float32")
        # The allreduce writes its input (in place) and the allgather writes the
        # reduce-scatter's; the allgather's own input is rewritten here.
        rewrite = lambda p=per: _core.copy_bytes(half.data_ptr(), fresh.data_ptr(), p * 4)  # noqa: E731
        for op, call, pre in (("allreduce", ar, None), ("allgather", ag, rewrite), ("reduce_scatter", rs, None),
                              ("broadcast", bc, None), ("alltoall", a2a, None)):
            for name, plan in variants[op]:
                # slot variants with each kind of store (the streamer picks the faster at run
                # time); single-copy transfers do not touch the slots
                for stores in ("plain", "stream") if both_stores and name != "single_copy" else ("plain",):
                    cases.append((op, name, i, plan, call, pre, stores))
    times: List[List[float]] = [[] for _ in cases]
    clock = time.perf_counter_ns
    for r in range(rounds + 1):
        order = cases if r % 2 == 0 else cases[::-1]
        index = range(len(cases)) if r % 2 == 0 else range(len(cases) - 1, -1, -1)
        for j, (_, _, _, plan, call, pre, stores) in zip(index, order):
            _set(comm, plan)
            if both_stores:
                comm.set_stream_mode(stores)
            for _ in range(burst - 1):
                if pre:
                    pre()
                call()
            if pre:
                pre()
            t0 = clock()
            call()
            if r:
                times[j].append((clock() - t0) / 1e3)
    _set(comm, FALLBACK)
    if both_stores:
        comm.set_stream_mode("auto")
    med = torch.tensor([min(t) for t in times], dtype=torch.float64)
    comm.allreduce(med.data_ptr(), med.numel() * 8, med.numel(), "float64", 4)  # MAX: same on every rank
    out: Dict[str, Dict[str, List[float]]] = {}
    for (op, name, i, _, _, _, _), value in zip(cases, med.tolist()):
        row = out.setdefault(op, {}).setdefault(name, [float("inf")] * len(grid))
        row[i] = min(row[i], round(value, 2))  # the faster kind of store
    return out
