"""Collective benchmark: flagos_shm against gloo, in the same run and the same processes.

Run::

    python -m flagos_shm.bench                          # 2 local ranks, all ops, 4 B .. 64 MiB
    python -m flagos_shm.bench --nproc 4 --ops allreduce --sizes 1K,1M,16M --json out.json
    torchrun --nproc-per-node 2 -m flagos_shm.bench     # the same under torchrun
    python benches/compare_backends.py ...              # the same (thin wrapper)

Method:

* Every rank joins a control process group (gloo, the default group; used only
  to agree on the plan, line ranks up and collect timings) and one process group
  per measured backend, created with ``dist.new_group(backend=...)``. All groups
  live in the same rank processes, and for each (op, size) the backends are
  measured one after the other, so they see the same machine state.
* Each measurement is: one correctness check against values computed another way
  (it raises RuntimeError on a wrong result, so a broken backend cannot post a
  time), a FIXED number of warm-up iterations, a barrier on the control group,
  then a FIXED number of timed iterations, each timed on its own with
  ``time.perf_counter_ns`` around the synchronous call. Counts are derived from
  the arguments only and checked equal on all ranks before starting (a
  time-based warm-up lets ranks issue different numbers of collectives and hangs).
* time = median over iterations of the slowest rank's time for that iteration
  (a collective is done when its last rank is done); min is reported too.
* Data type float32; buffers are zero-filled for timing (sums stay finite).
* Bandwidths follow nccl-tests (``doc/PERFORMANCE.md`` in NVIDIA/nccl-tests),
  GB = 1e9 bytes: algbw = S / time with S the tensor size of the op:
  allreduce and broadcast: the buffer; allgather (all_gather_into_tensor): the whole
  output (world_size x per-rank input); reduce-scatter (reduce_scatter_tensor): the whole
  input (world_size x per-rank output). busbw = algbw x 2(n-1)/n for allreduce,
  x (n-1)/n for allgather and reduce-scatter, x 1 for broadcast (n = world size).
  For allgather and reduce-scatter the requested size is rounded down to a multiple of
  4n bytes (at least 4n) so every rank has a whole number of elements; the table
  shows the S actually used.
* ratio = gloo time / flagos_shm time (> 1: flagos_shm is faster).

Adding a backend (for example MPI, which also needs ``mpirun`` to start the ranks):
add a :class:`BackendSpec` to :data:`BACKENDS`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import _launch

MiB = 1 << 20
DEFAULT_SIZES = [4 ** k for k in range(1, 14)]  # 4 B .. 64 MiB, powers of 4
#: Default timed-iteration budget: iterations = clamp(ITER_BUDGET_BYTES / S, MIN_ITERS,
#: MAX_ITERS). Keeps a 2-rank default run of all ops (gloo: about 60 ms per 64 MiB
#: allreduce) within about a minute on 2 cores.
ITER_BUDGET_BYTES = 1024 * MiB
MIN_ITERS, MAX_ITERS = 10, 500
ELEMENT_BYTES = 4  # float32


# --------------------------------------------------------------------------- backends

def _import_flagos_shm() -> None:
    import flagos_shm  # noqa: F401  (registers the "flagos_shm" backend)


@dataclass(frozen=True)
class BackendSpec:
    """A measured backend: its torch.distributed name and what must run before use.

    ``prepare`` runs in every rank before the group is created (import the module
    that registers the backend, check availability; raise RuntimeError if unusable).
    """

    name: str
    prepare: Callable[[], None] = lambda: None


BACKENDS: Dict[str, BackendSpec] = {
    "flagos_shm": BackendSpec("flagos_shm", _import_flagos_shm),
    "gloo": BackendSpec("gloo"),
}
#: The backend the others are compared against (the ratio column is other / this).
REFERENCE = "flagos_shm"


# --------------------------------------------------------------------------- ops

@dataclass
class Case:
    """One (op, size) measurement's buffers and parameters, the same for every backend."""

    op: str
    size_bytes: int          # S as defined by nccl-tests for this op
    numel: int               # elements per rank: buffer (allreduce/broadcast), input
                             # (allgather), output (reduce-scatter)
    run: Callable            # run(group, root_global_rank) -> None, one synchronous call
    check: Callable          # check(group, root_global_rank, rank, n) -> None or raise
    zero: Callable           # zero-fill the buffers for timing


