"""The benchmark's command line and its plan (:mod:`flagos_shm.bench`): the flags, their
validation (SystemExit naming the flag) and :class:`Plan`, what every rank runs.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .common import (ALL_BACKENDS, DEFAULT_SIZES, DTYPES, ITER_BUDGET_BYTES, MAX_ITERS, MIN_ITERS, OPS,
                     OVERHEAD_ITERS, TORCH_BACKENDS, MiB, case_numel, parse_size)


@dataclass
class Plan:
    """What every rank runs; compared across ranks before anything is timed."""

    ops: List[str]
    sizes: List[int]
    dtypes: List[str]
    backends: List[str]          # as requested, "mpi" included
    iters: Optional[int]
    warmup: Optional[int]
    device: str                  # "cpu" or "flagos"
    bind: bool = False
    world_size: int = 0
    rounds: int = 2

    @property
    def torch_backends(self) -> List[str]:
        return [b for b in self.backends if b in TORCH_BACKENDS]

    def cases(self) -> List[Tuple[str, str, int, int]]:
        """``(op, dtype, numel, size_bytes)`` in measurement order, duplicates of S dropped
        (4 B and 16 B both become 16 B for allgather at n = 4)."""
        out = []
        for op in self.ops:
            for dtype in self.dtypes:
                seen = set()
                for requested in self.sizes:
                    numel, size = case_numel(op, requested, self.world_size, DTYPES[dtype])
                    if size not in seen:
                        seen.add(size)
                        out.append((op, dtype, numel, size))
        return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flagos_shm.bench",
        description="Time allreduce, allgather, reduce-scatter, broadcast and alltoall on "
                    "flagos_shm, gloo and (when available) MPI in one run; report median/min "
                    "time, algbw and busbw (nccl-tests definitions), the time ratio to "
                    "flagos_shm, a single-thread copy baseline and flagos_shm's per-call "
                    "overhead. See the module docstring for the method.")
    p.add_argument("--nproc", type=int, default=2,
                   help="world size: number of local ranks to start (default 2); ignored "
                        "under torchrun")
    p.add_argument("--nodes", type=int, default=1,
                   help="simulate this many nodes on this machine (FLAGOS_SHM_NODE_ID set per rank, "
                        "contiguous blocks of ranks; Gloo over loopback between them): flagos_shm runs "
                        "hierarchically, gloo flat over the same ranks (default 1)")
    p.add_argument("--ops", default=",".join(OPS),
                   help=f"comma-separated subset of {','.join(OPS)} (default: all)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated sizes S in bytes, as nccl-tests count them (the "
                        "buffer for allreduce and broadcast, the whole output for allgather, the "
                        "whole input for reduce_scatter, one rank's buffer for alltoall); binary "
                        "units allowed: 4,1K,64KiB,16M; default 4 B to 64 MiB in powers of 4")
    p.add_argument("--dtypes", default="float32",
                   help=f"comma-separated subset of {','.join(DTYPES)} (default float32)")
    p.add_argument("--backends", default=",".join(ALL_BACKENDS),
                   help=f"comma-separated subset of {','.join(ALL_BACKENDS)} (default: all; "
                        "mpi is skipped with a message when mpi4py or mpirun is missing)")
    p.add_argument("--iters", type=int, default=None,
                   help=f"timed iterations for every size (default: {ITER_BUDGET_BYTES // MiB} "
                        f"MiB / S, clamped to [{MIN_ITERS}, {MAX_ITERS}]; {OVERHEAD_ITERS} for "
                        "the 4-byte overhead measurement)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up iterations before each timed loop (default: iters / 10, >= 1)")
    p.add_argument("--device", choices=("cpu", "flagos"), default="cpu",
                   help="where flagos_shm's tensors live: cpu (default) or flagos (a real "
                        "torch_fl device, else the emulated one, enabled here); gloo and MPI "
                        "always use CPU memory")
    p.add_argument("--bind", action="store_true",
                   help="pin local rank i to the i-th allowed CPU (modulo the CPU count), MPI "
                        "ranks likewise; default: let the scheduler place the ranks")
    p.add_argument("--rounds", type=int, default=2,
                   help="measure everything this many times, the torch backends and MPI "
                        "alternating, and keep each figure's best round (lowest median); "
                        "default 2 (see flagos_shm/bench/rounds.py)")
    p.add_argument("--json", metavar="PATH", default=None, help="write all results as JSON to PATH")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="draw busbw and latency vs size (PNG) to PATH; needs matplotlib")
    p.add_argument("--out-dir", metavar="DIR", default=None,
                   help="write DIR/bench.json and DIR/bench.png (unless --json/--plot say "
                        "otherwise)")
    p.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="process-group timeout in seconds (default 120)")
    p.add_argument("--job-timeout", type=float, default=900.0,
                   help="wall-clock limit of the whole run in seconds, MPI part included "
                        "(default 900)")
    return p


def _split(text: str, allowed: Sequence[str], flag: str) -> List[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise SystemExit(f"{flag}: unknown or empty {bad or text!r}; expected a comma-separated "
                         f"subset of {','.join(allowed)}")
    return list(dict.fromkeys(items))


def plan_from_args(args) -> Plan:
    """Validate the arguments (SystemExit with a message naming the flag) and build the plan."""
    try:
        sizes = DEFAULT_SIZES if args.sizes is None else \
            [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not sizes:
        raise SystemExit("--sizes: empty list")
    for flag, low in (("iters", 1), ("warmup", 0), ("rounds", 1)):
        value = getattr(args, flag)
        if value is not None and value < low:
            raise SystemExit(f"--{flag} must be >= {low}, got {value}")
    if args.nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {args.nproc}")
    if not 1 <= args.nodes <= args.nproc:
        raise SystemExit(f"--nodes must be between 1 and --nproc ({args.nproc}), got {args.nodes}")
    if os.environ.get("RANK", "0") == "0":  # the launcher (no RANK yet) or global rank 0
        _check_writable(args)
    for flag in ("timeout", "job_timeout"):
        if not getattr(args, flag) > 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be > 0 seconds")
    return Plan(ops=_split(args.ops, OPS, "--ops"), sizes=list(dict.fromkeys(sizes)),
                dtypes=_split(args.dtypes, list(DTYPES), "--dtypes"),
                backends=_split(args.backends, ALL_BACKENDS, "--backends"),
                iters=args.iters, warmup=args.warmup, device=args.device, bind=args.bind,
                rounds=args.rounds)


def _check_writable(args) -> None:
    """Make the output files' directories and check that they can be written to, so that a
    bad path stops the run before it starts, not after it (SystemExit naming the flag).

    Only in the process that writes them, global rank 0 (the launcher checks before it
    starts the ranks): the ranks start together, and two probing one path at once could
    unlink the probe file under each other (``FileNotFoundError`` on a rank, as a CI run
    of the benchmark's tests on torch 2.10 saw)."""
    for flag, path in zip(("--json", "--plot"), output_paths(args)):
        if path is None:
            continue
        flag = "--out-dir" if args.out_dir and getattr(args, flag[2:]) is None else flag
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise SystemExit(f"{flag}: cannot create {parent}: {exc.strerror or exc}") from None
        existed = os.path.exists(path)
        try:
            with open(path, "a"):  # what writing it will do, without touching its contents
                pass
        except OSError as exc:
            raise SystemExit(f"{flag}: cannot write {path}: {exc.strerror or exc}") from None
        if not existed:
            os.unlink(path)


def output_paths(args) -> Tuple[Optional[str], Optional[str]]:
    """``(json_path, plot_path)`` from --json, --plot and --out-dir."""
    json_path, plot_path = args.json, args.plot
    if args.out_dir:
        json_path = json_path or os.path.join(args.out_dir, "bench.json")
        plot_path = plot_path or os.path.join(args.out_dir, "bench.png")
    return json_path, plot_path
