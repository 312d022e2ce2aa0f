"""Coalesced batches and uneven all-to-all: median time per call, and FSDP2 step time.

Run: ``python benches/coalescing.py [--world 2] [--iters 200] [--fsdp-steps 30]``. It starts
``--world`` local ranks (a FileStore in a temporary directory), each on
``backend="flagos_shm"``, and prints, from rank 0, the median microseconds per call of:

* ``_coalescing_manager`` batches of 64 float32 tensors of 4 KiB, timed in alternation
  with the same tensors issued one collective each (what the backend did with a batch
  before issue 12): ``all_reduce``
  (the backend's ``allreduce_coalesced``), ``all_gather_into_tensor``
  (``all_gather_single_coalesced``), ``reduce_scatter_tensor``
  (``reduce_scatter_single_coalesced``);
* the same three on "FSDP2 shapes": one tensor per parameter of a small decoder (4
  layers, d=128: weights, biases, norms; sharded along dim 0 for the gathers), the
  per-parameter pattern of DTensor redistributions and ``all_gather_single_coalesced``;
* ``all_to_all_single`` with uneven split sizes (a MoE-style token exchange), sync and
  four in flight with ``async_op=True``;
* the median step time (forward, backward, optimizer) of that decoder under FSDP2
  (``fully_shard`` per layer) on the emulated ``flagos`` device.

Timing is per call after a barrier; figures vary with the machine's load (report the
command, the machine and several runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time


def _decoder(torch, d=128, layers=4):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

        def forward(self, x):
            q, k, v = self.qkv(self.n1(x)).chunk(3, dim=-1)
            a = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, dim=-1) @ v
            x = x + self.out(a)
            return x + self.down(torch.relu(self.up(self.n2(x))))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block() for _ in range(layers))
            self.head = torch.nn.Linear(d, 16)

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return self.head(x)
    return Model()


def _median_us(fn, iters, dist):
    return _interleaved_us([fn], iters, dist)[0]


def _interleaved_us(fns, iters, dist):
    """Median and minimum microseconds per call of each of ``fns``, timed in alternation
    (so that a load change on the machine hits them alike), each call after a barrier."""
    for _ in range(max(5, iters // 10)):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    out = []
    for ts in times:
        ts.sort()
        out.append(f"median {ts[len(ts) // 2] * 1e6:.1f}, min {ts[0] * 1e6:.1f}")
    return out


def rank_main(rank, world, store, iters, fsdp_steps):
    import torch
    import torch.distributed as dist

    import flagos_shm  # noqa: F401

    torch.manual_seed(0)
    dist.init_process_group("flagos_shm", init_method=f"file://{store}", rank=rank, world_size=world)
    n, res = world, {}

    def batch(tensors, kind, coalesce=True):
        """The batch inside ``_coalescing_manager`` (one backend ``*_coalesced`` call), or
        (``coalesce=False``) one collective per tensor, as the backend ran a batch before."""
        manager = dist._coalescing_manager if coalesce else contextlib.nullcontext
        if kind == "allreduce":
            def run():
                with manager():
                    for t in tensors:
                        dist.all_reduce(t)
        elif kind == "allgather":
            outs = [torch.empty(n * t.numel()) for t in tensors]

            def run():
                with manager():
                    for o, t in zip(outs, tensors):
                        dist.all_gather_into_tensor(o, t)
        else:
            ins = [torch.randn(n * t.numel()) for t in tensors]

            def run():
                with manager():
                    for o, t in zip(tensors, ins):
                        dist.reduce_scatter_tensor(o, t)
        return run

    small = [torch.randn(1024) for _ in range(64)]
    shapes = [p.numel() for p in _decoder(torch).parameters()]
    shards = [torch.randn(max(1, k // n)) for k in shapes]
    for kind in ("allreduce", "allgather", "reduce_scatter"):
        for label, ts in (("64 x 4 KiB", small), (f"FSDP2 shapes ({len(shards)} tensors)", shards)):
            one, batched = _interleaved_us([batch(ts, kind, False), batch(ts, kind)], iters, dist)
            res[f"{label} {kind}, one per tensor"] = one
            res[f"{label} {kind}, coalesced"] = batched

    # uneven all-to-all: rank r sends (r + q) % 4 * 256 + 64 rows of 16 floats to rank q
    send = [((rank + q) % 4) * 256 + 64 for q in range(n)]
    recv = [((q + rank) % 4) * 256 + 64 for q in range(n)]
    inp, out = torch.randn(sum(send), 16), torch.empty(sum(recv), 16)
    res["all_to_all_single uneven"] = _median_us(lambda: dist.all_to_all_single(out, inp, recv, send), iters, dist)
    outs = [torch.empty(sum(recv), 16) for _ in range(4)]

    def four_async():
        works = [dist.all_to_all_single(o, inp, recv, send, async_op=True) for o in outs]
        for w in works:
            if w is not None:  # before issue 12 the uneven path ran inline and returned None
                w.wait()
    res["all_to_all_single uneven, 4 async"] = _median_us(four_async, iters, dist)
    dist.destroy_process_group()

    if fsdp_steps:
        from torch.distributed.fsdp import fully_shard

        torch.accelerator.set_device_index(rank)
        dev = torch.device("flagos", rank)
        dist.init_process_group("flagos_shm", init_method=f"file://{store}.fsdp", rank=rank, world_size=world)
        model = _decoder(torch).to(dev)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(8, 32, 128, device=dev)
        steps = []
        for i in range(fsdp_steps + 5):
            dist.barrier()
            t0 = time.perf_counter()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i >= 5:
                steps.append(time.perf_counter() - t0)
        steps.sort()
        res["FSDP2 step (ms, emulated flagos)"] = round(steps[len(steps) // 2] * 1e3, 2)
        dist.destroy_process_group()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--fsdp-steps", type=int, default=30)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank is not None:
        res = rank_main(a.rank, a.world, a.store, a.iters, a.fsdp_steps)
        if a.rank == 0:
            print(json.dumps(res))
        return
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FLAGOS_SHM_EMULATE": "1"}
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(a.world),
                                   "--iters", str(a.iters), "--fsdp-steps", str(a.fsdp_steps),
                                   "--store", os.path.join(tmp, "store")],
                                  env=env, stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True)
                 for r in range(a.world)]
        out, _ = procs[0].communicate(timeout=900)
        codes = [p.wait(timeout=60) for p in procs]
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")
    res = json.loads(out.strip().splitlines()[-1])
    width = max(map(len, res))
    for k, v in res.items():
        print(f"{k:<{width}}  {v}{'' if 'ms' in k else ' us'}")


if __name__ == "__main__":
    main()
