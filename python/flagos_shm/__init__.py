"""flagos_shm: a shared-memory c10d backend for the ranks of one node.

Importing the package registers the ``"flagos_shm"`` backend with ``torch.distributed``::

    import torch.distributed as dist
    import flagos_shm  # noqa: F401  (registers the backend)

    dist.init_process_group("flagos_shm", rank=rank, world_size=world_size, init_method=...)
    dist.all_reduce(tensor)

Every process group created with this backend (the default group or ``dist.new_group(...,
backend="flagos_shm")``) gets its own shared-memory segment, created in ``FLAGOS_SHM_DIR``
(default ``/dev/shm``) with ``FLAGOS_SHM_SLOT_BYTES`` bytes per chunk slot (default 1 MiB,
``_core.DEFAULT_SLOT_BYTES``, or 256 KiB in a small ``/dev/shm``:
``_core.default_slot_bytes``) and unlinked once all ranks have attached.
"""

from __future__ import annotations

import os as _os
from importlib import metadata as _metadata

import torch.distributed as _dist

from . import _core  # noqa: F401  (fail at import time when the extension is missing)
from . import emulation  # noqa: F401  (flagos_shm.emulation.enable() after import flagos_shm)
from .backend import BACKEND_NAME, ProcessGroupShm, ShmBackend, create_backend, uses_backend_route
from .backend import device_map as _device_map
from .backend import process_group as _process_group
from .work import ShmWork

__all__ = ["__version__", "BACKEND_NAME", "DEVICES", "ENV_EMULATE", "ProcessGroupShm", "ShmBackend", "ShmWork",
           "register"]

try:
    __version__ = _metadata.version("flagos_shm")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

#: Device types registered for this backend. ``init_process_group()`` with no backend name
#: on a machine whose accelerator is ``flagos`` (and ``init_device_mesh("flagos", ...)``)
#: picks flagos_shm; ``backend="flagos_shm"`` serves CPU and flagos tensors in one group
#: (on torch >= 2.14 also CUDA and the PrivateUse1 device under any name:
#: :mod:`flagos_shm.backend.device_map`).
DEVICES: list[str] = ["cpu", "flagos"]

#: Environment variable: "1" makes ``import flagos_shm`` enable the emulated flagos device
#: (:func:`flagos_shm.emulation.enable`) when no real one is registered.
ENV_EMULATE = "FLAGOS_SHM_EMULATE"


def register() -> None:
    """Register the ``"flagos_shm"`` backend with ``torch.distributed``.

    Called on import. Idempotent: a second call (or re-importing the package) keeps the
    first registration and only re-asserts the device defaults. ``register_backend`` fills
    only missing ``device -> backend`` defaults, so the ``flagos`` default is set explicitly:
    whether a vendor plugin (torch_fl) or the emulator is imported before or after
    flagos_shm, ``flagos`` maps to flagos_shm (a plugin imported later that remaps it on
    purpose wins). ``cpu`` stays with gloo.

    On torch >= 2.14 (the per-device route, :func:`flagos_shm.backend.uses_backend_route`)
    it also adjusts torch's ``BackendConfig`` (:mod:`flagos_shm.backend.device_map`):
    ``backend="gloo"`` groups then serve the PrivateUse1 device through flagos_shm unless
    ``FLAGOS_SHM_EXTEND_GLOO=0``. On every torch, ``dist.monitored_barrier`` is let through
    for ``ProcessGroupShm`` groups (:func:`flagos_shm.backend.process_group.install_monitored_barrier`).

    Raises:
        ValueError: ``FLAGOS_SHM_ROUTE`` is invalid for this torch.
    """
    if BACKEND_NAME.upper() not in _dist.Backend._plugins:
        _dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True,
                                       devices=list(DEVICES))
    for device in DEVICES:
        if device != "cpu":
            _dist.Backend.default_device_backend_map[device] = BACKEND_NAME
    if uses_backend_route():
        _device_map.install(BACKEND_NAME)
    _process_group.install_monitored_barrier()


register()

if _os.environ.get(ENV_EMULATE, "").strip() in ("1", "true", "yes"):
    emulation.enable()
