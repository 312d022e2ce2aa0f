"""One process group's flagos_shm state on this rank: :class:`ShmGroup`.

A ``ShmGroup`` is what the c10d adapter (:mod:`flagos_shm.backend.adapter`) forwards every
call of a group to: it holds the group's segment (or, for a group spanning nodes, its
hierarchical communicator), its plan and its progress thread, and has every collective
(:mod:`flagos_shm.backend.collectives`). It is a plain Python object: torch sees the C++
``ShmBackend`` that holds it (``group._get_backend(device)``), and
:func:`flagos_shm.backend.shm_part` finds it from a process group.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ..work import CoalescedWork
from .collectives import Collectives

__all__ = ["BACKEND_NAME", "ShmGroup"]

#: The name ``import flagos_shm`` registers with ``torch.distributed``.
BACKEND_NAME = "flagos_shm"


class ShmGroup(Collectives):
    """flagos_shm's part of one process group on this rank.

    Args:
        store: the group's store for this backend (private to the group; c10d passes a
            ``PrefixStore``); used to meet the other ranks.
        rank: this process's group rank, ``0 <= rank < world_size``.
        world_size: the group's size (its ranks on one node or on several).
        timeout: the group's timeout (``timedelta`` or seconds) for attaching and for each
            collective unless the call's options give another one.
        group_name: the c10d group name (error messages).
        global_ranks: the default group's rank of each group rank (c10d's
            ``global_ranks_in_group``; ``range(world_size)`` for the default group), or None
            where unknown: kept to tell later groups' set-ups who this group's ranks are.
        known_peers: group rank -> identity of the ranks whose process this process already
            knows from its other live groups (:func:`flagos_shm.backend.adapter.known_peers`),
            or None: the set-up notices at once one that exited before joining.

    Raises:
        ValueError: ``rank`` out of range, a malformed setting on this rank
            (:func:`flagos_shm.config.check_group_settings`), or a malformed or differing
            ``FLAGOS_SHM_PLAN`` on any rank.
        OSError: the segment directory is too small (on rank 0).
        RuntimeError: a peer did not attach in time, exited or gave up (a malformed setting
            there), or rank 0 failed to create the segment.
    """

    #: A synchronous call (``asyncOp`` False) that succeeded returns ``None``: c10d's "the
    #: backend synchronised at C++ level" (``dist.*`` then skips ``wait()``).
    _sync_returns_none = True

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout=default_pg_timeout,
                 group_name: str = "", global_ranks=None, known_peers=None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
        self._setup(store, rank, world_size, timeout, group_name, global_ranks, known_peers)

    def __repr__(self) -> str:
        return f"ShmGroup(group={self._group_name!r}, rank={self._rank}, world_size={self._world_size})"

    # ---- groups made from this one ------------------------------------------------------

    def split(self, store, ranks, opts=None):
        """The group of a subgroup (``dist.split_group``, ``new_group`` from a parent bound
        to a device).

        Args:
            store: the subgroup's store.
            ranks: the subgroup's ranks, as ranks of this (the parent) group.
            opts: the subgroup's ``Backend.Options`` (its timeout and group name are used),
                or None.

        Returns:
            a new :class:`ShmGroup`, or ``None`` on a rank outside ``ranks``.
        """
        ranks = [int(r) for r in ranks]
        if self._rank not in ranks:
            return None
        timeout = getattr(opts, "_timeout", None) or timedelta(seconds=self._timeout_s)
        name = getattr(opts, "group_name", "") or f"{self._group_name}:split"
        parents = self._global_ranks
        # the subgroup's ranks are this group's: their processes are known from its set-up
        return ShmGroup(store, ranks.index(self._rank), len(ranks), timeout, group_name=name,
                        global_ranks=None if parents is None else [parents[r] for r in ranks],
                        known_peers={i: self._layout.peers[r] for i, r in enumerate(ranks)})

    # ---- coalescing (``_coalescing_manager(device=...)``) -------------------------------

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

    def _get_sequence_number_for_group(self) -> int:
        """The number of collectives this rank has issued on the group (the core's count).

        c10d's ``_ProcessGroupWrapper`` (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) compares it
        across ranks before each collective, as it does Gloo's."""
        return int(self._comm.seq)
