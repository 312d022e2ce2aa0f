"""The ``flagos_shm`` c10d backend: one collectives layer behind one c10d adapter.

* :mod:`.rendezvous`: how a group's ranks meet through the store and find the segment;
* :mod:`.plan`: which algorithm each collective uses at which size, agreed at set-up;
* :mod:`.hierarchy`: groups that span nodes (shared memory inside each, Gloo between);
* :mod:`.options`: c10d options and argument checks;
* :mod:`.collectives`: every collective, written once;
* :mod:`.group`: :class:`ShmGroup`, one group's state on this rank, with every collective;
* :mod:`.adapter`: the c10d adapter, a C++ ``c10d::Backend`` (``csrc/c10d_adapter.cpp``,
  built against the installed torch on first use) that torch registers per device type and
  that forwards every call to the group's :class:`ShmGroup`: the same on every torch;
* :mod:`.device_map`: the device types a backend string gives flagos_shm, and
  ``backend="gloo"`` groups that also serve the PrivateUse1 device;
* :mod:`.torch_patches`: every change flagos_shm makes to torch, applied at import;
* :mod:`.dynamo`: keeps torch.compile from tracing flagos_shm's own Python code.

:func:`create_backend` is the creator ``import flagos_shm`` registers. Settings come from
:mod:`flagos_shm.config`.
"""

from __future__ import annotations

from .adapter import create_backend, native, shm_part
from .group import BACKEND_NAME, ShmGroup

__all__ = ["BACKEND_NAME", "ShmGroup", "create_backend", "native", "shm_part"]
