"""A pool of long-lived rank processes for multi-process tests.

Starting a rank costs about 2 s (``import torch`` plus the process-group rendezvous), so
the test suite starts the ranks of each world size once and reuses them:

    world = World(world_size=2, backend="flagos_shm")
    results = world.run(fn, *args)      # fn(*args) on every rank -> [result of rank 0, ...]
    world.close()

Each rank is a separate ``python tests/support/harness.py`` process. It sets its environment
(``FLAGOS_SHM_DIR``, optional ``FLAGOS_SHM_SLOT_BYTES``, one intra-op thread), imports
``flagos_shm`` when the backend needs it, joins the default process group with
``dist.init_process_group(backend, store=FileStore(...), rank, world_size, timeout)`` and
then executes calls sent over a socket pair: the module-qualified name of a function
(``fn.__module__`` / ``fn.__qualname__``, imported in the rank from the module's file) and
pickled arguments. The rank answers with the pickled return value or the formatted
exception. Pickling uses the plain :mod:`pickle` module, never torch.multiprocessing's
shared-memory reducers, so results never leave files in ``/dev/shm``.

Failure handling:

* every call has a deadline (``timeout`` seconds, default :data:`DEFAULT_CALL_TIMEOUT_S`);
  past it the ranks dump their Python stacks into their logs (``faulthandler`` on SIGUSR1),
  the pool is killed and :class:`WorldTimeout` is raised with every rank's log tail, the
  state of each silent rank's process (running, sleeping in the kernel, stopped) and the
  machine's free memory and load;
* a rank that exited, during a call or while the pool was idle between calls, makes the
  next call raise :class:`WorldDied` naming its exit code or the signal that killed it,
  with every rank's log (never a bare ``BrokenPipeError`` from the send);
* a rank that raises makes :meth:`World.run` raise :class:`RankError` with every failing
  rank's traceback, after a short health check (barrier + all_reduce) of the pool; a pool
  that fails it, or whose rank died, is killed;
* :meth:`World.close` asks each rank to ``destroy_process_group`` and exit, and
  terminates, kills and reaps any rank that does not within a grace period; any
  ``BaseException`` in the parent while a call is in flight (KeyboardInterrupt,
  pytest-timeout's failure) kills the pool before propagating. Ranks run in their own
  session (a terminal's Ctrl-C reaches only the parent, which then tears them down) and
  have ``PR_SET_PDEATHSIG`` = SIGKILL, so they die with the parent even if it is killed.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Callable, Optional

__all__ = ["World", "RankError", "WorldTimeout", "WorldDied", "DEFAULT_CALL_TIMEOUT_S", "describe_exit",
           "machine_state", "process_state"]

#: Default deadline of one ``World.run`` call, seconds.
DEFAULT_CALL_TIMEOUT_S = 90.0
#: The process group's own timeout (``init_process_group(timeout=...)``), seconds. Shorter
#: than the call deadline so that a backend that detects a stuck peer reports it first.
DEFAULT_GROUP_TIMEOUT_S = 45.0
#: Deadline for starting the ranks (import torch, rendezvous), seconds.
START_TIMEOUT_S = 120.0
#: How long ``close`` waits for a graceful exit before terminating, seconds.
CLOSE_GRACE_S = 20.0
LOG_TAIL_CHARS = 6000

#: Name prefixes of a world's directories (followed by the creating pid): its private
#: segment directory under /dev/shm and its temporary directory (store, rank logs).
SHM_DIR_PREFIX = "flagos_shm_tests_"
TMP_PREFIX = "flagos_shm_world_"

_LIVE_WORLDS: "weakref.WeakSet[World]" = weakref.WeakSet()


def _shm_base() -> Optional[str]:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def remove_stale_dirs() -> None:
    """Remove directories left by test runs that were killed (SIGKILL leaves no chance to
    clean up): those whose creating pid no longer exists. A segment directory is removed
    only if empty, so a leaked segment stays visible."""
    import shutil

    for base, prefix, empty_only in ((_shm_base(), SHM_DIR_PREFIX, True),
                                     (tempfile.gettempdir(), TMP_PREFIX, False)):
        if base is None:
            continue
        for name in os.listdir(base):
            if not name.startswith(prefix):
                continue
            pid = name[len(prefix):].split("_", 1)[0]
            if not pid.isdigit() or int(pid) == os.getpid() or os.path.exists(f"/proc/{pid}"):
                continue
            path = os.path.join(base, name)
            if empty_only:
                try:
                    os.rmdir(path)
                except OSError:
                    pass
            else:
                shutil.rmtree(path, ignore_errors=True)


def describe_exit(code: Optional[int]) -> str:
    """A child's ``Popen.returncode`` in words: still running, exit code, or the signal
    that killed it (SIGKILL from nobody in the suite usually means the kernel's OOM killer:
    see ``dmesg``)."""
    if code is None:
        return "is still running"
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = " (not sent by the harness before this report: the kernel's OOM killer? see dmesg)" \
        if -code == signal.SIGKILL else ""
    return f"was killed by {name}{hint}"


def machine_state() -> str:
    """The machine's available memory and load, for reports of ranks that died or hung."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        mem = (f"MemAvailable {int(info['MemAvailable'].split()[0]) >> 10} MiB of "
               f"{int(info['MemTotal'].split()[0]) >> 10} MiB")
    except (OSError, KeyError, ValueError):
        mem = "memory unknown"
    try:
        load = "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "load unknown"
    return f"machine: {mem}, {load}, {os.cpu_count()} CPUs"


