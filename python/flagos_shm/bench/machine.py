"""The rank's device and what the report says about the machine and the command."""

from __future__ import annotations

import os
import platform
import shlex
import socket
import sys
from typing import Sequence


def setup_device(kind: str, local_rank: int):
    """The torch device of flagos_shm's tensors: ``cpu``, or ``flagos:<local_rank>`` (enables
    the emulated device when no flagos device is registered).

    Raises:
        RuntimeError: flagos requested but fewer flagos devices than local ranks.
    """
    import torch

    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, "flagos", None)
    if module is None or not module.is_available():
        from .. import emulation

        emulation.enable()
        module = torch.flagos
    count = module.device_count()
    if local_rank >= count:
        raise RuntimeError(f"--device flagos: local rank {local_rank} needs flagos:{local_rank} "
                           f"but only {count} flagos device(s) exist")
    module.set_device(local_rank)
    return torch.device("flagos", local_rank)


# --------------------------------------------------------------------------- machine info

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import torch

    import flagos_shm

    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "cpus_allowed": allowed,
            "machine": platform.machine(), "system": platform.platform(),
            "hostname": socket.gethostname(), "python": platform.python_version(),
            "torch": torch.__version__, "flagos_shm": flagos_shm.__version__}


def command_line(argv: Sequence[str]) -> str:
    return shlex.join([os.path.basename(sys.executable), "-m", "flagos_shm.bench", *argv])


def cpu_label(machine: dict) -> str:
    return f"{machine['cpu_model']} ({machine['cpu_count']} CPUs)"
