"""Rendezvous: how the ranks of a new group find one shared-memory segment.

Group rank 0 creates the segment (``flagos_shm._core.create_segment``) and publishes its
path through the group's store; every rank publishes its process id first, so that a rank
that exits while the group is being set up is noticed within milliseconds. The
:class:`~flagos_shm.backend.collectives.Collectives` layer then attaches a
``flagos_shm._core.Communicator`` to the path.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch.distributed as dist

from .. import _core
from .config import segment_config

__all__ = ["rendezvous", "publish_pid"]

_STORE_COUNTER = "flagos_shm/rendezvous"
_STORE_ERROR = "error:"

_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.01  # store polling while a group is set up: 1 ms, backing off to 10 ms


def _store_wait(store: dist.Store, key: str, deadline: float, what: str, watch: Callable[[], dict]) -> None:
    """Wait until ``key`` is in ``store``, polling, at most until ``deadline`` (monotonic).

    ``watch()`` returns the ranks whose processes must stay alive meanwhile (rank -> pid);
    one that exits fails the wait at once instead of at the deadline.

    Raises:
        RuntimeError: a watched rank exited, or the deadline passed (both name ``what``).
    """
    pause = _POLL_FIRST_S
    while not store.check([key]):
        gone = [f"group rank {r} (pid {pid})" for r, pid in watch().items() if _core.process_exited(pid)]
        if gone:
            raise RuntimeError(f"{what}: {', '.join(gone)} exited")
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{what}: not there within the group's timeout")
        time.sleep(min(pause, left))
        pause = min(2 * pause, _POLL_MAX_S)


def publish_pid(store: dist.Store, rank: int, world_size: int) -> str:
    """Join the group's next incarnation in ``store``: publish this process's id under it
    and return the incarnation's key prefix. A counter makes the keys unique per group
    incarnation, so a store reused after ``destroy_process_group`` never yields stale ones."""
    incarnation = (store.add(_STORE_COUNTER, 1) - 1) // world_size
    base = f"flagos_shm/{incarnation}"
    store.set(_pid_key(base, rank), str(os.getpid()))
    return base


def _pid_key(base: str, rank: int) -> str:
    """The store key under which ``rank`` of incarnation ``base`` publishes its process id."""
    return f"{base}/pid/{rank}"


def _published_pid(store: dist.Store, base: str, rank: int) -> int:
    """``rank``'s published process id, or 0 if it has not published it yet (no waiting)."""
    key = _pid_key(base, rank)
    return int(store.get(key)) if store.check([key]) else 0


def rendezvous(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> tuple[str, list]:
    """Group rank 0 creates the segment; return its path and the ranks' process ids
    (a list indexed by rank, 0 where unknown) on every rank.

    Every rank first publishes its process id in the group's store. Group rank 0 then
    creates the segment and publishes its path; the others wait for the path, then for
    every rank's process id (polling the store, ``_store_wait``), so that a rank whose
    process exits while the group is set up is noticed within milliseconds rather than at
    the timeout (here, and by the core's attach, which is given the ids). Only a rank
    that dies before publishing its id is noticed at the timeout. If creation fails, rank
    0 publishes an error marker instead of a path and the other ranks raise
    ``RuntimeError`` instead of waiting.

    Raises:
        RuntimeError: rank 0 could not create the segment, a rank exited, or the timeout
            (``timeout_s``, seconds) passed.
        OSError, ValueError: on rank 0, from creating the segment.
    """
    deadline = time.monotonic() + timeout_s
    base = publish_pid(store, rank, world_size)
    key = f"{base}/segment"
    if rank == 0:
        try:
            directory, slot_bytes = segment_config()
            path = _core.create_segment(directory, world_size, slot_bytes)
        except Exception as exc:
            store.set(key, f"{_STORE_ERROR}{type(exc).__name__}: {exc}")
            raise
        store.set(key, path)
        return path, [_published_pid(store, base, r) for r in range(world_size)]
    creator: dict = {}

    def watch_creator() -> dict:
        if not creator and (pid := _published_pid(store, base, 0)):
            creator[0] = pid
        return creator

    _store_wait(store, key, deadline, "waiting for group rank 0's segment path in the store", watch_creator)
    value = store.get(key).decode()
    if value.startswith(_STORE_ERROR):
        raise RuntimeError(f"flagos_shm: group rank 0 could not create the shared-memory segment: "
                           f"{value[len(_STORE_ERROR):]}")
    pids: dict = {}
    for r in range(world_size):
        _store_wait(store, _pid_key(base, r), deadline, f"waiting for group rank {r}'s process id in the store",
                    lambda: pids)
        pids[r] = int(store.get(_pid_key(base, r)))
    return value, [pids[r] for r in range(world_size)]


