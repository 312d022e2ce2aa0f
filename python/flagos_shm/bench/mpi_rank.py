"""The MPI part of :mod:`flagos_shm.bench` (private): one rank of ``mpirun -n N python
.../flagos_shm/bench/mpi_rank.py PLAN.json OUT.json``.

Run as a script (not ``-m flagos_shm.bench.mpi_rank``) so that the ranks do not import the
package, hence torch: two ranks importing torch under mpirun took about 9 s on 2 cores.
Only numpy, mpi4py and :mod:`flagos_shm.bench.common` (torch-free) are loaded.

Times ``Allreduce`` (in place, SUM), ``Allgather``, ``Reduce_scatter_block`` (SUM),
``Bcast`` (root 0) and ``Alltoall`` of mpi4py on numpy buffers with the same sizes,
iteration counts and method as the torch backends of the benchmark (correctness check,
fixed warm-up, barrier, per-iteration ``time.perf_counter_ns``, slowest rank per
iteration). PLAN.json holds ``ops``, ``sizes`` (requested bytes), ``dtypes`` (numpy names),
``iters``, ``warmup`` (null = the benchmark's default rule), ``bind``, ``cpus`` (the CPUs
to pin rank r to ``cpus[r % len(cpus)]`` when ``bind``) and ``hugepages``: whether torch's
CPU tensors sit on transparent huge pages on this machine (``machine.torch_cpu_hugepages``).
numpy advises huge pages for every large array by default, torch only when
``THP_MEM_ALLOC_ENABLE`` is set, and on a VM huge pages made Open MPI's 64 MiB allgather
and alltoall 1.3-1.8x faster (AMD EPYC 2-vCPU VM, 2026-12-01); so the ranks advise huge
pages exactly when torch's allocator gets them, and both sides move the same kind of memory. Rank 0 writes OUT.json:
``{"library": ..., "results": [...], "skipped": [...]}`` with the benchmark's record format.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

if __package__:
    from .common import MPI_DTYPES, case_numel, iterations, make_record, summarize
else:  # run as a script by mpirun: load the sibling module without the package
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import MPI_DTYPES, case_numel, iterations, make_record, summarize


class WrongResult(RuntimeError):
    """MPI returned a wrong result."""


def _case(MPI, comm, op: str, dtype: str, requested: int):
    """Buffers, the call and its check for one (op, dtype, S)."""
    n, rank = comm.Get_size(), comm.Get_rank()
    dt = np.dtype(dtype)
    numel, size = case_numel(op, requested, n, dt.itemsize)
    ramp = lambda start, step: np.repeat((np.arange(n) * step + start).astype(dt), numel)  # noqa: E731

    if op in ("allreduce", "broadcast"):
        buf = np.zeros(numel, dt)
        if op == "allreduce":
            run = lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)  # noqa: E731
            fill, got, want = (lambda: buf.fill(rank + 1)), buf, np.full(numel, n * (n + 1) // 2, dt)
        else:
            run = lambda: comm.Bcast(buf, root=0)  # noqa: E731
            fill, got, want = (lambda: buf.fill(rank + 1)), buf, np.full(numel, 1, dt)
        bufs = [buf]
    else:
        small, big = np.zeros(numel, dt), np.zeros(numel * n, dt)
        if op == "allgather":
            run = lambda: comm.Allgather(small, big)  # noqa: E731
            fill, got, want = (lambda: small.fill(rank + 1)), big, ramp(1, 1)
            bufs = [small, big]
        elif op == "reduce_scatter":
            run = lambda: comm.Reduce_scatter_block(big, small, op=MPI.SUM)  # noqa: E731

            def fill():
                big[:] = ramp(rank + 1, rank + 1)
            got, want = small, np.full(numel, (rank + 1) * n * (n + 1) // 2, dt)
            bufs = [small, big]
        elif op == "alltoall":
            out = np.zeros(numel * n, dt)
            run = lambda: comm.Alltoall(big, out)  # noqa: E731

            def fill():
                big[:] = ramp(rank * n + 1, 1)
            got, want = out, ramp(rank + 1, n)
            bufs = [big, out]
        else:
            raise ValueError(f"op: unknown op {op!r}")

    def check():
        fill()
        run()
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            raise WrongResult(f"mpi {op} {dtype} S={size}: {bad.size} of {got.size} elements "
                              f"wrong, first at {bad[0]}: got {got[bad[0]]}, expected {want[bad[0]]}")
        for b in bufs:
            b.fill(0)
    return numel, size, run, check


def _device(plan: dict) -> str:
    """The record's device: host memory, and its pages."""
    return "cpu (numpy, huge pages)" if plan.get("hugepages") else "cpu (numpy, 4 KiB pages)"


def _match_torch_pages(hugepages: bool) -> None:
    """Make numpy advise transparent huge pages for its large arrays iff ``hugepages``
    (see the module docstring); a numpy without the switch is left as it is."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray
    setter = getattr(multiarray, "_set_madvise_hugepage", None)
    if setter is not None:
        setter(hugepages)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: mpirun -n N python .../flagos_shm/bench/mpi_rank.py PLAN.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as fh:
        plan = json.load(fh)
    from mpi4py import MPI

    _match_torch_pages(bool(plan.get("hugepages")))
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    if plan.get("bind") and plan.get("cpus") and hasattr(os, "sched_setaffinity"):
        cpus = plan["cpus"]
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    results, skipped = [], []
    clock = time.perf_counter_ns
    for op in plan["ops"]:
        for dtype in plan["dtypes"]:
            if dtype not in MPI_DTYPES:
                continue
            seen = set()
            for requested in plan["sizes"]:
                numel, size, run, check = _case(MPI, comm, op, dtype, requested)
                if size in seen:
                    continue
                seen.add(size)
                check()
                warmup, iters = iterations(size, plan.get("iters"), plan.get("warmup"))
                for _ in range(warmup):
                    run()
                comm.Barrier()
                elapsed = np.zeros(iters, np.float64)
                for i in range(iters):
                    t0 = clock()
                    run()
                    elapsed[i] = clock() - t0
                every = np.zeros((n, iters), np.float64) if rank == 0 else None
                comm.Gather(elapsed, every, root=0)
                if rank == 0:
                    slowest = every.max(axis=0).tolist()
                    results.append(make_record("mpi", op, dtype, size, numel, n, _device(plan),
                                               warmup, iters, summarize(slowest)))
    if rank == 0:
        with open(argv[1], "w") as fh:
            json.dump({"library": MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
                       "results": results, "skipped": skipped}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
