"""The multi-node hierarchy's host work with torch's default intra-op threads.

Two ranks on two simulated nodes (``FLAGOS_SHM_NODE_ID``, Gloo over loopback), spawned
with ``torch.multiprocessing`` and left with torch's default intra-op threads (one per
CPU, as ``mp.spawn`` leaves them): the node leaders combine, convert and copy every
allreduce themselves, which is where torch's thread pools used to stall (docs/benchmark.md,
"torch's copy threads"). Times ``dist.all_reduce`` (float32 SUM and AVG, bfloat16 SUM) and
``all_gather_into_tensor`` at 1 MiB and 4 MiB; median and p90 per call in milliseconds,
slowest rank, as JSON on stdout.

Run: python benches/hier_host_ops.py [iterations]   (default 30; BENCH_THREADS=1 to compare
with one intra-op thread per rank)
"""
import json
import os
import socket
import statistics
import sys
import time

import torch.multiprocessing as mp


def rank_main(rank, port, iters, queue):
    os.environ.update(FLAGOS_SHM_NODE_ID=f"n{rank}", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import flagos_shm  # noqa: F401

    if os.environ.get("BENCH_THREADS"):  # for comparison: torchrun's OMP_NUM_THREADS=1
        torch.set_num_threads(int(os.environ["BENCH_THREADS"]))

    dist.init_process_group("flagos_shm", rank=rank, world_size=2)
    res = {}
    for nbytes in (1 << 20, 4 << 20):
        for name, dtype, op in (("allreduce f32 SUM", torch.float32, dist.ReduceOp.SUM),
                                ("allreduce f32 AVG", torch.float32, dist.ReduceOp.AVG),
                                ("allreduce bf16 SUM", torch.bfloat16, dist.ReduceOp.SUM),
                                ("allgather f32", torch.float32, None)):
            x = torch.ones(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
            out = torch.empty(2 * x.numel(), dtype=dtype)
            times = []
            for i in range(iters + 3):
                dist.barrier()
                t0 = time.perf_counter()
                if op is None:
                    dist.all_gather_into_tensor(out, x)
                else:
                    dist.all_reduce(x, op=op)
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            times.sort()
            res[f"{name} {nbytes >> 20} MiB"] = (statistics.median(times) * 1e3, times[int(0.9 * len(times))] * 1e3)
    dist.destroy_process_group()
    queue.put((rank, res))


if __name__ == "__main__":
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(rank_main, args=(port, iters, queue), nprocs=2)
    per_rank = dict(queue.get() for _ in range(2))
    slowest = {k: [round(max(per_rank[r][k][i] for r in per_rank), 3) for i in (0, 1)] for k in per_rank[0]}
    import torch

    threads = os.environ.get("BENCH_THREADS") or torch.get_num_threads()
    print(json.dumps({"torch": torch.__version__, "threads": threads, "median_p90_ms": slowest}, indent=1))
