"""The memory limit in :mod:`flagos_shm.bench` (private): a process-to-process copy of S
bytes through shared memory, the time of each collective in multiples of it and of the
local single-thread copy, and the flagos_shm group's plan.

Cross-process copy: rank 0 writes S bytes into a shared-memory buffer (a file in
``/dev/shm`` that ranks 0 and 1 map, unlinked as soon as both have), the ranks line up,
then rank 1 copies the S bytes into a buffer of its own with one thread
(``torch.Tensor.copy_``), timed; the ranks line up again before the next write. Ranks are
on their CPUs as the run placed them (``--bind``: rank 0 on the first allowed CPU, rank 1
on the second), so this is what a byte costs to cross between the ranks' CPUs once: the
floor of a collective that moves each byte between processes once (a 2-rank allreduce
needs about 2 such copies: reduce-scatter and allgather; allgather and reduce-scatter 1).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from typing import List, Optional, Sequence

from .common import REFERENCE, human, iterations, summarize

#: Timed iterations of the cross-process copy at most.
XCOPY_MAX_ITERS = 100
#: Longest a rank spins for the other's flag before giving up (seconds).
XCOPY_WAIT_S = 60.0
LIMIT_OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall")


def measure_xcopy(sizes: Sequence[int], plan, rank: int, ctrl, n: int) -> List[dict]:
    """Time rank 1's copy of S bytes that rank 0 has just written through shared memory,
    for each S. Returns the rows (on every rank), [] when the world has one rank."""
    import torch
    import torch.distributed as dist

    if n < 2 or not sizes:
        return []
    top = max(sizes)
    mapped = top + 4096  # the data, then a page holding the flag and the acknowledgement
    path = None
    if rank == 0:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="flagos_shm_bench-xcopy-", dir=shm)
        os.ftruncate(fd, mapped)
        os.close(fd)
    names = [path]
    dist.broadcast_object_list(names, src=0, group=ctrl)
    path = names[0]
    mm = None
    try:
        if rank in (0, 1):
            with open(path, "r+b") as fh:
                mm = mmap.mmap(fh.fileno(), mapped)
        dist.barrier(group=ctrl)
    finally:
        if rank == 0:
            with contextlib.suppress(OSError):
                os.unlink(path)
    rows = []
    try:
        shared = torch.frombuffer(mm, dtype=torch.uint8, count=top) if mm is not None else None
        words = torch.frombuffer(mm, dtype=torch.int64, count=2, offset=top) if mm is not None else None
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        own = torch.zeros(top, dtype=torch.uint8) if rank == 1 else None
        for s in sizes:
            warmup, iters = iterations(s, plan.iters, plan.warmup)
            iters, warmup = min(iters, XCOPY_MAX_ITERS), min(warmup, 5)
            elapsed = []
            dist.barrier(group=ctrl)  # every rank, mapped or not: same number of barriers
            if words is not None:
                words.zero_()
            dist.barrier(group=ctrl)  # ranks 0 and 1 start from zero
            for i in range(1, warmup + iters + 1):
                if rank == 0:
                    shared[:s].fill_(i & 0xFF)
                    words[0] = i
                    _spin(words, 1, i)
                elif rank == 1:
                    _spin(words, 0, i)
                    t0 = time.perf_counter_ns()
                    own[:s].copy_(shared[:s])
                    if i > warmup:
                        elapsed.append(time.perf_counter_ns() - t0)
                    words[1] = i
            stats = [summarize(elapsed) if rank == 1 else None]
            dist.broadcast_object_list(stats, src=1, group=ctrl)
            rows.append({"size_bytes": s, "warmup": warmup, "iters": iters, **stats[0],
                         "GBps": s / (stats[0]["time_us_median"] * 1e-6) / 1e9})
        torch.set_num_threads(threads)
        del shared, words
    finally:
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()
    return rows


def _spin(words, k: int, value: int) -> None:
    deadline = time.monotonic() + XCOPY_WAIT_S
    while int(words[k]) != value:
        if time.monotonic() > deadline:
            raise RuntimeError(f"cross-process copy: the other rank did not reach step {value} within "
                               f"{XCOPY_WAIT_S:.0f} s")


def plan_info(group) -> Optional[dict]:
    """The flagos_shm group's plan and where it came from, or None. On a group that spans
    (simulated) nodes, each node has its own plan: this is the one of the caller's node."""
    from ..backend import shm_part

    pg = shm_part(group, "cpu")
    comm = getattr(pg, "_comm", None)
    if comm is None or not hasattr(comm, "plan"):
        return None
    from ..backend import plan as plan_mod

    p = comm.plan
    stores = getattr(comm, "stream_mode", "?")  # FLAGOS_SHM_STREAM (rust/stream.rs)
    return {"plan": p, "source": getattr(pg, "_plan_source", "?"), "stores": stores,
            "text": ("this node's: " if hasattr(comm, "nodes") else "")
            + f"{plan_mod.describe(p)}; stores into the slots: {stores}"}


