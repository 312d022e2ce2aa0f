"""Helpers for the failure tests (``test_dead_peers.py``, ``test_no_leaks.py`` and the others
that were ``test_failures.py``) and the soak run (``soak.py``).

They run inside rank processes (a ``harness.World`` pool, or the soak's workers):

* :func:`shm_group` builds a flagos_shm process group directly on a ``FileStore``
  (:func:`flagos_shm.backend.adapter.process_group`), so that its members may include
  processes outside the pool's default group (a forked *victim* that a test kills or
  stops) and it may be any subset of ranks;
* :func:`fork_rank` forks the calling rank: the child shares the parent's imported torch
  and flagos_shm (so it starts in milliseconds instead of the ~2 s of a fresh interpreter),
  runs one function and exits with ``os._exit``, never returning into the pool's loop. It
  gets SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), and the parent reaps it with
  :func:`reap`, so no child outlives a test even when the test fails;
* :func:`collective` runs one collective on a group with inputs every rank can regenerate
  and returns ``(output, expected)``;
* :func:`segment_maps`, :func:`open_fds`, :func:`rss_bytes` measure what a process holds.

Timestamps use ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process of the
machine), so a time written by one process can be compared with another's.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import time
import traceback
from datetime import timedelta
from typing import Optional

import torch
from torch._C import _distributed_c10d as c10d
import torch.distributed as dist

SEGMENT_PREFIX = "flagos_shm-"


# ---- environment, groups -------------------------------------------------------------------

@contextlib.contextmanager
def env_override(**values):
    """Set (value not None) or leave environment variables for the ``with`` body, then
    restore them (the backend reads FLAGOS_SHM_DIR / FLAGOS_SHM_SLOT_BYTES when a group is
    created)."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is not None:
                os.environ[k] = str(v)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def shm_group(store_path, rank: int, size: int, name: str, timeout_s: float,
              slot_bytes: Optional[int] = None, shm_dir: Optional[str] = None):
    """A flagos_shm process group of ``size`` ranks (this process is group rank ``rank``), meeting
    through a ``FileStore`` at ``store_path`` (one fresh path per group; or ``store_path``
    is a ``dist.Store`` to use as it is) whose waits also end after ``timeout_s`` seconds.
    ``slot_bytes`` / ``shm_dir`` override the environment; with
    ``slot_bytes`` single-copy transfers are turned off (``FLAGOS_SHM_CMA=0``), so that large
    messages take many chunk steps through the slots (a peer can die midway)."""
    from flagos_shm.backend.adapter import process_group

    store = store_path if isinstance(store_path, dist.Store) else dist.FileStore(store_path, size)
    store.set_timeout(timedelta(seconds=timeout_s))
    with env_override(FLAGOS_SHM_SLOT_BYTES=slot_bytes, FLAGOS_SHM_DIR=shm_dir,
                      FLAGOS_SHM_CMA="0" if slot_bytes else None):
        return process_group(store, rank, size, timeout=timedelta(seconds=timeout_s), group_name=name)


#: Timeout of the groups built by the failure tests (``test_dead_peers.py`` and the
#: others that were ``test_failures.py``), seconds.
TIMEOUT_S = 3.0



def signal_self(sig: str, out_dir: str, grank: int) -> None:
    """Record this process's pid and the time (``out_dir/signalled<grank>.json``), then send itself
    SIGKILL (``sig="KILL"``) or SIGSTOP (otherwise)."""
    write_json(os.path.join(out_dir, f"signalled{grank}.json"), {"at": time.monotonic(), "pid": os.getpid()})
    os.kill(os.getpid(), signal.SIGKILL if sig == "KILL" else signal.SIGSTOP)


# ---- forked ranks ----------------------------------------------------------------------------

def _set_pdeathsig() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def fork_rank(fn, *args) -> int:
    """Fork; the child runs ``fn(*args)`` and exits (0, or 1 if it raised, the traceback
    going to the parent's stderr), never returning. Returns the child's pid.

    Call only from a single-threaded process (the pool ranks are; torch runs one intra-op
    thread there)."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _set_pdeathsig()
        if os.getppid() != parent:
            os._exit(1)
        fn(*args)
        code = 0
    except BaseException:  # noqa: B902  the child must never unwind into the caller's code
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        os._exit(code)


def reap(pid: int, timeout_s: float = 5.0, cont: bool = False) -> Optional[int]:
    """Wait for child ``pid`` to exit (sending SIGCONT first if ``cont``); SIGKILL it if it
    has not exited after ``timeout_s``. Returns its wait status code as
    ``os.waitstatus_to_exitcode`` gives it (negative: killed by that signal), or None if it
    was already reaped."""
    if cont:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)


def write_json(path: str, obj) -> None:
    """Write ``obj`` as JSON atomically (rename), so a reader never sees half a file."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def read_json(path: str, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default


def error_info(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)}


