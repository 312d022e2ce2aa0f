"""What staging a device tensor costs: each collective on a device tensor against the same
collective on a CPU tensor and the device copies alone, in one run.

World size 2, ranks pinned one per CPU, one intra-op thread each; the emulated ``flagos``
device (``FLAGOS_SHM_EMULATE=1``) unless a real one is registered. For each size S (bytes of
the tensor a rank passes: the buffer for allreduce, the whole output for allgather, the whole
input for reduce-scatter) and each op, three figures, best of ``--rounds`` interleaved rounds
(each round times every figure once, ``--iters`` calls each, median per call):

* ``cpu``: the op on CPU tensors of S bytes;
* ``staged``: the op on device tensors of S bytes (staged through pinned host memory);
* ``copies``: the device copies the staged op cannot avoid, alone: S bytes device to pinned
  host, a synchronisation of the stream, S bytes pinned host back to the device (for
  allgather and reduce-scatter: the input's bytes out and the output's bytes back);

and ``excess = staged - cpu - copies``, the part staging adds beyond its copies (issue 26's
target: at most 20 us). Run: ``python benches/staging_cost.py [--sizes 4,64K,1M,16M]
[--ops allreduce,allgather,reduce_scatter] [--rounds 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("FLAGOS_SHM_EMULATE", "1")

OPS = ("allreduce", "allgather", "reduce_scatter")


def _size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def _iters(nbytes: int, requested) -> int:
    return requested or max(10, min(2000, (256 << 20) // max(nbytes, 1)))


def _median_call(fn, iters: int, barrier) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls made back to back (each collective
    synchronises the ranks itself; a barrier between calls would add its own skew), after a
    barrier that starts the loop together on both ranks."""
    times = []
    barrier()
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rank_main(rank: int, world: int, path: str, args, out_path: str) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    import torch
    import torch.distributed as dist

    import flagos_shm  # noqa: F401  (registers the backend, enables the emulator)

    torch.set_num_threads(1)  # as torchrun (OMP_NUM_THREADS=1) and the demo do
    dist.init_process_group("flagos_shm", init_method=f"file://{path}", rank=rank, world_size=world)
    ctrl = dist.new_group(backend="gloo")
    dev_type = torch._C._get_privateuse1_backend_name()
    torch.get_device_module(dev_type).set_device(rank)
    dev = torch.device(dev_type, rank)
    stream = torch.get_device_module(dev_type).current_stream(dev)

    def barrier():
        dist.barrier(group=ctrl)

    def case(op: str, nbytes: int, device):
        numel = max(nbytes // 4, 1)
        if op == "allreduce":
            t = torch.ones(numel, device=device)
            return lambda: dist.all_reduce(t), (numel * 4, numel * 4)
        if op == "allgather":
            out = torch.empty(max(numel, world), device=device)
            inp = torch.ones(out.numel() // world, device=device)
            return lambda: dist.all_gather_into_tensor(out, inp), (inp.numel() * 4, out.numel() * 4)
        inp = torch.ones(max(numel, world), device=device)
        out = torch.empty(inp.numel() // world, device=device)
        return lambda: dist.reduce_scatter_tensor(out, inp), (inp.numel() * 4, out.numel() * 4)

    def copies(bytes_out: int, bytes_back: int):
        src = torch.ones(bytes_out, dtype=torch.uint8, device=dev)
        dst = torch.ones(bytes_back, dtype=torch.uint8, device=dev)
        host_out = torch.empty(bytes_out, dtype=torch.uint8, pin_memory=True)
        host_back = torch.ones(bytes_back, dtype=torch.uint8, pin_memory=True)

        def run():
            host_out.copy_(src, non_blocking=True)
            stream.synchronize()
            dst.copy_(host_back, non_blocking=True)
        return run

    rows = []
    for op in args.ops:
        for nbytes in args.sizes:
            cpu_fn, _ = case(op, nbytes, torch.device("cpu"))
            dev_fn, (bytes_out, bytes_back) = case(op, nbytes, dev)
            copy_fn = copies(bytes_out, bytes_back)
            iters = _iters(nbytes, args.iters)
            for fn in (cpu_fn, dev_fn, copy_fn):
                for _ in range(3):
                    barrier()
                    fn()
            best = {"cpu": float("inf"), "staged": float("inf"), "copies": float("inf")}
            for _ in range(args.rounds):
                for name, fn in (("cpu", cpu_fn), ("staged", dev_fn), ("copies", copy_fn)):
                    best[name] = min(best[name], _median_call(fn, iters, barrier))
                stream.synchronize()
            us = {k: v * 1e6 for k, v in best.items()}
            rows.append({"op": op, "size_bytes": nbytes, "iters": iters, **{f"{k}_us": v for k, v in us.items()},
                         "excess_us": us["staged"] - us["cpu"] - us["copies"]})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"device": dev_type, "torch": torch.__version__, "rounds": args.rounds, "rows": rows}, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,64K,1M,16M", help="sizes S (default 4,64K,1M,16M)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"subset of {','.join(OPS)}")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; best kept (default 3)")
    parser.add_argument("--iters", type=int, default=None, help="calls per figure per round (default by size)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    args.sizes = [_size(s) for s in args.sizes.split(",") if s.strip()]
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if set(args.ops) - set(OPS) or args.rounds < 1:
        parser.error(f"--ops: a subset of {','.join(OPS)}; --rounds >= 1")
    import platform

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(rank_main, args=(2, os.path.join(tmp, "store"), args, out), nprocs=2)
        with open(out) as f:
            doc = json.load(f)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"staging cost, world size 2, ranks pinned, {doc['device']} device, torch {doc['torch']}, {cpu}; "
          f"best of {doc['rounds']} rounds, median us per call")
    print(f"{'op':<15}{'S':>10}{'cpu':>11}{'staged':>11}{'copies':>11}{'excess':>11}")
    for r in doc["rows"]:
        print(f"{r['op']:<15}{r['size_bytes']:>10}{r['cpu_us']:>11.1f}{r['staged_us']:>11.1f}"
              f"{r['copies_us']:>11.1f}{r['excess_us']:>11.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**doc, "cpu_model": cpu}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
