"""Train a small classifier with DistributedDataParallel over ``flagos_shm``.

Run::

    python -m flagos_shm.demo                       # 2 local ranks, backend flagos_shm
    python -m flagos_shm.demo --nproc 4 --compare   # flagos_shm, then gloo, same seed and data
    python -m flagos_shm.demo --emulate             # on the emulated flagos device
    torchrun --nproc-per-node 2 -m flagos_shm.demo  # the same job under torchrun

What it does: scikit-learn's bundled handwritten-digits data set
(``sklearn.datasets.load_digits``: 1797 8x8 images, 10 classes; no download) is
split into a training set and a held-out set (25 %, stratified, fixed seed),
standardised with the training set's mean and variance, and an MLP
(64-128-128-10, float32, about 26 k parameters) is trained with SGD + momentum under
``torch.nn.parallel.DistributedDataParallel``. Each rank trains on its shard of
the training set (``DistributedSampler``); the held-out set is split between the
ranks for evaluation and the counts are summed with an allreduce.

Measured and printed by rank 0 for each epoch: mean training loss over all ranks,
held-out accuracy, mean time per training step (zero_grad + forward + backward,
gradient allreduce included + optimizer step) and the share of it spent in
communication. Communication is measured with a DDP communication hook that wraps
``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook`` (the
behaviour DDP has without a hook) and times each gradient bucket from the hook
call to the completion of the allreduce's future, on rank 0.

Device: ``--device auto`` (the default) trains on the ``flagos`` accelerator when one is
present, i.e. a real torch_fl device or the emulated one (``--emulate`` or
``FLAGOS_SHM_EMULATE=1``), with local rank i on ``flagos:i`` and DDP's
``device_ids=[i]``; otherwise on the CPU. ``--device cpu|flagos`` chooses explicitly.
gloo cannot take flagos tensors, so gloo runs (``--backend gloo``, ``--compare``) train
on the CPU and say so.

At the end every rank publishes its flattened parameters (raw bytes) in the
rendezvous store, which does not go through the backend under test, and rank 0
compares them bitwise. The exit status is 0 when training finished and every rank
holds identical parameters, 2 when parameters differ, 1 (or the failing rank's
status) when training failed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported in the functions that need it (fast --help)
    import torch

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Dict, List

from . import _launch

BACKENDS = ("flagos_shm", "gloo")
# Steps excluded from the timing summary: DDP rebuilds its gradient buckets after
# the first iteration and the first steps touch cold caches and allocators.
WARMUP_STEPS = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flagos_shm.demo",
        description="Train an MLP on scikit-learn's digits with DDP over flagos_shm "
                    "(or gloo) and check that every rank ends with identical parameters.")
    p.add_argument("--nproc", type=int, default=2,
                   help="number of local ranks to start (default 2); ignored under torchrun")
    p.add_argument("--backend", choices=BACKENDS, default="flagos_shm",
                   help="process-group backend (default flagos_shm)")
    p.add_argument("--compare", action="store_true",
                   help="run flagos_shm and then gloo with the same seed and data, and "
                        "print the step-time ratio gloo/flagos_shm")
    p.add_argument("--epochs", type=int, default=10, help="training epochs (default 10)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="batch size per rank (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for the split, initialisation and shuffling (default 0)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="process-group timeout in seconds (default 120); the whole job "
                        "is stopped after 3x this")
    p.add_argument("--json", action="store_true",
                   help="end the output with exactly one JSON line summarising the run")
    p.add_argument("--device", choices=("auto", "cpu", "flagos"), default="auto",
                   help="where to train: flagos when a flagos device is present (auto, the "
                        "default), or cpu / flagos explicitly")
    p.add_argument("--emulate", action="store_true",
                   help="enable the emulated flagos device (same as FLAGOS_SHM_EMULATE=1)")
    p.add_argument("--bind", action="store_true",
                   help="pin local rank i to the i-th allowed CPU (modulo the CPU count); "
                        "default: let the scheduler place the ranks")
    return p


def validate(args: argparse.Namespace) -> None:
    for name in ("nproc", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, name)}")
    if not args.lr > 0:
        raise SystemExit(f"--lr must be > 0, got {args.lr}")
    if not args.timeout > 0:
        raise SystemExit(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.device == "flagos" and not args.emulate and not flagos_present():  # once, before the ranks start
        raise SystemExit("--device flagos: no flagos device is registered (install torch_fl, or pass --emulate)")


# --------------------------------------------------------------------------- data / model

def load_data(seed: int):
    """Return float32 (x_train, y_train, x_test, y_test) tensors; x is (N, 64), y int64 (N,)."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_tr)
    def as_x(a):
        return torch.from_numpy(scaler.transform(a).astype(np.float32))

    def as_y(a):
        return torch.from_numpy(a.astype(np.int64))
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


