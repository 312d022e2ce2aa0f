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

#: Bytes of the probe tensor of :func:`torch_cpu_hugepages`: twice the 2 MiB huge page of
#: x86-64, so that one whole huge page lies inside it whatever its alignment.
HUGEPAGE_PROBE_BYTES = 4 << 20


def torch_cpu_hugepages() -> bool:
    """Whether torch's CPU allocator hands out memory backed by transparent huge pages
    here: allocates and touches a ``HUGEPAGE_PROBE_BYTES`` tensor and reads the
    ``AnonHugePages`` of its mapping in ``/proc/self/smaps``.

    torch asks for huge pages only when ``THP_MEM_ALLOC_ENABLE`` is set (c10's
    ``alloc_cpu``: ``madvise(MADV_HUGEPAGE)`` on buffers of 2 MiB and more), so with the
    kernel's usual ``madvise`` policy its tensors sit on 4 KiB pages, while numpy advises
    huge pages for every large array. The MPI comparison gives its numpy buffers the same
    backing as torch's (:mod:`.mpi_rank`), so that both sides copy through the same kind of
    memory. False where ``/proc/self/smaps`` cannot be read (not Linux).
    """
    import torch

    probe = torch.ones(HUGEPAGE_PROBE_BYTES, dtype=torch.uint8)
    lo, hi = probe.data_ptr(), probe.data_ptr() + HUGEPAGE_PROBE_BYTES
    # madvise splits a mapping, so the probe may span several: sum over all it overlaps.
    huge_kib, inside = 0, False
    try:
        with open("/proc/self/smaps") as fh:
            for line in fh:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = start < hi and lo < end
                elif inside and head == "AnonHugePages:":
                    huge_kib += int(line.split()[1])
    except (OSError, ValueError):
        return False
    return huge_kib > 0


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
