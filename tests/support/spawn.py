"""Fresh rank processes for tests that need a process without a default group (or with a
particular import order): :func:`spawn` runs a module-level function of a test file in
``world_size`` new interpreters, each rank in its own session, and collects their JSON
results. No process or segment file is left behind, whatever happens.
"""

from __future__ import annotations

import faulthandler
import glob
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

SPAWN_TIMEOUT_S = 90.0


def cache_dir_with_builds(path) -> str:
    """Make ``path`` a ``FLAGOS_SHM_CACHE_DIR`` for fresh ranks that already holds this
    session's compiled pieces (links to the c10d adapter's and the emulator's build
    directories), so that a test that gives its ranks a cache of their own (for measured
    plans) does not make each of them compile those again (about 30 s)."""
    from flagos_shm import _cxx

    os.makedirs(path, exist_ok=True)
    for name in ("flagos_shm_c10d", "flagos_shm_emulation"):
        source = os.path.join(_cxx.cache_root(), name)
        if os.path.isdir(source) and not os.path.exists(os.path.join(path, name)):
            os.symlink(source, os.path.join(path, name))
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world_size: int, env: dict | None = None, args: tuple = (),
          timeout: float = SPAWN_TIMEOUT_S, rank_env: dict | None = None, wrap: dict | None = None,
          may_die: tuple = ()) -> list:
    """Run ``fn(rank, world_size, tmpdir, *args)`` (a module-level function of a test file) in
    ``world_size`` fresh interpreters; return their JSON results, rank order.

    Each rank gets ``env`` on top of this process's environment minus FLAGOS_SHM_EMULATE*,
    env:// variables (MASTER_ADDR/PORT, RANK, WORLD_SIZE), its own FLAGOS_SHM_DIR (a fresh
    directory under /dev/shm that must be empty at the end) and a shared temporary
    directory; ``rank_env[rank]`` adds variables for one rank, ``wrap[rank]`` is a command
    prefix for it (e.g. ``nsenter ...``), and a rank in ``may_die`` may fail or be killed
    (its result is then ``None``). Ranks run in their own session and get SIGKILL if this process dies; past
    ``timeout`` seconds (counted from here, whatever their start-up took) they dump their
    stacks and are killed. No process or directory is
    left behind, whatever happens.

    Raises:
        AssertionError: a rank failed or timed out (with every rank's log, how each ended,
            the kernel's view of each rank still there at the deadline, and the machine's
            memory and load), or left a segment file.
    """
    from .harness import describe_exit, machine_state, process_state

    tmp = tempfile.mkdtemp(prefix="flagos_test_")
    shm = tempfile.mkdtemp(prefix="flagos_shm_test_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLAGOS_SHM_EMULATE")}
    base.update({"FLAGOS_SHM_DIR": shm, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world_size), "PYTHONFAULTHANDLER": "1"})
    base.update(env or {})
    procs, logs = [], [os.path.join(tmp, f"rank{r}.log") for r in range(world_size)]
    try:
        for rank in range(world_size):
            with open(logs[rank], "wb") as log:
                procs.append(subprocess.Popen(
                    list((wrap or {}).get(rank, [])) + [
                        sys.executable, os.path.abspath(__file__), "--child", sys.modules[fn.__module__].__file__,
                        fn.__name__, str(rank), str(world_size), tmp, json.dumps(list(args)),
                        str(time.monotonic() + timeout)],
                    env={**base, **(rank_env or {}).get(rank, {}), "RANK": str(rank)}, stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout + 10  # the ranks dump their stacks at `timeout`
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        codes = [p.poll() for p in procs]
        # Processes still there at the deadline: what the kernel says they were doing (a
        # stopped or swapping process cannot dump its own stack) and how loaded the machine was.
        hung = {r: process_state(p.pid) for r, p in enumerate(procs) if codes[r] is None}
        machine = machine_state() if hung else ""
        results = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"result{rank}.json")
            results.append(json.load(open(path)) if os.path.exists(path) else None)
        bad = [r for r in range(world_size) if (codes[r] != 0 or results[r] is None) and r not in may_die]
        if bad:
            ends = [f"{hung[r]} at the deadline" if r in hung else describe_exit(codes[r]) for r in range(world_size)]
            report = "".join(f"\n--- rank {r} ({ends[r]}) ---\n{open(logs[r], errors='replace').read()[-6000:]}"
                             for r in range(world_size))
            raise AssertionError(f"{fn.__name__} failed in {world_size} fresh rank(s) "
                                 f"({machine or machine_state()}):{report}")
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the rank's own session
                proc.wait()
        left = glob.glob(os.path.join(shm, "*"))
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        if left:
            raise AssertionError(f"segment files left behind: {left}")


def start_together(tmp: str, rank: int, world_size: int, timeout_s: float = SPAWN_TIMEOUT_S) -> None:
    """In a spawned rank: wait until all ``world_size`` ranks have got here (a file each in
    their shared directory ``tmp``), at most ``timeout_s`` seconds (TimeoutError).

    For times measured from here on that must leave out the ranks' start-up: importing
    torch takes seconds, and tens on a loaded machine, so fresh ranks get going far apart,
    and a rank that starts its clock at once counts the wait for its slowest peer
    (issue 27)."""
    open(os.path.join(tmp, f"started{rank}"), "w").close()
    end = time.monotonic() + timeout_s
    while not all(os.path.exists(os.path.join(tmp, f"started{r}")) for r in range(world_size)):
        if time.monotonic() > end:
            raise TimeoutError(f"rank {rank}: the other ranks did not start within {timeout_s} s")
        time.sleep(0.01)


def _child_main(argv: list) -> int:
    module_file, name, rank, world_size, tmp, args, deadline = argv
    # The stack dump is armed first, for the parent's deadline (CLOCK_MONOTONIC is one clock
    # for every process of the machine), before torch is imported: armed after the import,
    # with the whole timeout, it fired after the parent had already killed a rank whose
    # import took over 10 s on a loaded machine, and a hung rank left an empty log.
    faulthandler.dump_traceback_later(max(1.0, float(deadline) - time.monotonic()), exit=True)
    import torch

    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            return 1
    except Exception:
        pass
    torch.set_num_threads(1)
    try:
        spec = importlib.util.spec_from_file_location("_spawned_test_module", module_file)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(module_file))
        spec.loader.exec_module(module)
        result = getattr(module, name)(int(rank), int(world_size), tmp, *json.loads(args))
    except BaseException:
        traceback.print_exc()
        return 1
    with open(os.path.join(tmp, f"result{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(tmp, f"result{rank}.json.tmp"), os.path.join(tmp, f"result{rank}.json"))
    return 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--child":
    sys.exit(_child_main(sys.argv[2:]))
