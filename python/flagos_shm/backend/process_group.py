"""The ``dist.ProcessGroup`` adapter (torch < 2.14, or ``FLAGOS_SHM_ROUTE=process_group``).

torch makes a ``ProcessGroup`` returned by a backend creator the *whole* group: it receives
tensors of every device, so this route serves CPU and device tensors alike but cannot share
a group with another backend (``"cpu:gloo,flagos:flagos_shm"`` is refused), and torch
features that ask a group for its per-device backend (``device_id=`` eager init,
``split_group``, ``monitored_barrier``, ``_coalescing_manager(device=)``) do not apply.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from .collectives import Collectives

__all__ = ["ProcessGroupShm"]

BACKEND_NAME = "flagos_shm"


class ProcessGroupShm(Collectives, dist.ProcessGroup):
    """Process group whose collectives go through one shared-memory segment of this node.

    Args:
        store: the group's store (``torch.distributed`` passes a ``PrefixStore`` private to
            the group); used to meet the other ranks.
        rank: this process's rank in the group, ``0 <= rank < world_size``.
        world_size: number of ranks in the group (all on this node).
        timeout: the group's timeout (``timedelta`` or seconds) for attaching and for each
            collective unless the call's options give another one.
        group_name: the c10d group name (error messages, ``group_name``).

    Raises:
        ValueError: bad ``FLAGOS_SHM_DIR`` / ``FLAGOS_SHM_SLOT_BYTES`` (on rank 0).
        OSError: the segment directory is too small (on rank 0).
        RuntimeError: a peer did not attach in time, or rank 0 failed to create the segment.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int,
                 timeout=default_pg_timeout, group_name: str = ""):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
        super().__init__(rank, world_size)
        self._group_desc = ""
        self._setup(store, rank, world_size, timeout, group_name)

    # ---- identity ---------------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def __repr__(self) -> str:
        return f"ProcessGroupShm(group={self._group_name!r}, rank={self._rank}, world_size={self._world_size})"

    # ---- the spellings older torch calls --------------------------------------------

    _allgather_base = Collectives.all_gather_single
    allgather_into_tensor_coalesced = Collectives.all_gather_single_coalesced
    _reduce_scatter_base = Collectives.reduce_scatter_single
    reduce_scatter_tensor_coalesced = Collectives.reduce_scatter_single_coalesced
    alltoall_base = Collectives.all_to_all_single
