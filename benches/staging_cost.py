"""Staging cost: allreduce time of a flagos tensor against the same CPU tensor.

World size 2 (ranks pinned one per CPU, one intra-op thread each), float32 SUM at 4 B,
1 MiB and 64 MiB, median per call in microseconds, both devices measured in the same run.
Uses the emulated flagos device (FLAGOS_SHM_EMULATE=1) unless a real one is registered.

Run: python benches/staging_cost.py
"""
import os
import statistics
import tempfile
import time
os.environ["FLAGOS_SHM_EMULATE"] = "1"
import torch.multiprocessing as mp

def rank_main(rank, path):
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)  # as torchrun (OMP_NUM_THREADS=1) and the demo do
    dist.init_process_group("flagos_shm", init_method=f"file://{path}", rank=rank, world_size=2)
    torch.flagos.set_device(rank)
    for nbytes, iters in [(4, 2000), (1 << 20, 200), (64 << 20, 10)]:
        res = {}
        for dev in ["cpu", f"flagos:{rank}"]:
            x = torch.ones(nbytes // 4, device=dev)
            for _ in range(3):
                dist.all_reduce(x)
            times = []
            for _ in range(iters):
                dist.barrier()
                t = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t)
            res[dev.split(":")[0]] = statistics.median(times) * 1e6
        if rank == 0:
            print(f"{nbytes:>9} B  cpu {res['cpu']:9.1f} us  flagos {res['flagos']:9.1f} us  "
                  f"staging overhead x{res['flagos'] / res['cpu']:.2f}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(os.path.join(tmp, 'store'),), nprocs=2)