def build_model(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(),
                         nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


class TimedAllreduce:
    """DDP communication hook state: ``allreduce_hook`` plus timing of each bucket.

    ``comm_s`` accumulates, in seconds, the time from the hook call to the
    completion of the bucket's allreduce future (``time.perf_counter``).
    """

    def __init__(self, group) -> None:
        self.group = group
        self.comm_s = 0.0

    @staticmethod
    def hook(state: "TimedAllreduce", bucket):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        start = time.perf_counter()
        fut = default_hooks.allreduce_hook(state.group, bucket)

        def done(f):
            state.comm_s += time.perf_counter() - start
            return f.value()

        return fut.then(done)


def flat_params(model) -> "torch.Tensor":
    import torch

    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


# --------------------------------------------------------------------------- one training run

def flagos_present() -> bool:
    """Whether a flagos accelerator (real or emulated) is registered and available."""
    import torch

    module = getattr(torch, "flagos", None)
    return module is not None and bool(module.is_available()) and module.device_count() > 0


def pick_device(backend: str, local_rank: int, args) -> "torch.device":
    """The device this rank trains on (see the module docstring)."""
    import torch

    want = args.device
    if want == "auto":
        want = "flagos" if flagos_present() else "cpu"
    if want == "flagos":
        if not flagos_present():
            raise RuntimeError("--device flagos: no flagos device is registered "
                               "(install torch_fl, or pass --emulate)")
        if backend == "gloo":
            return torch.device("cpu")  # gloo rejects flagos tensors: the reason flagos_shm exists
        count = torch.flagos.device_count()
        if local_rank >= count:
            raise RuntimeError(f"--device flagos: local rank {local_rank} needs flagos:{local_rank} "
                               f"but only {count} flagos device(s) exist")
        return torch.device("flagos", local_rank)
    return torch.device("cpu")


def train_one(backend: str, store, rank: int, world_size: int, args) -> Dict:
    """Train with ``backend`` in a process group of its own; return rank 0's summary."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import flagos_shm  # noqa: F401  (registers "flagos_shm"; FLAGOS_SHM_EMULATE=1 enables the emulator)

    device = pick_device(backend, int(os.environ.get("LOCAL_RANK", rank)), args)

    log = print if rank == 0 else (lambda *a, **k: None)
    run_store = dist.PrefixStore(f"flagos_shm.demo/{backend}", store)
    dist.init_process_group(backend=backend, store=run_store, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=args.timeout))
    try:
        group = dist.group.WORLD
        x_tr, y_tr, x_te, y_te = (t.to(device) for t in load_data(args.seed))
        train_set = TensorDataset(x_tr, y_tr)
        sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                     shuffle=True, seed=args.seed)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
        x_eval, y_eval = x_te[rank::world_size], y_te[rank::world_size]

        ddp_devices = None if device.type == "cpu" else [device.index]
        model = DDP(build_model(args.seed).to(device), device_ids=ddp_devices, process_group=group)
        timer = TimedAllreduce(group)
        model.register_comm_hook(timer, TimedAllreduce.hook)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()

        log(f"\n== backend {backend} on {device.type}"
            + (" (gloo cannot take flagos tensors)" if backend == "gloo" and args.device != "cpu"
               and flagos_present() else "")
            + f": world size {world_size}, {len(x_tr)} training / "
            f"{len(x_te)} held-out samples, batch {args.batch_size} per rank, "
            f"{len(loader)} steps per epoch per rank")
        log(f"{'epoch':>5} {'loss':>8} {'accuracy':>9} {'step ms':>8} {'comm ms':>8} {'comm %':>7}")

        step_times: List[float] = []
        comm_times: List[float] = []
        accuracy = float("nan")
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            loss_sum = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of losses * n, n)
            ep_steps, ep_comm = [], []
            for xb, yb in loader:
                comm_before = timer.comm_s
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(xb), yb)
                loss.backward()  # returns after DDP waited for the gradient allreduce
                opt.step()
                ep_steps.append(time.perf_counter() - t0)
                ep_comm.append(timer.comm_s - comm_before)
                loss_sum[0] += loss.item() * len(yb)
                loss_sum[1] += len(yb)
            step_times += ep_steps
            comm_times += ep_comm

            model.eval()
            with torch.no_grad():
                correct = (model(x_eval).argmax(dim=1) == y_eval).sum()
            counts = torch.stack([correct, torch.tensor(len(y_eval), device=device)]).to(torch.int64)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=group)
            if int(counts[1]) != len(y_te):
                raise RuntimeError(f"evaluation counted {int(counts[1])} held-out samples "
                                   f"over all ranks, expected {len(y_te)}")
            accuracy = int(counts[0]) / int(counts[1])
            mean_step, mean_comm = sum(ep_steps) / len(ep_steps), sum(ep_comm) / len(ep_steps)
            log(f"{epoch + 1:>5} {float(loss_sum[0] / loss_sum[1]):>8.4f} {accuracy:>9.2%} "
                f"{mean_step * 1e3:>8.3f} {mean_comm * 1e3:>8.3f} "
                f"{100 * mean_comm / mean_step:>6.1f}%")

        steps = step_times[WARMUP_STEPS:] or step_times
        comms = comm_times[WARMUP_STEPS:] or comm_times
        step_s, comm_s = sum(steps) / len(steps), sum(comms) / len(comms)

        # Bitwise parameter check through the rendezvous store (not through the
        # backend under test, so a broken backend cannot hide a difference).
        mine = flat_params(model.module).numpy().tobytes()
        run_store.set(f"params/{rank}", mine)
        identical = True
        if rank == 0:
            mismatched = [r for r in range(1, world_size) if run_store.get(f"params/{r}") != mine]
            identical = not mismatched
            run_store.set("params/verdict", "identical" if identical else
                          "differ on ranks " + ",".join(map(str, mismatched)))
            digest = hashlib.sha256(mine).hexdigest()[:16]
            log(f"parameters ({len(mine)} bytes, sha256 {digest}...): "
                + ("bitwise identical on all ranks" if identical else
                   f"DIFFER from rank 0 on rank(s) {mismatched}"))
        else:
            identical = run_store.get("params/verdict") == b"identical"
        excluded = f"first {WARMUP_STEPS} excluded" if len(step_times) > WARMUP_STEPS else "too few to exclude any"
        log(f"step time {step_s * 1e3:.3f} ms (mean over {len(steps)} steps on rank 0, {excluded}), "
            f"communication {comm_s * 1e3:.3f} ms ({100 * comm_s / step_s:.1f}%)")
        dist.barrier(group=group)
        return {"backend": backend, "device": device.type, "final_accuracy": accuracy, "step_time_s": step_s,
                "comm_time_s": comm_s, "comm_share": comm_s / step_s,
                "params_identical": identical, "params_sha256": hashlib.sha256(mine).hexdigest()}
    finally:
        dist.destroy_process_group()


def worker(args) -> int:
    """Body of one rank (under torchrun or :func:`flagos_shm._launch.launch`)."""
    import torch

    _launch.worker_setup()
    if args.emulate:
        from . import emulation

        emulation.enable()
    store, rank, world_size, local_world_size = _launch.rendezvous(args.timeout)
    torch.set_num_threads(_launch.default_threads(local_world_size))
    if args.bind:
        _launch.bind_to_cpu(int(os.environ.get("LOCAL_RANK", rank)))
    try:
        backends = ["flagos_shm", "gloo"] if args.compare else [args.backend]
        runs = [train_one(b, store, rank, world_size, args) for b in backends]
    except Exception:  # report which rank failed, then exit non-zero
        print(f"[rank {rank}] training failed:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        return 1
    identical = all(r["params_identical"] for r in runs)
    if rank == 0:
        summary = {"backends": backends, "world_size": world_size, "epochs": args.epochs,
                   "batch_size_per_rank": args.batch_size, "seed": args.seed,
                   "bind": args.bind,
                   "comm_time_measured_as": "DDP comm hook: allreduce_hook call to future "
                                            "completion, summed over buckets, rank 0",
                   "runs": runs, "params_identical": identical}
        if args.compare:
            t = {r["backend"]: r["step_time_s"] for r in runs}
            ratio = t["gloo"] / t["flagos_shm"]
            same = runs[0]["params_sha256"] == runs[1]["params_sha256"]
            summary["step_time_ratio_gloo_over_flagos_shm"] = ratio
            print(f"\nstep time gloo / flagos_shm = {ratio:.2f} "
                  f"({t['gloo'] * 1e3:.3f} ms / {t['flagos_shm'] * 1e3:.3f} ms); final "
                  f"parameters of the two backends are "
                  f"{'bitwise identical' if same else 'not bitwise identical'} (informative "
                  f"only: the order of summation may differ between backends)")
        if not identical:
            print("FAILED: ranks ended with different parameters", file=sys.stderr)
        if args.json:
            print(json.dumps(summary), flush=True)
    sys.stdout.flush()
    return 0 if identical else 2


def main(argv: List[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    validate(args)
    if _launch.launched_as_rank():
        try:
            return worker(args)
        finally:
            _launch.worker_teardown()
    argv = list(sys.argv[1:] if argv is None else argv)
    return _launch.launch("flagos_shm.demo", argv, args.nproc, timeout_s=3 * args.timeout)


if __name__ == "__main__":
    sys.exit(main())