def _busbw_factor(op: str, n: int) -> float:
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("allgather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0  # broadcast


def make_case(op: str, requested: int, n: int) -> Case:
    """Allocate the float32 buffers of ``op`` for a requested size S in bytes.

    Raises:
        ValueError: unknown op.
    """
    import torch
    import torch.distributed as dist

    f32 = torch.float32
    # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (same signatures)
    # and deprecated the old names; older torch has only those.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if op in ("allreduce", "broadcast"):
        numel = max(1, requested // ELEMENT_BYTES)
        buf = torch.zeros(numel, dtype=f32)
        size = numel * ELEMENT_BYTES

        if op == "allreduce":
            def run(g, root):
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=g)

            def check(g, root, rank, n):
                buf.fill_(rank + 1)
                run(g, root)
                _expect(buf, n * (n + 1) / 2, op, g)
        else:
            def run(g, root):
                dist.broadcast(buf, src=root, group=g)

            def check(g, root, rank, n):
                buf.fill_(rank + 1)
                run(g, root)
                _expect(buf, dist.get_group_rank(g, root) + 1, op, g)

        return Case(op, size, numel, run, check, lambda: buf.zero_())

    if op in ("allgather", "reduce_scatter"):
        per = max(1, requested // (ELEMENT_BYTES * n))
        small, big = torch.zeros(per, dtype=f32), torch.zeros(per * n, dtype=f32)
        size = per * n * ELEMENT_BYTES

        def zero():
            small.zero_()
            big.zero_()

        if op == "allgather":
            def run(g, root):
                all_gather(big, small, group=g)

            def check(g, root, rank, n):
                small.fill_(rank + 1)
                run(g, root)
                want = torch.arange(1, n + 1, dtype=f32).repeat_interleave(per)
                _expect(big, want, op, g)
        else:
            def run(g, root):
                reduce_scatter(small, big, op=dist.ReduceOp.SUM, group=g)

            def check(g, root, rank, n):
                # rank r contributes (r + 1) * (i + 1) to chunk i; chunk `rank` sums to
                # (rank + 1) * n (n + 1) / 2.
                big.copy_((torch.arange(n, dtype=f32) + 1).repeat_interleave(per) * (rank + 1))
                run(g, root)
                _expect(small, (rank + 1) * n * (n + 1) / 2, op, g)

        return Case(op, size, per, run, check, zero)

    raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")


OPS = ("allreduce", "allgather", "broadcast", "reduce_scatter")


def _expect(got, want, op: str, group) -> None:
    import torch

    want_t = want if isinstance(want, torch.Tensor) else torch.full_like(got, float(want))
    if not torch.equal(got, want_t):
        bad = (got != want_t).nonzero()
        i = int(bad[0]) if len(bad) else -1
        raise RuntimeError(
            f"{op} on backend {dist_backend_name(group)} returned a wrong result: "
            f"{len(bad)} of {got.numel()} elements differ, first at index {i}: "
            f"got {float(got[i])}, expected {float(want_t[i])}")


def dist_backend_name(group) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group))
    except Exception:  # the name is only used in an error message
        return "?"


# --------------------------------------------------------------------------- plan

