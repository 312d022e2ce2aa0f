"""flagos_shm: a shared-memory c10d backend for the ranks of one node.

Importing the package registers the ``"flagos_shm"`` backend with ``torch.distributed``::

    import torch.distributed as dist
    import flagos_shm  # noqa: F401  (registers the backend)

    dist.init_process_group("flagos_shm", rank=rank, world_size=world_size, init_method=...)
    dist.all_reduce(tensor)

Every process group created with this backend (the default group or ``dist.new_group(...,
backend="flagos_shm")``) gets its own shared-memory segment, created in ``FLAGOS_SHM_DIR``
(default ``/dev/shm``) with ``FLAGOS_SHM_SLOT_BYTES`` bytes per chunk slot (default
``_core.DEFAULT_SLOT_BYTES``) and unlinked once all ranks have attached.
"""

from __future__ import annotations

from importlib import metadata as _metadata

import torch.distributed as _dist

from . import _core  # noqa: F401  (fail at import time when the extension is missing)
from .backend import BACKEND_NAME, ProcessGroupShm, create_process_group
from .work import ShmWork

__all__ = ["__version__", "BACKEND_NAME", "DEVICES", "ProcessGroupShm", "ShmWork", "register"]

try:
    __version__ = _metadata.version("flagos_shm")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

#: Device types whose tensors this backend accepts; ``register_backend`` maps each of them
#: to flagos_shm where no other backend claims it yet ("cpu" stays with gloo by default).
#: Accelerators (e.g. "flagos") join this list once device tensors are staged through
#: pinned host memory.
DEVICES: list[str] = ["cpu"]


def register() -> None:
    """Register (again) the ``"flagos_shm"`` backend with ``torch.distributed``.

    Called on import; calling it again, or re-importing the package, only refreshes the
    registration.
    """
    _dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True, devices=list(DEVICES))


register()
