"""The memory floor of a collective in which every rank moves S bytes: each of two CPUs
copying S bytes of its own at the same time.

Run: ``python benches/copy_floor.py [--sizes 1M,16M,64M] [--seconds 3]`` (needs numpy;
two CPUs in this process's affinity mask).

At world size 2, an allgather or all-to-all of S output bytes has each rank write S bytes
(half from its own input, half from the peer's), whatever the transport: so no backend
can beat the time two processes, pinned one per CPU, take to copy S bytes each at once.
``python -m flagos_shm.bench`` prints a single process-to-process copy ("x-proc copy");
this is the other reference, both cores busy as they are in the collective. For each size
it prints the median time (microseconds) of one ``numpy.copyto`` of S bytes with one
process alone and with two at once (each process's median over ``--seconds`` of copies;
the source is touched once per page before each copy, as a collective's input is freshly
written).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    return int(t[:-1]) * units[t[-1]] if t[-1] in units else int(t)


def _copier(cpu: int, size: int, seconds: float, start, out) -> None:
    import numpy as np

    os.sched_setaffinity(0, {cpu})
    src = np.ones(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    for _ in range(3):
        np.copyto(dst, src)
    start.wait()
    times = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        src[::4096] += 1
        t0 = time.perf_counter_ns()
        np.copyto(dst, src)
        times.append(time.perf_counter_ns() - t0)
    out.put((cpu, statistics.median(times) / 1e3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,16M,64M", help="comma-separated sizes (bytes; K/M/G suffixes)")
    ap.add_argument("--seconds", type=float, default=3.0, help="copying time per case (s)")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        raise SystemExit("copy_floor.py: needs two CPUs in this process's affinity mask")
    print(f"CPUs {cpus}; median us per copy of S bytes")
    for size in (_size(s) for s in args.sizes.split(",")):
        for group in ([cpus[0]], cpus):
            start, out = mp.Barrier(len(group)), mp.Queue()
            procs = [mp.Process(target=_copier, args=(c, size, args.seconds, start, out)) for c in group]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            got = sorted(out.get() for _ in procs)
            what = "alone" if len(group) == 1 else "both at once"
            print(f"S={size:>10}  {what:<12} " + "  ".join(f"cpu{c}: {t:9.1f}" for c, t in got))


if __name__ == "__main__":
    main()