def parse_size(text: str) -> int:
    """Parse '4', '64K', '64KiB', '1M', '16MiB', '1G' (binary units) into bytes.

    Raises:
        ValueError: malformed, < 4 bytes, or not a multiple of 4 bytes (float32).
    """
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"--sizes: cannot parse {text!r}; expected e.g. 4, 1K, 64KiB, 16M")
    value = int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]
    if value < ELEMENT_BYTES or value % ELEMENT_BYTES:
        raise ValueError(f"--sizes: {text!r} = {value} bytes; sizes must be positive "
                         f"multiples of {ELEMENT_BYTES} bytes (float32)")
    return value


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def iterations(size_bytes: int, fixed: Optional[int]) -> Tuple[int, int]:
    """(warm-up, timed) iteration counts for one measurement; a pure function of its inputs."""
    iters = fixed if fixed is not None else \
        min(MAX_ITERS, max(MIN_ITERS, ITER_BUDGET_BYTES // max(1, size_bytes)))
    return max(1, iters // 10), iters


@dataclass
class Plan:
    ops: List[str]
    sizes: List[int]
    backends: List[str]
    iters: Optional[int]
    bind: bool = False
    world_size: int = 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flagos_shm.bench",
        description="Time allreduce, allgather, broadcast and reduce-scatter (float32) on "
                    "flagos_shm and gloo in the same run; report median time, algbw, busbw "
                    "(nccl-tests definitions) and the ratio gloo/flagos_shm.")
    p.add_argument("--nproc", type=int, default=2,
                   help="number of local ranks to start (default 2); ignored under torchrun")
    p.add_argument("--ops", default=",".join(OPS),
                   help=f"comma-separated subset of {','.join(OPS)} (default: all)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated sizes S in bytes, binary units allowed "
                        "(e.g. 4,1K,64KiB,16M); default 4 B to 64 MiB in powers of 4")
    p.add_argument("--iters", type=int, default=None,
                   help=f"timed iterations for every size (default: {ITER_BUDGET_BYTES // MiB}"
                        f" MiB / S, clamped to [{MIN_ITERS}, {MAX_ITERS}]); warm-up is "
                        "iters/10 (>= 1)")
    p.add_argument("--backends", default="gloo,flagos_shm",
                   help=f"comma-separated subset of {','.join(BACKENDS)} (default: both)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="process-group timeout in seconds (default 120)")
    p.add_argument("--job-timeout", type=float, default=900.0,
                   help="wall-clock limit of the whole run in seconds (default 900)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write all results as JSON to PATH")
    p.add_argument("--bind", action="store_true",
                   help="pin local rank i to the i-th allowed CPU (modulo the CPU count); "
                        "default: let the scheduler place the ranks")
    return p


def _split(text: str, allowed: Sequence[str], flag: str) -> List[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise SystemExit(f"{flag}: unknown or empty {bad or text!r}; expected a comma-separated "
                         f"subset of {','.join(allowed)}")
    return list(dict.fromkeys(items))


def plan_from_args(args) -> Plan:
    try:
        sizes = DEFAULT_SIZES if args.sizes is None else \
            [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not sizes:
        raise SystemExit("--sizes: empty list")
    if args.iters is not None and args.iters < 1:
        raise SystemExit(f"--iters must be >= 1, got {args.iters}")
    if args.nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {args.nproc}")
    for flag in ("timeout", "job_timeout"):
        if not getattr(args, flag) > 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be > 0 seconds")
    return Plan(ops=_split(args.ops, OPS, "--ops"), sizes=sizes,
                backends=_split(args.backends, list(BACKENDS), "--backends"), iters=args.iters,
                bind=args.bind)


# --------------------------------------------------------------------------- measurement

@dataclass
class Result:
    op: str
    backend: str
    size_bytes: int
    numel_per_rank: int
    warmup: int
    iters: int
    time_us_median: float
    time_us_min: float
    algbw_GBps: float
    busbw_GBps: float


def measure(case: Case, group, ctrl, backend: str, plan: Plan, rank: int) -> Optional[Result]:
    """Check, warm up and time ``case`` on ``group``; return the result on rank 0."""
    import torch
    import torch.distributed as dist

    n = plan.world_size
    root = dist.get_global_rank(group, 0)
    warmup, iters = iterations(case.size_bytes, plan.iters)
    case.check(group, root, rank, n)
    case.zero()
    for _ in range(warmup):
        case.run(group, root)
    dist.barrier(group=ctrl)
    elapsed_ns = [0] * iters
    clock = time.perf_counter_ns
    for i in range(iters):
        t0 = clock()
        case.run(group, root)
        elapsed_ns[i] = clock() - t0
    times = torch.tensor(elapsed_ns, dtype=torch.float64)
    gathered = [torch.empty(iters, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(gathered, times, group=ctrl)
    if rank != 0:
        return None
    slowest = torch.stack(gathered).max(dim=0).values.tolist()  # ns, per iteration
    t_med, t_min = statistics.median(slowest) / 1e3, min(slowest) / 1e3
    algbw = case.size_bytes / (t_med * 1e-6) / 1e9
    return Result(case.op, backend, case.size_bytes, case.numel, warmup, iters, t_med, t_min,
                  algbw, algbw * _busbw_factor(case.op, n))


def print_table(op: str, results: List[Result], plan: Plan) -> None:
    backends = plan.backends
    others = [b for b in backends if b != REFERENCE] if REFERENCE in backends else []
    by = {(r.backend, r.size_bytes): r for r in results}
    sizes = sorted({r.size_bytes for r in results})
    head = f"{'size S':>10} {'iters':>5}"
    sub = f"{'':>10} {'':>5}"
    for b in backends:
        head += f" | {b:^26}"
        sub += f" | {'time us':>8} {'algbw':>8} {'busbw':>8}"
    for b in others:
        head += f" | {b + '/' + REFERENCE:>16}"
        sub += f" | {'time ratio':>16}"
    print(f"\n{op} (float32, world size {plan.world_size}; time = median over iterations of "
          f"the slowest rank; algbw/busbw in GB/s, nccl-tests definitions)")
    print(head)
    print(sub)
    for s in sizes:
        line = f"{human(s):>10} {by[(backends[0], s)].iters:>5}"
        for b in backends:
            r = by[(b, s)]
            line += f" | {r.time_us_median:>8.1f} {r.algbw_GBps:>8.3g} {r.busbw_GBps:>8.3g}"
        for b in others:
            line += f" | {by[(b, s)].time_us_median / by[(REFERENCE, s)].time_us_median:>16.2f}"
        print(line, flush=True)


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    _launch.worker_setup()
    plan = plan_from_args(args)
    store, rank, world_size, local_world_size = _launch.rendezvous(args.timeout)
    torch.set_num_threads(_launch.default_threads(local_world_size))
    if args.bind:
        _launch.bind_to_cpu(int(os.environ.get("LOCAL_RANK", rank)))
    plan.world_size = world_size
    timeout = timedelta(seconds=args.timeout)
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("flagos_shm.bench", store),
                                rank=rank, world_size=world_size, timeout=timeout)
        ctrl = dist.group.WORLD
        # Every rank must run the same plan, or the fixed iteration counts disagree.
        plans: List[Optional[dict]] = [None] * world_size
        dist.all_gather_object(plans, asdict(plan), group=ctrl)
        if any(p != plans[0] for p in plans):
            raise RuntimeError(f"ranks disagree on the benchmark plan: {plans}")
        groups = {}
        for b in plan.backends:
            BACKENDS[b].prepare()
            groups[b] = dist.new_group(ranks=list(range(world_size)), backend=b, timeout=timeout)
        if rank == 0:
            print(f"flagos_shm.bench: world size {world_size}, backends {', '.join(plan.backends)}, "
                  f"torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.machine()}, ranks "
                  f"{'pinned one per CPU (--bind)' if plan.bind else 'placed by the scheduler'}",
                  flush=True)
        results: List[Result] = []
        for op in plan.ops:
            op_results: List[Result] = []
            seen = set()
            for requested in plan.sizes:
                case = make_case(op, requested, world_size)
                if case.size_bytes in seen:  # e.g. 4 B and 16 B both become 16 B at n = 4
                    continue
                seen.add(case.size_bytes)
                for b in plan.backends:
                    r = measure(case, groups[b], ctrl, b, plan, rank)
                    if r is not None:
                        op_results.append(r)
                del case
            if rank == 0:
                print_table(op, op_results, plan)
            results += op_results
        if rank == 0 and args.json:
            write_json(args.json, plan, results)
        dist.barrier(group=ctrl)
    except Exception:
        print(f"[rank {rank}] benchmark failed:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def write_json(path: str, plan: Plan, results: List[Result]) -> None:
    import torch

    ref = {(r.op, r.size_bytes): r for r in results if r.backend == REFERENCE}
    ratios = [{"op": r.op, "size_bytes": r.size_bytes, "backend": r.backend,
               "time_ratio_vs_" + REFERENCE: r.time_us_median / ref[(r.op, r.size_bytes)].time_us_median}
              for r in results if r.backend != REFERENCE and (r.op, r.size_bytes) in ref]
    doc = {
        "tool": "flagos_shm.bench", "world_size": plan.world_size, "dtype": "float32",
        "backends": plan.backends, "ops": plan.ops, "bind": plan.bind,
        "time_definition": "median over timed iterations of the slowest rank's time (us)",
        "bandwidth_definition": "nccl-tests algbw/busbw, GB = 1e9 bytes",
        "torch": torch.__version__, "python": platform.python_version(),
        "host": socket.gethostname(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": [asdict(r) for r in results], "ratios": ratios,
    }
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"\nresults written to {path}", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    plan_from_args(args)  # validate before starting ranks
    if _launch.launched_as_rank():
        try:
            return worker(args)
        finally:
            _launch.worker_teardown()
    argv = list(sys.argv[1:] if argv is None else argv)
    return _launch.launch("flagos_shm.bench", argv, args.nproc, timeout_s=args.job_timeout)


if __name__ == "__main__":
    sys.exit(main())
