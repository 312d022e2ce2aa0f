"""The per-device ``c10d.Backend`` adapter (torch >= 2.14).

torch 2.14 added a trampoline (``torch/csrc/distributed/c10d/py/PyBackend.hpp``) through
which a Python subclass of ``torch._C._distributed_c10d.Backend`` is called from C++. A
creator that returns such a backend gets it registered per device
(``pg._register_backend(device, ...)``), so flagos_shm can serve one device type of a
group while another backend serves the rest (``"cpu:gloo,flagos:flagos_shm"``), and the
torch features that ask a group for its backend of a device work: ``device_id=`` eager
init, ``dist.split_group`` (:meth:`ShmBackend.split`), ``new_group`` from a bound parent,
``_coalescing_manager(device=...)`` (:meth:`ShmBackend.start_coalescing`), and
``monitored_barrier``.

Two pitfalls of the trampoline are handled here: the ``options`` property must be
overridden (the base one re-enters itself: ``RecursionError`` in ``split_group``), and so
must ``getBackendName`` (an internal assert otherwise).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.distributed.constants import default_pg_timeout

from .. import _compat
from ..work import CoalescedWork
from .collectives import Collectives
from .process_group import BACKEND_NAME

__all__ = ["ShmBackend"]

#: Every ShmBackend not yet shut down, by id. torch keeps the C++ side of a backend alive,
#: but a C++ owner that does not also hold the Python object (``_ProcessGroupWrapper``, which
#: ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` puts around every plugin backend) lets Python free it;
#: the trampoline then finds no overrides and every call ends in c10d's "getBackendName is
#: not implemented" assert. Holding them here until shutdown keeps the overrides reachable.
_LIVE: dict = {}

if _compat.HAS_PY_BACKEND:
    class ShmBackend(Collectives, c10d.Backend):
        """flagos_shm as the c10d backend of some device types of a process group.

        Args:
            store: the group's store for this backend (private to the group).
            rank: this process's group rank.
            world_size: the group's size.
            timeout: the group's timeout (``timedelta`` or seconds).
            group_name: the c10d group name (error messages).

        Raises:
            as :class:`~flagos_shm.backend.process_group.ProcessGroupShm`.
        """

        def __init__(self, store: dist.Store, rank: int, world_size: int,
                     timeout=default_pg_timeout, group_name: str = ""):
            if not 0 <= rank < world_size:
                raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
            super().__init__(rank, world_size)
            self._setup(store, rank, world_size, timeout, group_name)
            _LIVE[id(self)] = self

        def shutdown(self) -> None:
            """As :meth:`Collectives.shutdown`; the backend may then be freed."""
            try:
                super().shutdown()
            finally:
                _LIVE.pop(id(self), None)

        _sync_returns_none = True  # see CollectiveBase: saves the work holder per synchronous call

        def getBackendName(self) -> str:
            return BACKEND_NAME

        @property
        def options(self) -> c10d.Backend.Options:
            """``Backend.Options`` naming this backend, with the group's timeout."""
            return c10d.Backend.Options(BACKEND_NAME, timedelta(seconds=self._timeout_s))

        @property
        def supports_splitting(self) -> bool:
            return True

        @property
        def supports_coalescing(self) -> bool:
            return True

        def __repr__(self) -> str:
            return f"ShmBackend(group={self._group_name!r}, rank={self._rank}, world_size={self._world_size})"

        # ---- groups made from this one --------------------------------------------------

        def split(self, store, ranks, opts=None):
            """The backend of a subgroup (``dist.split_group``, ``ProcessGroup.split_group``).

            Args:
                store: the subgroup's store.
                ranks: the subgroup's ranks, as ranks of this (the parent) group.
                opts: the subgroup's ``Backend.Options`` (its timeout is used) or None.

            Returns:
                a new :class:`ShmBackend`, or ``None`` on a rank outside ``ranks``.
            """
            ranks = [int(r) for r in ranks]
            if self._rank not in ranks:
                return None
            timeout = getattr(opts, "_timeout", None) or timedelta(seconds=self._timeout_s)
            name = getattr(opts, "group_name", "") or f"{self._group_name}:split"
            return ShmBackend(store, ranks.index(self._rank), len(ranks), timeout, group_name=name)

        def eager_connect_single_device(self, device) -> None:
            """Nothing to do: the segment is attached when the backend is made."""

        # ---- coalescing (``_coalescing_manager(device=...)``) ---------------------------

        def start_coalescing(self) -> None:
            """Collect the works of the following calls until :meth:`end_coalescing`.

            Raises:
                RuntimeError: already coalescing.
            """
            if self._coalesced is not None:
                raise RuntimeError(f"flagos_shm start_coalescing on group {self._group_name!r}: "
                                   "already coalescing (end_coalescing was not called)")
            self._coalesced = []

        def end_coalescing(self) -> CoalescedWork:
            """The work of every call since :meth:`start_coalescing`.

            Raises:
                RuntimeError: not coalescing.
            """
            works, self._coalesced = self._coalesced, None
            if works is None:
                raise RuntimeError(f"flagos_shm end_coalescing on group {self._group_name!r}: "
                                   "start_coalescing was not called")
            return CoalescedWork(works)

        def _set_sequence_number_for_group(self) -> None:
            """c10d asks for group sequence numbers; flagos_shm keeps its own in the core."""

        def _get_sequence_number_for_group(self) -> int:
            """The number of collectives this rank has issued on the group (the core's count).

            c10d's ``_ProcessGroupWrapper`` (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) compares it
            across ranks before each collective, as it does Gloo's."""
            return int(self._comm.seq)
else:  # torch < 2.14: no Python Backend
    ShmBackend = None  # type: ignore[assignment,misc]

