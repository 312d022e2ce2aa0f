"""flagos_shm's per-call overhead at 4 B: the same allreduce through each layer."""

from __future__ import annotations

from typing import Callable, List, Tuple

from .cases import WrongResult
from .common import OVERHEAD_ITERS, summarize
from .plan import Plan
from .timing import _agree, _timed_loop


def shm_process_group(group):
    """The :class:`~flagos_shm.backend.group.ShmGroup` behind a
    ``dist.new_group(backend="flagos_shm")`` group's CPU tensors, or None."""
    from ..backend import shm_part

    return shm_part(group, "cpu")


OVERHEAD_LAYERS = (
    ("dist.all_reduce", "torch.distributed + c10d dispatch + flagos_shm Python + core"),
    ("flagos_shm .allreduce()", "flagos_shm Python (checks, staging, Work) + core, called on its adapter"),
    ("Communicator.allreduce", "core only (PyO3 binding call + the collective)"),
    ("dist.all_reduce(async_op=True).wait()",
     "as dist.all_reduce, through the progress queue (wait() runs the queued call itself)"),
)
#: The extra row: torch's own share, with flagos_shm's c10d adapter over a group that does nothing.
NOOP_LAYER = ("dist.all_reduce, no-op backend",
              "torch.distributed + c10d dispatch + the c10d adapter's call into Python, which returns at once")
NOOP_BACKEND = "flagos_shm_bench_noop"


def _none(*args, **kwargs):
    return None  # "finished at C++ level": dist.all_reduce does not wait


class NoopGroup:
    """Stands for a :class:`~flagos_shm.backend.group.ShmGroup` whose every call returns at
    once, moving no data: behind flagos_shm's own C++ adapter, it costs what any Python
    backend costs through ``dist.*`` (torch's floor for a Python backend, on every torch)."""

    _timeout_s = 1800.0

    def __getattr__(self, name: str):
        return _none


def _noop_group(ranks):
    """A group of ``ranks`` whose CPU backend is flagos_shm's C++ adapter over a
    :class:`NoopGroup` (registered once per process as :data:`NOOP_BACKEND`). Collective over
    the default group, like ``dist.new_group``."""
    import torch.distributed as dist

    from ..backend import native

    if NOOP_BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            NOOP_BACKEND, lambda o, pg_options=None: native().ShmBackend(NoopGroup(), o.group_rank, o.group_size),
            extended_api=True, devices=["cpu"])
    return dist.new_group(ranks=list(ranks), backend=NOOP_BACKEND)


def _waited(work) -> None:
    """Wait for ``work``; ``None`` is a synchronous call that has already finished (the
    per-device adapter returns it for a successful synchronous call)."""
    if work is not None:
        work.wait()


def measure_overhead(group, ctrl, plan: Plan, rank: int, device) -> dict:
    """flagos_shm's per-call overhead at 4 B (one float32), three entry points on one group:
    ``dist.all_reduce``, the process group's own ``allreduce([t], opts).wait()`` and the core
    ``Communicator.allreduce(ptr, 1, "float32", SUM)``, and ``dist.all_reduce(async_op=True)
    .wait()`` (the asynchronous path); with ``--device flagos`` also
    ``dist.all_reduce`` of a flagos tensor (staging included), and
    ``dist.all_reduce`` on a group whose backend does nothing (torch's own share of the
    first row). Each is checked for the right sum first (but the no-op one). Returns a dict
    (the same on every rank)."""
    import torch
    import torch.distributed as dist

    n = plan.world_size
    iters = plan.iters if plan.iters is not None else OVERHEAD_ITERS
    warmup = plan.warmup if plan.warmup is not None else max(1, iters // 10)
    pg = shm_process_group(group)
    comm = getattr(pg, "_comm", None)
    error = None if comm is not None and hasattr(comm, "allreduce") else \
        "cannot reach ShmGroup._comm.allreduce from the flagos_shm group"
    error = _agree(error, ctrl, n, "overhead setup")
    if error is not None:
        return {"skipped": error}
    t = torch.zeros(1, dtype=torch.float32)
    ptr = t.data_ptr()
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    opts.asyncOp = False  # the synchronous path, as dist.all_reduce(async_op=False) asks for
    calls: List[Tuple[str, str, Callable[[], None], object]] = [
        (OVERHEAD_LAYERS[0][0], OVERHEAD_LAYERS[0][1], lambda: dist.all_reduce(t, group=group), t),
        (OVERHEAD_LAYERS[1][0], OVERHEAD_LAYERS[1][1], lambda: _waited(pg.allreduce([t], opts)), t),
        (OVERHEAD_LAYERS[2][0], OVERHEAD_LAYERS[2][1],
         lambda: comm.allreduce(ptr, 4, 1, "float32", 0), t),
        (OVERHEAD_LAYERS[3][0], OVERHEAD_LAYERS[3][1],
         lambda: dist.all_reduce(t, group=group, async_op=True).wait(), t),
    ]
    noop = _noop_group(range(n))
    if noop is not None:
        calls.append((*NOOP_LAYER, lambda: dist.all_reduce(t, group=noop), None))
    if device.type != "cpu":
        td = torch.zeros(1, dtype=torch.float32, device=device)
        calls.append((f"dist.all_reduce ({device.type} tensor)",
                      "as dist.all_reduce, plus staging the device tensor through host memory",
                      lambda: dist.all_reduce(td, group=group), td))
    rows = []
    for name, layers, fn, buf in calls:
        error = None
        try:  # e.g. the core binding's signature changed: report, do not stop the run
            if buf is not None:
                buf.fill_(rank + 1)
            fn()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        error = _agree(error, ctrl, n, f"overhead call {name}")
        if error is not None:
            rows.append({"call": name, "layers": layers, "skipped": error})
            continue
        if buf is not None:  # None: the no-op backend, which moves no data
            got = buf.cpu().item()
            if got != n * (n + 1) / 2:
                raise WrongResult(f"overhead check: {name} returned {got}, expected {n * (n + 1) / 2}")
            buf.zero_()
        stats = summarize(_timed_loop(fn, warmup, iters, ctrl, n))
        rows.append({"call": name, "layers": layers, **stats})
    out = {"size_bytes": 4, "dtype": "float32", "op": "allreduce SUM", "warmup": warmup,
           "iters": iters, "calls": rows}
    if all("time_us_median" in r for r in rows[:3]):
        med = [r["time_us_median"] for r in rows]
        out["breakdown_us_median"] = {
            "torch.distributed + c10d": med[0] - med[1],
            "flagos_shm Python (adapter)": med[1] - med[2],
            "core (binding + collective)": med[2]}
    floor = next((r for r in rows if r["call"] == NOOP_LAYER[0] and "time_us_median" in r), None)
    if floor is not None:  # the part of "torch.distributed + c10d" that any Python backend pays
        out["torch_floor_us_median"] = floor["time_us_median"]
    if noop is not None:
        dist.destroy_process_group(noop)
    return out