def process_state(pid: int) -> str:
    """A live process's state for a hang report: its state letter (R running, S sleeping,
    D uninterruptible, T stopped, Z zombie), kernel wait channel and resident memory."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip() or "-"
    except OSError as exc:
        return f"pid {pid}: unreadable ({exc})"
    return (f"pid {pid}: state {status.get('State', '?')}, wchan {wchan}, "
            f"VmRSS {status.get('VmRSS', '?').strip()}, threads {status.get('Threads', '?')}")


class RankError(AssertionError):
    """One or more ranks raised inside a call; the message holds all their tracebacks."""


class WorldTimeout(RuntimeError):
    """A call (or the start) did not finish within its deadline; the pool was killed."""


class WorldDied(RuntimeError):
    """A rank process exited during a call; the pool was killed."""


def _tail(path: str, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars))
            return f.read().decode(errors="replace")
    except OSError as exc:
        return f"<log unreadable: {exc}>"


class World:
    """``world_size`` rank processes joined in one default process group of ``backend``.

    Args:
        world_size: number of ranks (1..4 on the CI machine).
        backend: the ``init_process_group`` backend ("flagos_shm", or "gloo" to compare).
        env: extra environment variables of the ranks (e.g. ``FLAGOS_SHM_SLOT_BYTES``).
        shm_dir: the ranks' ``FLAGOS_SHM_DIR`` (segment directory); when None a fresh
            directory under /dev/shm, which :meth:`remove_files` removes after :meth:`close`.
        group_timeout_s: the process group's timeout in seconds.
        call_timeout_s: default deadline of :meth:`run` in seconds.

    Raises:
        WorldTimeout / RankError: a rank did not start in time, or failed to initialise
            (the message holds the rank logs); no process is left behind.
    """

    def __init__(self, world_size: int, backend: str, env: Optional[dict] = None,
                 shm_dir: Optional[str] = None, group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                 call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S):
        if world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.env = dict(env or {})
        self.call_timeout_s = call_timeout_s
        remove_stale_dirs()
        self.tmpdir = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}_")
        self._own_shm_dir = shm_dir is None
        if shm_dir is None:
            shm_dir = tempfile.mkdtemp(prefix=f"{SHM_DIR_PREFIX}{os.getpid()}_", dir=_shm_base())
        self.shm_dir = shm_dir
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.logs = [os.path.join(self.tmpdir, f"rank{r}.log") for r in range(world_size)]
        self.alive = False
        self.calls = 0
        _LIVE_WORLDS.add(self)
        try:
            self._start(group_timeout_s)
        except BaseException:
            self.close(graceful=False)
            self.remove_files()
            raise

    # ---- lifetime -------------------------------------------------------------------------

    def _start(self, group_timeout_s: float) -> None:
        store_path = os.path.join(self.tmpdir, "store")
        env = dict(os.environ)
        env.update({"FLAGOS_SHM_DIR": self.shm_dir, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})
        env.update({k: str(v) for k, v in self.env.items()})
        for rank in range(self.world_size):
            parent_sock, child_sock = socket.socketpair()
            try:
                with open(self.logs[rank], "wb") as log:
                    proc = subprocess.Popen(
                        [sys.executable, os.path.abspath(__file__), "--worker", str(rank), str(self.world_size),
                         self.backend, store_path, str(child_sock.fileno()), str(group_timeout_s)],
                        env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        pass_fds=(child_sock.fileno(),), start_new_session=True)
            except BaseException:
                parent_sock.close()
                raise
            finally:
                child_sock.close()
            self.procs.append(proc)
            self.conns.append(Connection(parent_sock.detach()))
        self.alive = True
        answers = self._collect(START_TIMEOUT_S, "start")
        bad = [(r, a) for r, a in enumerate(answers) if a[0] != "ready"]
        if bad:
            self.close(graceful=False)
            raise RankError(f"{self.backend} world of {self.world_size} failed to start:\n"
                            + "\n".join(self._format_error(r, a) for r, a in bad) + self._log_report())

    def close(self, graceful: bool = True) -> None:
        """Stop every rank and reap it; idempotent.

        graceful: ask each rank to ``destroy_process_group`` and exit (waiting
        :data:`CLOSE_GRACE_S`), then terminate/kill whatever is left. Otherwise kill at once.
        """
        if graceful and self.alive:
            for conn in self.conns:
                try:
                    conn.send_bytes(pickle.dumps(("stop",)))
                except OSError:
                    pass
            deadline = time.monotonic() + CLOSE_GRACE_S
            for proc in self.procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self.alive = False
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.conns = []
        _LIVE_WORLDS.discard(self)

    def remove_files(self) -> list:
        """Remove the world's temporary directories (after :meth:`close`); return the
        names that were still in its segment directory (should be none)."""
        left = []
        if self._own_shm_dir and os.path.isdir(self.shm_dir):
            left = sorted(os.listdir(self.shm_dir))
            for name in left:
                try:
                    os.unlink(os.path.join(self.shm_dir, name))
                except OSError:
                    pass
            os.rmdir(self.shm_dir)
        import shutil

        shutil.rmtree(self.tmpdir, ignore_errors=True)
        return left

    @property
    def pids(self) -> list:
        return [p.pid for p in self.procs]

    def exit_codes(self) -> list:
        return [p.poll() for p in self.procs]

    # ---- calls ----------------------------------------------------------------------------

    def run(self, fn: Callable, *args, timeout: Optional[float] = None, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return the list of per-rank results.

        ``fn`` must be a module-level function of an importable module (a test module is
        fine); arguments and results must be picklable.

        Raises:
            RankError: a rank raised (all ranks' tracebacks in the message).
            WorldTimeout: the call took longer than ``timeout`` s; the pool was killed.
            WorldDied: a rank process exited; the pool was killed.
        """
        answers = self.run_raw(fn, *args, timeout=timeout, **kwargs)
        bad = [(r, a) for r, a in enumerate(answers) if a[0] != "ok"]
        if bad:
            healthy = self.check_health()
            raise RankError(f"{fn.__qualname__} failed on rank(s) {[r for r, _ in bad]} of "
                            f"{self.backend} world size {self.world_size}"
                            f"{'' if healthy else ' (pool killed: it failed the health check)'}:\n"
                            + "\n".join(self._format_error(r, a) for r, a in bad))
        return [a[1] for a in answers]

    def run_raw(self, fn: Callable, *args, timeout: Optional[float] = None, **kwargs) -> list:
        """Like :meth:`run` but return each rank's answer as ``("ok", value)`` or
        ``("err", type name, message, traceback text)`` without raising for rank errors."""
        if not self.alive:
            raise RuntimeError(f"world of {self.world_size} ({self.backend}) is closed")
        module = sys.modules[fn.__module__]
        message = pickle.dumps(("call", fn.__module__, getattr(module, "__file__", None), fn.__qualname__,
                                args, kwargs))
        self.calls += 1
        what = fn.__qualname__
        try:
            # A rank that died while the pool was idle (between calls) is reported as such,
            # with its exit status and log, instead of as a broken pipe on the send.
            self._raise_if_dead(f"{what}: before the call")
            for rank, conn in enumerate(self.conns):
                try:
                    conn.send_bytes(message)
                except OSError as exc:  # the rank closed its end: it exited
                    self._raise_if_dead(f"{what}: sending the call ({type(exc).__name__})", rank)
                    raise
            return self._collect(self.call_timeout_s if timeout is None else timeout, what)
        except BaseException:
            if self.alive:  # interrupted (Ctrl-C, pytest-timeout) or the pipe broke
                self.close(graceful=False)
            raise

    def dead_ranks(self) -> list:
        """The ranks whose processes have exited, as ``(rank, returncode)``."""
        return [(r, p.poll()) for r, p in enumerate(self.procs) if p.poll() is not None]

    def death_report(self) -> str:
        """Why and how each exited rank ended (:func:`describe_exit`), the machine's memory
        and load, and every rank's log tail; empty if every rank is alive."""
        dead = self.dead_ranks()
        if not dead:
            return ""
        lines = [f"rank {r} (pid {self.procs[r].pid}) {describe_exit(code)}" for r, code in dead]
        return "; ".join(lines) + f"\n{machine_state()}" + self._log_report()

    def _raise_if_dead(self, what: str, rank: Optional[int] = None) -> None:
        """Raise :class:`WorldDied` (killing the pool) if a rank has exited (``rank``: the
        one whose pipe broke, waited for briefly)."""
        if rank is not None:
            try:
                self.procs[rank].wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
        report = self.death_report()
        if report:
            self.close(graceful=False)
            raise WorldDied(f"{what}: a rank of {self.backend} world size {self.world_size} had exited: "
                            f"{report}") from None

    def _collect(self, timeout: float, what: str) -> list:
        deadline = time.monotonic() + timeout
        answers: list = [None] * self.world_size
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                missing = sorted(pending.values())
                states = "\n".join(f"rank {r}: {process_state(self.procs[r].pid)}" for r in missing
                                   if self.procs[r].poll() is None)
                self._dump_stacks()
                self.close(graceful=False)
                raise WorldTimeout(f"{what}: rank(s) {missing} of {self.backend} world size {self.world_size} "
                                   f"did not answer within {timeout:.0f} s; the pool was killed\n{states}\n"
                                   f"{machine_state()}" + self._log_report())
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    answers[rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    # Give the other ranks a moment to report (or fail) before killing.
                    time.sleep(1.0)
                    code = self.procs[rank].poll()
                    state = machine_state()
                    self.close(graceful=False)
                    raise WorldDied(f"{what}: rank {rank} of {self.backend} world size {self.world_size} "
                                    f"{describe_exit(code)}; the pool was killed\n{state}"
                                    + self._log_report()) from None
        return answers

    def check_health(self) -> bool:
        """A barrier and a small all_reduce must still work; otherwise kill the pool (the
        session then starts a fresh one). Returns whether the pool is healthy. Run after
        every failed call, and by tests that deliberately disturb the group."""
        if not self.alive:
            return False
        try:
            answers = self.run_raw(_health_probe, timeout=30.0)
        except (WorldTimeout, WorldDied):
            return False
        if all(a[0] == "ok" and a[1] for a in answers):
            return True
        self.close(graceful=False)
        return False

    def _dump_stacks(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(0.5)

    def _format_error(self, rank: int, answer) -> str:
        if answer is None:
            return f"--- rank {rank}: no answer"
        if answer[0] == "err":
            return f"--- rank {rank}: {answer[1]}: {answer[2]}\n{answer[3]}"
        return f"--- rank {rank}: unexpected answer {answer!r:.300}"

    def _log_report(self) -> str:
        return "".join(f"\n--- rank {r} log (tail) ---\n{_tail(path)}" for r, path in enumerate(self.logs))

    def __repr__(self) -> str:
        return f"World(world_size={self.world_size}, backend={self.backend!r}, env={self.env}, alive={self.alive})"


def _health_probe() -> bool:
    import torch
    import torch.distributed as dist

    dist.barrier()
    t = torch.ones(3)
    dist.all_reduce(t)
    return bool((t == dist.get_world_size()).all())


@atexit.register
def _kill_leftovers() -> None:
    for world in list(_LIVE_WORLDS):
        world.close(graceful=False)


# ---- the rank process -----------------------------------------------------------------------

def _set_pdeathsig() -> None:
    """Linux: get SIGKILL when the parent dies, so no rank outlives a killed test run."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)
    except Exception:
        pass


def _answer(conn: Connection, answer) -> None:
    try:
        data = pickle.dumps(answer)
    except Exception as exc:  # an unpicklable result is reported, not fatal
        data = pickle.dumps(("err", type(exc).__name__, f"result not picklable: {exc}", traceback.format_exc()))
    conn.send_bytes(data)


def _error_answer(exc: BaseException):
    return ("err", type(exc).__name__, str(exc), traceback.format_exc())


def _resolve(module_name: str, module_file: Optional[str], qualname: str):
    if module_file:
        # The directory that makes ``module_name`` importable: the file's own for a test
        # module (``test_x``), the one above the package for ``support.harness``.
        directory = os.path.dirname(os.path.abspath(module_file))
        for _ in range(module_name.count(".") + (os.path.basename(module_file) == "__init__.py")):
            directory = os.path.dirname(directory)
        if directory not in sys.path:
            sys.path.insert(0, directory)
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(argv: list) -> int:
    rank, world_size, backend, store_path, fd, group_timeout_s = argv
    rank, world_size, fd, group_timeout_s = int(rank), int(world_size), int(fd), float(group_timeout_s)
    _set_pdeathsig()
    import faulthandler

    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    conn = Connection(fd)
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend.startswith("flagos_shm") or "flagos_shm" in backend:
            import flagos_shm  # noqa: F401  registers the backend
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=group_timeout_s))
    except BaseException as exc:
        _answer(conn, _error_answer(exc))
        return 1
    _answer(conn, ("ready", os.getpid()))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the parent is gone
        if message[0] == "stop":
            break
        _, module_name, module_file, qualname, args, kwargs = message
        try:
            fn = _resolve(module_name, module_file, qualname)
            answer = ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # noqa: B902  report everything, including KeyboardInterrupt
            answer = _error_answer(exc)
        sys.stdout.flush()
        _answer(conn, answer)
    try:
        dist.destroy_process_group()
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2:]))
    sys.exit("usage: harness.py --worker RANK WORLD_SIZE BACKEND STORE FD GROUP_TIMEOUT_S (started by World)")
