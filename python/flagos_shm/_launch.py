"""Start N local rank processes the way ``torchrun`` does, and clean them up.

Shared by :mod:`flagos_shm.demo` and :mod:`flagos_shm.bench` (private module).

Launcher side (:func:`launch`): the parent process hosts the rendezvous
``TCPStore`` on ``127.0.0.1`` with an OS-chosen port (port 0, so there is no
race for a "free" port), then starts ``python -m <module> <argv>`` once per rank
with the environment ``torchrun`` sets: ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``TORCHELASTIC_USE_AGENT_STORE=True`` (every rank connects to the parent's store
as a client, exactly as with torchrun's agent store). The children therefore run
the same code path as under ``torchrun``.

Clean-up guarantees:

* the first rank that exits with a non-zero status makes the launcher stop
  the others (SIGTERM, then SIGKILL after a grace period) and return that
  status;
* Ctrl-C (SIGINT) and SIGTERM sent to the launcher stop every child the same
  way before the launcher exits;
* a wall-clock limit (``timeout_s``) stops a job that hangs;
* every child asks the kernel to SIGKILL it when the launcher dies
  (``prctl(PR_SET_PDEATHSIG)``, Linux), so even ``kill -9`` of the launcher
  leaves no orphan behind.

Worker side (:func:`worker_setup`, :func:`rendezvous`): called first thing in a
rank process, whether it was started by :func:`launch` or by ``torchrun``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import List, Sequence, Tuple

#: Environment variables whose presence means "this process is one rank of a
#: job started by torchrun (or by :func:`launch`)".
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

# Set by launch() in its children: the launcher's pid, checked after
# PR_SET_PDEATHSIG to close the race where the launcher died before the call.
_PARENT_PID_ENV = "FLAGOS_SHM_LAUNCHER_PID"

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def launched_as_rank() -> bool:
    """True when RANK, WORLD_SIZE and LOCAL_RANK are all set (torchrun or :func:`launch`)."""
    return all(name in os.environ for name in RANK_ENV)


def _exit_status(returncode: int) -> int:
    """Map a ``Popen.returncode`` (negative for "killed by signal N") to a shell status."""
    return 128 - returncode if returncode < 0 else returncode


def _stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every live child, wait up to ``grace_s`` seconds, then SIGKILL and reap."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            p.terminate()
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in live:
        if p.poll() is None:
            try:
                p.kill()
            except ProcessLookupError:
                pass
            p.wait()


class _Terminated(BaseException):
    """Raised in the launcher by its SIGTERM handler."""


def launch(module: str, argv: Sequence[str], nproc: int, timeout_s: float,
           grace_s: float = 5.0) -> int:
    """Run ``python -m module *argv`` as ``nproc`` ranks on this machine.

    Args:
        module: the module each rank runs (it must call :func:`worker_setup`).
        argv: its command-line arguments (the same for every rank).
        nproc: world size, >= 1.
        timeout_s: wall-clock limit for the whole job, seconds (> 0); on expiry
            every rank is stopped and 124 is returned.
        grace_s: seconds between SIGTERM and SIGKILL when stopping ranks.

    Returns:
        0 when every rank exited with 0; otherwise the status of the first rank
        seen failing (128+N for "killed by signal N"), 124 on timeout, 130
        after Ctrl-C, 143 after SIGTERM.

    Raises:
        ValueError: ``nproc`` < 1 or ``timeout_s`` <= 0.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    from torch.distributed import TCPStore  # imported late: torch import takes ~1.5 s

    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout_s),
                     wait_for_workers=False)
    base_env = dict(os.environ)
    base_env.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        _PARENT_PID_ENV: str(os.getpid()),
    })
    # Same default as torchrun: do not oversubscribe the cores with intra-op threads.
    base_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))

    def on_sigterm(signum, frame):
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    procs: List[subprocess.Popen] = []
    try:
        for rank in range(nproc):
            env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=env))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            for rank, code in enumerate(codes):
                if code not in (None, 0):
                    if len(procs) > 1:
                        print(f"[launcher] rank {rank} exited with status "
                              f"{_exit_status(code)}; stopping the other ranks",
                              file=sys.stderr, flush=True)
                    return _exit_status(code)
            if all(code == 0 for code in codes):
                return 0
            if time.monotonic() > deadline:
                print(f"[launcher] job exceeded its {timeout_s:g} s limit; stopping all ranks",
                      file=sys.stderr, flush=True)
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        print("[launcher] interrupted; stopping all ranks", file=sys.stderr, flush=True)
        return 130
    except _Terminated:
        print("[launcher] SIGTERM; stopping all ranks", file=sys.stderr, flush=True)
        return 143
    finally:
        _stop(procs, grace_s)
        signal.signal(signal.SIGTERM, previous)
        del store