def multiples(results: Sequence[dict], copy_rows: Sequence[dict], xcopy_rows: Sequence[dict]) -> List[dict]:
    """Each result's median time in multiples of the local and of the cross-process copy
    of the same S."""
    local = {c["size_bytes"]: c["time_us_median"] for c in copy_rows}
    cross = {c["size_bytes"]: c["time_us_median"] for c in xcopy_rows}
    out = []
    for r in results:
        s = r["size_bytes"]
        row = {"backend": r["backend"], "op": r["op"], "dtype": r["dtype"], "size_bytes": s}
        if s in local:
            row["x_local_copy"] = r["time_us_median"] / local[s]
        if s in cross:
            row["x_cross_copy"] = r["time_us_median"] / cross[s]
        out.append(row)
    return out


def format_limit(doc: dict) -> List[str]:
    """Lines of the limit tables: per op, flagos_shm / Gloo / MPI in cross-process copies
    (and flagos_shm in local copies), next to both copy times."""
    lines: List[str] = []
    info = doc.get("plan")
    if info:
        lines.append(f"\nflagos_shm plan ({info['source']}): {info['text']}")
    local = {c["size_bytes"]: c for c in doc.get("copy_baseline") or []}
    cross = {c["size_bytes"]: c for c in doc.get("xcopy_baseline") or []}
    if not cross:
        return lines
    mult = {(m["backend"], m["op"], m["dtype"], m["size_bytes"]): m for m in doc.get("multiples", [])}
    backends = [b for b in doc["config"]["backends"] if any(m[0] == b for m in mult)]
    dtype0 = doc["config"]["dtypes"][0]
    lines.append("\ncross-process copy (rank 0 writes S bytes in shared memory, rank 1 copies them into its own "
                 "buffer, 1 thread; median) and each op's median time in multiples of it (x-copy) and of the "
                 f"local copy; {dtype0}")
    for op in LIMIT_OPS:
        sizes = sorted({k[3] for k in mult if k[1] == op and k[2] == dtype0 and k[3] in cross})
        if not sizes:
            continue
        head = f"{op:>14} {'local us':>9} {'x-proc us':>9} {'GB/s':>6} | " + " ".join(
            f"{b + ' x-copy':>17}" for b in backends) + f" | {REFERENCE + ' x-local':>18}"
        lines.append(head)
        for s in sizes:
            c = cross[s]
            lc = local.get(s)
            cells = []
            for b in backends:
                m = mult.get((b, op, dtype0, s))
                cells.append(f"{m['x_cross_copy']:>17.2f}" if m and "x_cross_copy" in m else f"{'-':>17}")
            ref = mult.get((REFERENCE, op, dtype0, s))
            xl = f"{ref['x_local_copy']:>18.2f}" if ref and "x_local_copy" in ref else f"{'-':>18}"
            lines.append(f"{human(s):>14} {lc['time_us_median'] if lc else float('nan'):>9.1f} "
                         f"{c['time_us_median']:>9.1f} {c['GBps']:>6.1f} | " + " ".join(cells) + f" | {xl}")
    return lines