def raised(call) -> Optional[str]:
    """Run ``call()``; the name of the exception type it raised, or None when it returned."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001  the caller asserts on which one
        return type(exc).__name__
    return None


def timed_outcome(call) -> tuple:
    """Run ``call()``; ``(error_info of what it raised or None, seconds it took)``."""
    t0 = time.monotonic()
    try:
        call()
        err = None
    except Exception as exc:  # noqa: BLE001  the caller asserts on which one
        err = error_info(exc)
    return err, time.monotonic() - t0


# ---- collectives ------------------------------------------------------------------------------

KINDS = ("allreduce", "allgather", "broadcast", "barrier", "reduce_scatter", "alltoall")


def steps_of(kind: str, numel: int, n: int, slot_bytes: int, itemsize: int = 4) -> int:
    """Synchronisation steps the core takes for one collective (rust/algorithms.rs)."""
    if kind == "barrier":
        return 1
    per = slot_bytes // itemsize // (n if kind in ("reduce_scatter", "alltoall") else 1)
    chunks = max(1, math.ceil(numel / per))
    two_step = kind == "allreduce" and n >= 2 and numel * itemsize > 256 * 1024
    return chunks * (2 if two_step else 1)


def rank_input(numel: int, seed: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s float32 input: small integers, so every sum is exact whatever the order."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randint(-100, 100, (numel,), generator=g, dtype=torch.int32).to(torch.float32)


def _sync(opts_type, **fields):
    """Options of ``opts_type`` for a synchronous call, as ``dist.*`` issues one with
    ``async_op=False`` (``asyncOp`` False: the call runs on the calling thread)."""
    opts = opts_type()
    for name, value in fields.items():
        setattr(opts, name, value)
    opts.asyncOp = False
    return opts


def _done(work) -> None:
    """What ``dist.*`` does with a synchronous call's result: wait unless it is None (the
    backend finished at C++ level)."""
    if work is not None:
        work.wait()


def prepare(pg, kind: str, numel: int, seed: int, root: int = 0):
    """Inputs of ``kind`` on ``pg`` (group rank ``pg.rank()``): float32 tensors of
    ``numel`` elements per rank from :func:`rank_input`. Returns ``(call, output,
    expected)``: ``call()`` runs the collective synchronously through the c10d ProcessGroup
    API, as ``dist.*`` does (``pg.<method>(..., opts)`` with ``asyncOp`` False), and leaves
    the result in ``output``; ``output`` and ``expected`` are None for barrier."""
    rank, n = pg.rank(), pg.size()
    if kind == "barrier":
        return (lambda: _done(pg.barrier(_sync(c10d.BarrierOptions)))), None, None
    if kind in ("reduce_scatter", "alltoall"):
        big = [rank_input(n * numel, seed, r) for r in range(n)]
        src = big[rank].clone()
        if kind == "reduce_scatter":
            out = torch.full((numel,), -1.0)
            return ((lambda: _done(pg._reduce_scatter_base(out, src, _sync(c10d.ReduceScatterOptions)))), out,
                    torch.stack(big).sum(0)[rank * numel:(rank + 1) * numel])
        out = torch.full((n * numel,), -1.0)
        return ((lambda: _done(pg.alltoall_base(out, src, [], [], _sync(c10d.AllToAllOptions)))), out,
                torch.cat([big[q][rank * numel:(rank + 1) * numel] for q in range(n)]))
    inputs = [rank_input(numel, seed, r) for r in range(n)]
    if kind == "allreduce":
        t = inputs[rank].clone()
        return (lambda: _done(pg.allreduce([t], _sync(c10d.AllreduceOptions)))), t, torch.stack(inputs).sum(0)
    if kind == "allgather":
        out = torch.full((n * numel,), -1.0)
        src = inputs[rank].clone()
        return (lambda: _done(pg._allgather_base(out, src, _sync(c10d.AllgatherOptions)))), out, torch.cat(inputs)
    if kind == "broadcast":
        t = inputs[rank].clone()
        return (lambda: _done(pg.broadcast([t], _sync(c10d.BroadcastOptions, rootRank=root)))), t, inputs[root]
    raise ValueError(f"kind: unknown collective {kind!r}")


def collective(pg, kind: str, numel: int, seed: int, root: int = 0):
    """:func:`prepare` and run; return ``(output, expected)``."""
    call, out, expected = prepare(pg, kind, numel, seed, root)
    call()
    return out, expected


STEP_RE = re.compile(r"#(\d+) \(step (\d+)\)")


def reported_step(message: str) -> Optional[tuple]:
    """``(sequence number, step)`` from a core error message, or None."""
    m = STEP_RE.search(message)
    return (int(m.group(1)), int(m.group(2))) if m else None


# ---- what a process holds ---------------------------------------------------------------------

def segment_maps() -> list:
    """Lines of /proc/self/maps that map a flagos_shm segment."""
    with open("/proc/self/maps") as f:
        return [line.rstrip() for line in f if SEGMENT_PREFIX in line]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def segments_in(directory: str) -> list:
    try:
        return sorted(f for f in os.listdir(directory) if f.startswith(SEGMENT_PREFIX))
    except FileNotFoundError:
        return []
