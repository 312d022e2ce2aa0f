"""The ``flagos_shm`` c10d backend: one collectives layer behind one c10d adapter.

* :mod:`.config`: every ``FLAGOS_SHM_*`` setting, read in one place;
* :mod:`.rendezvous`: how a group's ranks meet through the store and find the segment;
* :mod:`.options`: c10d options and argument checks;
* :mod:`.collectives`: every collective, written once;
* :mod:`.group`: :class:`ShmGroup`, one group's state on this rank, with every collective;
* :mod:`.adapter`: the c10d adapter, a C++ ``c10d::Backend`` (``csrc/c10d_adapter.cpp``,
  built against the installed torch on first use) that torch registers per device type and
  that forwards every call to the group's :class:`ShmGroup`: the same on every torch;
* :mod:`.device_map`: the device types a backend string gives flagos_shm, and
  ``backend="gloo"`` groups that also serve the PrivateUse1 device.

:func:`create_backend` is the creator ``import flagos_shm`` registers.
"""

from __future__ import annotations

from .adapter import create_backend, native, shm_part
from .config import segment_config
from .group import BACKEND_NAME, ShmGroup

__all__ = ["BACKEND_NAME", "ShmGroup", "create_backend", "native", "segment_config", "shm_part"]