def worker_setup() -> None:
    """Prepare a rank process: die with the launcher, and exit cleanly on SIGTERM.

    Call it first in a rank's entry point. SIGTERM (sent by :func:`launch` and by
    torchrun when a sibling failed) raises ``SystemExit(143)`` so ``finally``
    blocks and atexit handlers run. Under :func:`launch`, the process also asks
    the kernel for SIGKILL when the launcher dies (Linux ``PR_SET_PDEATHSIG``).
    """
    def on_sigterm(signum, frame):
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    parent = os.environ.get(_PARENT_PID_ENV)
    if parent is not None and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != int(parent):  # the launcher died before prctl took effect
            os._exit(1)


def worker_teardown() -> None:
    """Once the rank's work is done (its function has returned, its process groups
    destroyed): free what still holds a process group, and restore the default SIGTERM
    action.

    * A process group that ``destroy_process_group`` let go of lives on while something
      references it: a reference cycle that holds a frame of the rank's stack (an exception
      kept with its traceback) holds its locals until the next full collection, often the
      interpreter's last. A Gloo group keeps its worker threads until it is freed, and such
      a thread that drops the last reference to a finished work (a barrier holds the works
      before it, whose tensors were made in Python) takes the GIL to free them: one that
      does so while the interpreter finalizes aborts the process ("terminate called without
      an active exception": 2 of 45 runs of ``tests/test_bench.py``'s 3-rank run on torch
      2.10, Intel Xeon VM, 2026-12-06, where the import of ``torch.utils.cpp_extension``
      made such a cycle, see :func:`flagos_shm._cxx.include_paths`; pytorch/pytorch#190489).
      Collected here, a Gloo group joins its worker threads while Python can serve them.
    * A SIGTERM that arrives while the interpreter shuts down then ends the process
      quietly instead of raising SystemExit inside atexit handlers.
    """
    gc.collect()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def rendezvous(timeout_s: float) -> Tuple["object", int, int, int]:
    """Return ``(store, rank, world_size, local_world_size)`` from the torchrun environment.

    Uses ``torch.distributed.rendezvous("env://")`` (MASTER_ADDR, MASTER_PORT,
    RANK, WORLD_SIZE; TORCHELASTIC_USE_AGENT_STORE as torchrun sets it).

    Raises:
        RuntimeError: a required variable is missing or not an integer.
    """
    import torch.distributed as dist

    try:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    except (KeyError, ValueError) as exc:
        raise RuntimeError(f"LOCAL_WORLD_SIZE/WORLD_SIZE must be set to an integer: {exc}") from exc
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    return store, rank, world_size, local_world_size


def bind_to_cpu(local_rank: int) -> int:
    """Pin this process to one CPU of its allowed set: the ``local_rank``-th, modulo its size.

    Ranks that wait for each other run best on different cores; without pinning the
    scheduler may keep two ranks on one core for a long time. Returns the CPU number.
    Linux only (``os.sched_setaffinity``).

    Raises:
        RuntimeError: the platform has no ``os.sched_setaffinity``.
    """
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError("--bind needs os.sched_setaffinity (Linux)")
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[local_rank % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    return cpu


def default_threads(local_world_size: int) -> int:
    """Intra-op threads per rank: OMP_NUM_THREADS if set, else cores // local ranks (>= 1)."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            pass
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))
