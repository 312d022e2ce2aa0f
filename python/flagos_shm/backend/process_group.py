"""The ``dist.ProcessGroup`` adapter (torch < 2.14, or ``FLAGOS_SHM_ROUTE=process_group``).

torch makes a ``ProcessGroup`` returned by a backend creator the *whole* group: it receives
tensors of every device, so this route serves CPU and device tensors alike but cannot share
a group with another backend (``"cpu:gloo,flagos:flagos_shm"`` is refused), and torch
features that ask a group for its per-device backend (``device_id=`` eager init,
``split_group``, ``_coalescing_manager(device=)``) do not apply. ``dist.monitored_barrier``
refuses such a group before calling it (torch < 2.14: the backend is not named "gloo";
later: the group has no CPU backend registered), so :func:`install_monitored_barrier`
lets it through for this adapter's groups.
"""

from __future__ import annotations

import functools
import warnings
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.constants import default_pg_timeout

from .collectives import Collectives

__all__ = ["ProcessGroupShm", "install_monitored_barrier"]

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


def install_monitored_barrier() -> None:
    """Make ``dist.monitored_barrier`` accept groups of this adapter (idempotent).

    torch's ``monitored_barrier`` refuses every group that is not Gloo's (torch < 2.14
    compares the backend's name with "gloo"; later versions require a registered CPU
    backend, which a whole-group ``ProcessGroup`` has not) before calling the group's
    ``monitored_barrier``. For a group whose default-device object is a
    :class:`ProcessGroupShm`, the replacement does what torch does after that check (the
    not-a-member warning, the default timeout, a float timeout taken as seconds, the
    timeout check) and calls :meth:`ProcessGroupShm.monitored_barrier`; every other call
    goes to torch's function unchanged. Raises what the group's ``monitored_barrier``
    raises (``RuntimeError`` naming the ranks that did not arrive).
    """
    original = c10d.monitored_barrier
    if getattr(original, "_flagos_shm", False):
        return

    @functools.wraps(original)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        pg = group if group is not None else (c10d._get_default_group() if dist.is_initialized() else None)
        if not isinstance(pg, ProcessGroupShm):
            return original(group, timeout, wait_all_ranks)
        if c10d._rank_not_in_group(group):
            c10d._warn_not_in_group("monitored_barrier")
            return None
        if timeout is None:
            timeout = c10d._get_default_timeout(dist.get_backend(group))
        elif isinstance(timeout, float):
            warnings.warn(f"Please specify timeout arg as a timedelta. Converting current value of {timeout} "
                          "assuming it represents seconds", stacklevel=2)
            timeout = timedelta(seconds=timeout)
        c10d._check_valid_timeout(timeout)
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier._flagos_shm = True
    c10d.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier
