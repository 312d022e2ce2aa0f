"""One benchmark rank from start to end (:func:`worker`) and the entry point (:func:`main`)."""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

from .. import _launch, config
from . import limit
from .common import (BANDWIDTH_DEFINITION, ITER_BUDGET_BYTES, MAX_ITERS, MIN_ITERS, REFERENCE, SCHEMA,
                     TIME_DEFINITION, human, iterations)
from .machine import command_line, cpu_model, machine_info, setup_device
from .mpi import run_mpi
from .overhead import measure_overhead
from .plan import build_parser, output_paths, plan_from_args
from .progress import Progress
from .rounds import best_of
from .tables import ratios, report, staging_rows
from .timing import measure, measure_copy, measure_device_copy

#: With --device other than cpu: flagos_shm on CPU tensors too, under this name, so that the
#: report can say what staging costs beyond the CPU call and the device copies.
CPU_TWIN = "flagos_shm@cpu"


def _measure_round(plan, cases, copy_sizes, groups, devices, ctrl, rank, progress,
                   skipped: Optional[list]) -> Tuple[list, list, list, list]:
    """One round: the copy baselines, then every case on every torch backend. Returns
    ``(copy_rows, xcopy_rows, results, device_copy_rows)``; cases a backend rejects on every
    rank go to ``skipped`` on rank 0 (None: not recorded, as in every round after the
    first)."""
    copy_rows = measure_copy(copy_sizes, plan, rank, ctrl, progress)
    if rank == 0:
        progress.note("cross-process copy baseline (ranks 0 and 1)")
    xcopy_rows = limit.measure_xcopy(copy_sizes, plan, rank, ctrl, plan.world_size)
    staged_device = devices.get(REFERENCE)
    device_copy_rows = ([] if staged_device is None or staged_device.type == "cpu"
                        else measure_device_copy(copy_sizes, plan, rank, ctrl, staged_device))
    results = []
    for op, dtype, _, size in cases:
        for b, g in groups.items():
            record, reason = measure(op, dtype, size, b, g, ctrl, plan, rank, devices[b])
            if record is not None:
                results.append(record)
            elif rank == 0 and skipped is not None:
                skipped.append({"backend": b, "op": op, "dtype": dtype, "size_bytes": size, "reason": reason})
            if rank == 0:
                w, i = iterations(size, plan.iters, plan.warmup)
                progress.advance(Progress.weight(size, w, i), f"{op} {dtype} {human(size)} {b}")
    return copy_rows, xcopy_rows, results, device_copy_rows


def worker(args, argv: Sequence[str]) -> int:
    """Body of one rank (under torchrun or :func:`flagos_shm._launch.launch`)."""
    import torch
    import torch.distributed as dist

    _launch.worker_setup()
    started = time.monotonic()
    plan = plan_from_args(args)
    store, rank, world_size, local_world_size = _launch.rendezvous(args.timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.set_num_threads(_launch.default_threads(local_world_size))
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if args.bind:
        _launch.bind_to_cpu(local_rank)
    plan.world_size = world_size  # (importing this module imported flagos_shm: backend registered)
    if args.nodes > 1:  # read when the flagos_shm group is created (backend/rendezvous.py)
        os.environ[config.ENV_NODE_ID] = f"bench-node-{rank * args.nodes // world_size}"
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    timeout = timedelta(seconds=args.timeout)
    notes: List[str] = []
    mpi_info: dict = {"status": "not requested", "reason": ""} if "mpi" not in plan.backends else {}
    results: List[dict] = []
    skipped: List[dict] = []
    progress = Progress(0, enabled=False)
    try:
        device = setup_device(plan.device, local_rank)
        dist.init_process_group("gloo", store=dist.PrefixStore("flagos_shm.bench", store),
                                rank=rank, world_size=world_size, timeout=timeout)
        ctrl = dist.group.WORLD
        # Every rank must run the same plan, or the fixed iteration counts disagree.
        plans: List[Optional[dict]] = [None] * world_size
        dist.all_gather_object(plans, asdict(plan), group=ctrl)
        if any(p != plans[0] for p in plans):
            raise RuntimeError(f"ranks disagree on the benchmark plan: {plans}")
        groups = {b: dist.new_group(ranks=list(range(world_size)), backend=b, timeout=timeout)
                  for b in plan.torch_backends}
        cpu = torch.device("cpu")
        devices = {b: (device if b == "flagos_shm" else cpu) for b in groups}
        if device.type != "cpu" and "flagos_shm" in groups:
            groups[CPU_TWIN], devices[CPU_TWIN] = groups["flagos_shm"], cpu
            notes.append(f"--device {plan.device}: flagos_shm was measured on {device.type} tensors (staged "
                         f"through pinned host memory) and, as {CPU_TWIN}, on CPU tensors; the staging "
                         "table puts the device copies alone beside them")
        if device.type != "cpu" and "gloo" in groups:
            notes.append(f"--device {plan.device}: gloo cannot take {device.type} tensors; gloo "
                         f"was measured on CPU tensors, flagos_shm on {device.type} tensors")
        if args.nodes > 1:
            notes.append(f"--nodes {args.nodes}: {args.nodes} nodes simulated on one machine with "
                         "FLAGOS_SHM_NODE_ID (Gloo over loopback between them): flagos_shm is hierarchical "
                         "(shared memory in each node, Gloo among the node leaders), gloo is flat")
        cases = plan.cases()
        copy_sizes = sorted({size for _, _, _, size in cases})
        if rank == 0:
            total = sum(Progress.weight(size, *iterations(size, plan.iters, plan.warmup)) * len(groups)
                        for _, _, _, size in cases)
            total += sum(Progress.weight(s, *iterations(s, plan.iters, plan.warmup)) / 4 for s in copy_sizes)
            total *= plan.rounds
            progress = Progress(total, enabled=not args.no_progress)
            pinned = "pinned one per CPU (--bind)" if plan.bind else "placed by the scheduler"
            print(f"flagos_shm.bench: world size {world_size}, backends {', '.join(plan.backends)}, "
                  f"device {device}, ops {', '.join(plan.ops)}, dtypes {', '.join(plan.dtypes)}, "
                  f"{len(plan.sizes)} sizes; {cpu_model()}, {os.cpu_count()} CPUs, torch "
                  f"{torch.__version__}; ranks {pinned}, {torch.get_num_threads()} intra-op "
                  f"thread(s) each", flush=True)

        plan_info = limit.plan_info(groups["flagos_shm"]) if "flagos_shm" in groups else None
        if rank == 0 and plan_info:
            print(f"flagos_shm plan ({plan_info['source']}): {plan_info['text']}", flush=True)
        overhead = None
        if "flagos_shm" in groups:
            overhead = measure_overhead(groups["flagos_shm"], ctrl, plan, rank, device)
        rounds: List[Tuple[list, list, list, list]] = []
        for rnd in range(plan.rounds):
            round_rows = _measure_round(plan, cases, copy_sizes, groups, devices, ctrl, rank, progress,
                                        skipped if rnd == 0 else None)
            if "mpi" in plan.backends and mpi_info.get("status") in (None, "ran"):
                dist.barrier(group=ctrl)  # every torch rank done with this round: MPI has the CPUs
                if rank == 0:
                    left = args.job_timeout - (time.monotonic() - started) - 5
                    mpi_results, mpi_skipped, mpi_info = run_mpi(plan, cpus, max(10.0, left), progress)
                    round_rows[2].extend(mpi_results)
                    if rnd == 0:
                        skipped += mpi_skipped
                    store.set(f"flagos_shm.bench/mpi-round-{rnd}", mpi_info["status"])
                else:
                    store.wait([f"flagos_shm.bench/mpi-round-{rnd}"], timedelta(seconds=args.job_timeout))
                    mpi_info = {"status": store.get(f"flagos_shm.bench/mpi-round-{rnd}").decode()}
            rounds.append(round_rows)
        copy_rows, xcopy_rows, results, device_copy_rows = (best_of([r[i] for r in rounds]) for i in range(4))
        dist.barrier(group=ctrl)
    except Exception:
        progress.close()
        print(f"[rank {rank}] benchmark failed:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    progress.close()
    if rank != 0:
        return 0

    if "mpi" in plan.backends:
        if mpi_info["status"] != "ran":
            notes.append(f"MPI {mpi_info['status']}: {mpi_info['reason']}")
        else:
            pages = "transparent huge pages" if mpi_info.get("hugepages") else "4 KiB pages"
            notes.append(f"MPI was measured on numpy host buffers on {pages}, as torch's CPU "
                         f"tensors are here (mpi4py, {mpi_info.get('library', '?')}); its Bcast (and other small "
                         "messages sent eagerly) may return before the peers have the data, so "
                         "per-call times can be below one synchronisation")
    if plan.rounds > 1:
        notes.append(f"{plan.rounds} rounds, the torch backends and MPI alternating; each figure is its "
                     "best round's (lowest median; 'round' in the JSON records)")
    json_path, plot_path = output_paths(args)
    doc = {
        "schema": SCHEMA,
        "tool": "flagos_shm.bench",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command_line(argv),
        "machine": machine_info() | {"cpus_allowed": len(cpus) if cpus else None},
        "config": {"world_size": world_size, "simulated_nodes": args.nodes, "ops": plan.ops,
                   "sizes_requested": plan.sizes,
                   "dtypes": plan.dtypes,
                   "backends": plan.backends + ([CPU_TWIN] if device_copy_rows else []),
                   "device": str(plan.device),
                   "bind": plan.bind, "iters": plan.iters, "warmup": plan.warmup, "rounds": plan.rounds,
                   "intra_op_threads": torch.get_num_threads(),
                   "iteration_rule": f"iters = clamp({ITER_BUDGET_BYTES} / S, {MIN_ITERS}, "
                                     f"{MAX_ITERS}) unless --iters; warmup = iters // 10 (>= 1) "
                                     "unless --warmup"},
        "definitions": {"time": TIME_DEFINITION, "bandwidth": BANDWIDTH_DEFINITION,
                        "ratio": f"other backend's median time / {REFERENCE}'s"},
        "results": results,
        "ratios": ratios(results),
        "skipped": skipped,
        "copy_baseline": copy_rows,
        "xcopy_baseline": xcopy_rows,
        "xcopy_definition": ("rank 0 writes S bytes into shared memory, rank 1 copies them into its own buffer "
                             "(1 thread, Tensor.copy_); median"),
        "multiples": limit.multiples(results, copy_rows, xcopy_rows),
        "device_copy_baseline": device_copy_rows,
        "device_copy_definition": ("every rank at once: S bytes device -> pinned host on the current stream, "
                                   "that stream synchronised, S bytes pinned host -> device; rank 0's median"),
        "staging": staging_rows(results, device_copy_rows),
        "plan": plan_info,
        "overhead": overhead,
        "mpi": mpi_info,
        "notes": notes,
        "elapsed_s": time.monotonic() - started,
    }
    report(doc, json_path, plot_path)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    plan_from_args(args)  # validate before starting ranks
    argv = list(sys.argv[1:] if argv is None else argv)
    if _launch.launched_as_rank():
        try:
            return worker(args, argv)
        finally:
            _launch.worker_teardown()
    return _launch.launch("flagos_shm.bench", argv, args.nproc, timeout_s=args.job_timeout)

