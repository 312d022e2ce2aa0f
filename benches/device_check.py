"""flagos_shm on device tensors: correctness against CPU references, staging cost, DDP.

Run on a machine with an accelerator (both ranks may share one device)::

    torchrun --nproc-per-node 2 benches/device_check.py --device cuda --json out.json
    FLAGOS_SHM_EMULATE=1 torchrun --nproc-per-node 2 benches/device_check.py --device flagos

Checks (each rank; failures are listed and make the exit status 1):

* allreduce (SUM, MAX, AVG), broadcast, all_gather_into_tensor and reduce_scatter_tensor on
  device tensors of float32, bfloat16, float16 and int64, contiguous, non-contiguous and
  empty, synchronous and ``async_op=True``, against the same collective on CPU copies;
* a tensor produced on a side stream and reduced with that stream current: the result is
  read correctly by later work on that stream without any device-wide synchronisation;
* DDP over flagos_shm on device tensors: parameters bitwise identical on every rank and
  equal to DDP on CPU tensors within float32 tolerance;

and measures (rank 0 prints, medians in microseconds): allreduce of 4 B, 1 MiB and 64 MiB
on the device against the same on CPU (the staging cost), and the DDP step time with
flagos_shm on the device against gloo on the device when gloo supports it (CUDA).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

import flagos_shm  # noqa: F401  registers the backend


def _median_us(fn, iters: int) -> float:
    for _ in range(max(2, iters // 10)):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def check_collectives(dev: torch.device, failures: list) -> int:
    rank, n = dist.get_rank(), dist.get_world_size()
    checked = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        for numel in (0, 1, 7, 1000, 300_000):
            for layout in ("contiguous", "strided"):
                for async_op in (False, True):
                    g = torch.Generator().manual_seed(1000 * rank + numel)
                    base = (torch.randn(2 * numel + 1, generator=g) * 8)
                    base = base.round() if not dtype.is_floating_point else base
                    cpu = base.to(dtype)
                    cpu = cpu[:2 * numel:2] if layout == "strided" else cpu[:numel]
                    ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX]
                    if dtype.is_floating_point:
                        ops.append(dist.ReduceOp.AVG)
                    for op in ops:
                        ref = cpu.clone()
                        dist.all_reduce(ref, op=op)
                        d = cpu.to(dev)
                        if layout == "strided":
                            d = torch.empty(2 * numel + 1, dtype=dtype, device=dev)[:2 * numel:2]
                            d.copy_(cpu)
                        w = dist.all_reduce(d, op=op, async_op=async_op)
                        if async_op:
                            w.wait()
                        checked += 1
                        if not torch.equal(d.cpu(), ref):
                            failures.append(f"allreduce {dtype} {op} numel={numel} {layout} async={async_op}")
                    # broadcast from the last rank
                    ref = cpu.clone()
                    dist.broadcast(ref, src=n - 1)
                    d = cpu.to(dev)
                    w = dist.broadcast(d, src=n - 1, async_op=async_op)
                    if async_op:
                        w.wait()
                    checked += 1
                    if not torch.equal(d.cpu(), ref):
                        failures.append(f"broadcast {dtype} numel={numel} {layout} async={async_op}")
                    # all_gather_into_tensor / reduce_scatter_tensor (contiguous inputs)
                    flat = cpu.contiguous()
                    ref = torch.empty(n * numel, dtype=dtype)
                    dist.all_gather_into_tensor(ref, flat)
                    out = torch.empty(n * numel, dtype=dtype, device=dev)
                    w = dist.all_gather_into_tensor(out, flat.to(dev), async_op=async_op)
                    if async_op:
                        w.wait()
                    checked += 1
                    if not torch.equal(out.cpu(), ref):
                        failures.append(f"all_gather_into_tensor {dtype} numel={numel} async={async_op}")
                    big = torch.cat([flat] * n)
                    ref = torch.empty(numel, dtype=dtype)
                    dist.reduce_scatter_tensor(ref, big)
                    out = torch.empty(numel, dtype=dtype, device=dev)
                    w = dist.reduce_scatter_tensor(out, big.to(dev), async_op=async_op)
                    if async_op:
                        w.wait()
                    checked += 1
                    if not torch.equal(out.cpu(), ref):
                        failures.append(f"reduce_scatter_tensor {dtype} numel={numel} async={async_op}")
    return checked


def check_side_stream(dev: torch.device, failures: list) -> None:
    mod = torch.get_device_module(dev.type)
    rank, n = dist.get_rank(), dist.get_world_size()
    side = mod.Stream(dev) if hasattr(mod, "Stream") else torch.Stream(dev.type)
    with mod.stream(side):
        x = torch.full((1 << 20,), float(rank + 1), device=dev)
        x.mul_(2)  # still queued on the side stream when the collective starts
        for async_op in (False, True):
            y = x.clone()
            w = dist.all_reduce(y, async_op=async_op)
            if async_op:
                w.wait()
            z = y * 1  # ordered after the result's copy on the same stream
            expected = 2.0 * sum(range(1, n + 1))
            if not bool((z == expected).all().cpu()):
                failures.append(f"side-stream allreduce async={async_op}: got {z[:3].tolist()}, expected {expected}")


def _ddp_params(dev: torch.device, backend_group, steps: int = 5) -> list:
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
    ddp = DDP(model, process_group=backend_group, bucket_cap_mb=0.05)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g).to(dev)
        y = torch.randint(0, 10, (32,), generator=g).to(dev)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def check_ddp(dev: torch.device, failures: list) -> None:
    got = _ddp_params(dev, None)
    ref = _ddp_params(torch.device("cpu"), None)
    for i, (a, b) in enumerate(zip(got, ref)):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            failures.append(f"DDP on {dev.type}: parameter {i} differs from DDP on CPU")
        other = a.clone()
        dist.broadcast(other, src=0)
        if not torch.equal(a, other):
            failures.append(f"DDP on {dev.type}: parameter {i} differs between ranks")


def ddp_step_ms(dev: torch.device, group, steps: int = 30) -> float:
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(dev)
    ddp = DDP(model, process_group=group, bucket_cap_mb=4)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(64, 1024, device=dev)
    mod = torch.get_device_module(dev.type) if dev.type != "cpu" else None

    def step():
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        if mod is not None:
            mod.synchronize()
    return _median_us(step, steps) / 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="device type of the tensors (cuda, flagos, ...)")
    parser.add_argument("--json", default=None, help="write rank 0's results to this file")
    args = parser.parse_args()
    dist.init_process_group("flagos_shm")
    rank, n = dist.get_rank(), dist.get_world_size()
    mod = torch.get_device_module(args.device)
    index = rank % max(1, mod.device_count())
    mod.set_device(index)
    dev = torch.device(args.device, index)
    failures: list = []
    results: dict = {"device": args.device, "world_size": n, "torch": torch.__version__}
    results["checked"] = check_collectives(dev, failures)
    check_side_stream(dev, failures)
    check_ddp(dev, failures)
    timing = {}
    for label, nbytes in (("4 B", 4), ("1 MiB", 1 << 20), ("64 MiB", 64 << 20)):
        iters = 200 if nbytes < (1 << 20) else (100 if nbytes == 1 << 20 else 10)
        d = torch.ones(nbytes // 4, device=dev)
        c = torch.ones(nbytes // 4)

        def on_dev():
            dist.all_reduce(d)
            mod.synchronize()
        timing[label] = {"device_us": _median_us(on_dev, iters),
                         "cpu_us": _median_us(lambda: dist.all_reduce(c), iters)}
    results["allreduce_us"] = timing
    results["ddp_step_ms"] = {"flagos_shm": ddp_step_ms(dev, None)}
    if args.device == "cuda":
        gloo = dist.new_group(backend="gloo")
        results["ddp_step_ms"]["gloo"] = ddp_step_ms(dev, gloo)
    all_failures = [None] * n
    dist.all_gather_object(all_failures, failures)
    results["failures"] = [f"rank {r}: {f}" for r, fs in enumerate(all_failures) for f in fs]
    if rank == 0:
        print(json.dumps(results, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
