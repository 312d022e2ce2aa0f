"""Timing one case (fixed warm-up and iteration counts, the slowest rank per iteration),
the ranks' agreement on what failed, and the single-thread copy baseline."""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Tuple

from .cases import make_case
from .common import human, iterations, make_record, summarize
from .plan import Plan
from .progress import Progress


def _timed_loop(fn: Callable[[], None], warmup: int, iters: int, ctrl, n: int) -> List[float]:
    """Warm up, line the ranks up, time ``iters`` calls one by one; return the slowest
    rank's time per iteration in ns (on every rank)."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    dist.barrier(group=ctrl)
    elapsed = [0] * iters
    clock = time.perf_counter_ns
    for i in range(iters):
        t0 = clock()
        fn()
        elapsed[i] = clock() - t0
    mine = torch.tensor(elapsed, dtype=torch.float64)
    gathered = [torch.empty(iters, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(gathered, mine, group=ctrl)
    return torch.stack(gathered).max(dim=0).values.tolist()


def _agree(error: Optional[str], ctrl, n: int, what: str) -> Optional[str]:
    """All ranks report whether ``what`` failed for them. Returns None when it worked on
    every rank, the first error when it failed on every rank; raises RuntimeError when
    the ranks disagree (the group may be stuck: stop)."""
    import torch.distributed as dist

    errors: List[Optional[str]] = [None] * n
    dist.all_gather_object(errors, error, group=ctrl)
    failed = [e for e in errors if e is not None]
    if not failed:
        return None
    if len(failed) == n:
        return failed[0]
    raise RuntimeError(f"{what} failed on some ranks only: {errors}")


def measure(op: str, dtype: str, requested: int, backend: str, group, ctrl, plan: Plan,
            rank: int, device) -> Tuple[Optional[dict], Optional[str]]:
    """Check, warm up and time one case on ``group``. Returns ``(record, None)`` (the
    record on every rank), or ``(None, reason)`` when the backend rejects the case on every
    rank. Raises WrongResult on a wrong result."""
    n = plan.world_size
    error, case = None, None
    try:
        case = make_case(op, dtype, requested, group, rank, n, device)
        case.fill()
        case.run()
    except Exception as exc:  # e.g. a dtype the backend does not support: reported, not fatal
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    error = _agree(error, ctrl, n, f"{backend} {op} {dtype} S={requested}")
    if error is not None:
        return None, error
    case.verify()
    case.zero()
    warmup, iters = iterations(case.size_bytes, plan.iters, plan.warmup)
    slowest = _timed_loop(case.run, warmup, iters, ctrl, n)
    return make_record(backend, op, dtype, case.size_bytes, case.numel, n, str(device.type),
                       warmup, iters, summarize(slowest)), None


def measure_copy(sizes: Sequence[int], plan: Plan, rank: int, ctrl, progress: Progress) -> List[dict]:
    """Rank 0 times one single-threaded ``dst.copy_(src)`` of S bytes (uint8 CPU tensors) for
    each S while the other ranks wait in a barrier. Returns the rows on rank 0, [] elsewhere."""
    import torch
    import torch.distributed as dist

    rows = []
    if rank == 0:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for s in sizes:
                src = torch.ones(s, dtype=torch.uint8)
                dst = torch.zeros(s, dtype=torch.uint8)
                warmup, iters = iterations(s, plan.iters, plan.warmup)
                for _ in range(warmup):
                    dst.copy_(src)
                elapsed = [0] * iters
                clock = time.perf_counter_ns
                for i in range(iters):
                    t0 = clock()
                    dst.copy_(src)
                    elapsed[i] = clock() - t0
                stats = summarize(elapsed)
                rows.append({"size_bytes": s, "warmup": warmup, "iters": iters, **stats,
                             "GBps": s / (stats["time_us_median"] * 1e-6) / 1e9})
                progress.advance(Progress.weight(s, warmup, iters) / 4, f"copy {human(s)}")
        finally:
            torch.set_num_threads(threads)
    dist.barrier(group=ctrl)
    return rows


def measure_device_copy(sizes: Sequence[int], plan: Plan, rank: int, ctrl, device) -> List[dict]:
    """Every rank at once (as staging runs on every rank), for each S: the device copies a
    staged call of S bytes cannot avoid, alone: S bytes from ``device`` to pinned host
    memory on the current stream, a synchronisation of that stream, S bytes back. Returns
    rank 0's rows (median of its calls), [] elsewhere."""
    import torch
    import torch.distributed as dist

    stream = torch.get_device_module(device.type).current_stream(device)
    rows = []
    for s in sizes:
        src = torch.ones(max(s, 1), dtype=torch.uint8, device=device)
        dst = torch.ones(max(s, 1), dtype=torch.uint8, device=device)
        out = torch.empty(max(s, 1), dtype=torch.uint8, pin_memory=True)
        back = torch.ones(max(s, 1), dtype=torch.uint8, pin_memory=True)

        def run():
            out.copy_(src, non_blocking=True)
            stream.synchronize()
            dst.copy_(back, non_blocking=True)

        warmup, iters = iterations(s, plan.iters, plan.warmup)
        dist.barrier(group=ctrl)
        for _ in range(warmup):
            run()
        elapsed = [0] * iters
        clock = time.perf_counter_ns
        for i in range(iters):
            t0 = clock()
            run()
            elapsed[i] = clock() - t0
        stream.synchronize()
        if rank == 0:
            rows.append({"size_bytes": s, "warmup": warmup, "iters": iters, **summarize(elapsed)})
    dist.barrier(group=ctrl)
    return rows
