"""Plain against streaming stores into the slots, and the automatic choice, side by side.

Run: ``python benches/stream_ab.py [--samples 12] [--gap 1] [--world 2] [--sizes 64,1024]``
(sizes in KiB). It starts ``--world`` local ranks, pinned one per CPU, each with three
flagos_shm groups created with ``FLAGOS_SHM_STREAM=0``, ``1`` and ``auto``
(``rust/stream.rs``), and the slot algorithms forced (no single-copy). Every sample
prints, from rank 0, the median microseconds over 41 calls of the core's allreduce,
allgather (input rewritten before each call, untimed), broadcast and alltoall at each size
as ``plain/stream/auto``, the three groups measured one after the other; samples ``--gap``
seconds apart show the VM's placements (docs/benchmark.md, "The VM's placements").
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = (("plain", "0"), ("stream", "1"), ("auto", "auto"))


def _median_us(f, pre=None, k: int = 41) -> float:
    for _ in range(3):
        f()
    ts = []
    for _ in range(k):
        if pre:
            pre()
        t = time.perf_counter_ns()
        f()
        ts.append(time.perf_counter_ns() - t)
    return sorted(ts)[k // 2] / 1e3


def _rank(rank: int, args, store_path: str) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    os.environ["FLAGOS_SHM_PLAN"] = "fallback"
    import flagos_shm  # noqa: F401  (registers the backend)
    from flagos_shm.backend import plan, shm_part

    n = args.world
    dist.init_process_group("gloo", rank=rank, world_size=n, init_method=f"file://{store_path}")
    comms = {}
    for name, value in MODES:
        os.environ["FLAGOS_SHM_STREAM"] = value
        comms[name] = shm_part(dist.new_group(list(range(n)), backend="flagos_shm"), "cpu")._comm
    for c in comms.values():
        plan._set(c, dict(plan.FALLBACK, **{k: None for k in plan.SINGLE_COPY_KEYS}))
    for _ in range(args.samples):
        out = []
        for kib in args.sizes:
            s = kib << 10
            x, y = torch.ones(s // 4), torch.empty(s // 4)
            h = torch.ones(s // 4 // n)
            fresh = torch.ones_like(h)
            cases = {"allreduce": lambda c: c.allreduce(x.data_ptr(), s, s // 4, "float32", 0),
                     "allgather": lambda c: c.allgather(h.data_ptr(), s // n, x.data_ptr(), s, s // 4 // n, "float32"),
                     "broadcast": lambda c: c.broadcast(x.data_ptr(), s, s // 4, "float32", 0),
                     "alltoall": lambda c: c.alltoall(x.data_ptr(), s, y.data_ptr(), s, s // 4 // n, "float32")}
            for op, f in cases.items():
                pre = (lambda: h.copy_(fresh)) if op == "allgather" else None
                r = [_median_us(lambda c=c: f(c), pre) for c in comms.values()]
                out.append(f"{op} {kib}K {r[0]:.0f}/{r[1]:.0f}/{r[2]:.0f}")
        if rank == 0:
            print(time.strftime("%H:%M:%S"), "plain/stream/auto us:", ", ".join(out), flush=True)
        dist.barrier()
        time.sleep(args.gap)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=12)
    p.add_argument("--gap", type=float, default=1.0)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=[64, 1024])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(args, os.path.join(d, "store")), nprocs=args.world)


if __name__ == "__main__":
    main()
