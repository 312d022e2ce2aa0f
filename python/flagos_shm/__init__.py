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

import warnings as _warnings

import torch.distributed as _dist

from . import _core  # fails at import time when the extension is missing
from . import config as _config
from . import emulation  # noqa: F401  (flagos_shm.emulation.enable() after import flagos_shm)
from .backend import BACKEND_NAME, ShmGroup, create_backend
from .backend import dynamo as _dynamo
from .backend import torch_patches as _torch_patches
from .work import ShmWork

__all__ = ["__version__", "BACKEND_NAME", "DEVICES", "ENV_EMULATE", "ShmBackend", "ShmGroup", "ShmWork",
           "register"]

#: The package's version: Cargo.toml's, compiled into the core (pyproject.toml takes it from
#: there too, so the installed distribution's metadata says the same).
__version__: str = _core.__version__

#: Device types registered for this backend. ``init_process_group()`` with no backend name
#: on a machine whose accelerator is ``flagos`` (and ``init_device_mesh("flagos", ...)``)
#: picks flagos_shm; ``backend="flagos_shm"`` serves CPU, CUDA (where available) and the
#: PrivateUse1 device under any name (:mod:`flagos_shm.backend.device_map`).
DEVICES: list[str] = ["cpu", "flagos"]

#: Environment variable: ``1`` (any value but an off word: :func:`flagos_shm.config.parse_flag`)
#: makes ``import flagos_shm`` enable the emulated flagos device
#: (:func:`flagos_shm.emulation.enable`) when no real one is registered.
ENV_EMULATE = _config.ENV_EMULATE


def __getattr__(name: str):
    # ``flagos_shm.ShmBackend``: the C++ c10d backend class, compiled on first use.
    if name == "ShmBackend":
        from .backend import native

        return native().ShmBackend
    raise AttributeError(f"module 'flagos_shm' has no attribute {name!r}")


def register() -> None:
    """Register the ``"flagos_shm"`` backend with ``torch.distributed``.

    Called on import. Idempotent: a second call (or re-importing the package) keeps the
    first registration and only re-asserts the device defaults.

    Then it applies flagos_shm's changes to torch (each documented in
    :mod:`flagos_shm.backend.torch_patches`): ``flagos`` maps to flagos_shm whichever
    plugin registered it first (``cpu`` stays with gloo), ``backend="gloo"`` groups serve
    the PrivateUse1 device through flagos_shm unless ``FLAGOS_SHM_EXTEND_GLOO=0``, and
    ``dist.split_group`` and ``dist.monitored_barrier`` reach flagos_shm's groups where this
    torch's versions of them would not. The c10d adapter itself is compiled at the first
    group, not here.
    """
    if BACKEND_NAME.upper() not in _dist.Backend._plugins:
        _dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True,
                                       devices=list(DEVICES))
    _torch_patches.install(BACKEND_NAME, DEVICES)
    for name, why in _config.retired().items():
        _warnings.warn(f"flagos_shm: {name} is no longer read: {why}", FutureWarning, stacklevel=2)


register()

if _config.emulate():
    emulation.enable()

_dynamo.hide()  # torch.compile never traces flagos_shm's own code (backend/dynamo.py)
