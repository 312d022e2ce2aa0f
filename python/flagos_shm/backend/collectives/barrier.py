"""Synchronisation without data: barrier, and monitored_barrier, which names the ranks that
did not arrive."""

from __future__ import annotations

import time
from datetime import timedelta

from ...work import ShmWork
from .. import options
from .base import CollectiveBase

_POLL_S = 0.002  # store polling of monitored_barrier's group rank 0


class Barrier(CollectiveBase):
    """barrier, monitored_barrier."""

    def barrier(self, opts=None, timeout=None) -> ShmWork:
        """Wait until every rank of the group has called ``barrier``."""
        name = "barrier"
        with self._validating(name):
            a = self._args(opts, timeout=timeout)
        comm = self._comm
        return self._run(name, [], [], [lambda done: comm.barrier(a.timeout_s, done)], opts)

    def monitored_barrier(self, opts=None, wait_all_ranks: bool = False, timeout=None) -> None:
        """A barrier through the group's store that reports which ranks did not arrive.

        As Gloo's ``monitoredBarrier``: group rank 0 waits for every other rank's arrival
        (a key in the group's store), then releases them. Ranks that do not arrive within
        the timeout (``opts.timeout``, a ``timedelta``, else the group's) are named in the
        error; with ``wait_all_ranks=False`` the first missing rank is reported, with True
        all of them. Returns once every rank has arrived (c10d's ``monitoredBarrier``
        returns nothing: failures are raised here, not through a work).

        Raises:
            RuntimeError: on group rank 0, ``"flagos_shm monitored_barrier ...: rank(s) [..]
                did not arrive within ... s"``; on other ranks, rank 0 did not release them
                within the timeout.
        """
        name = "monitored_barrier"
        if self._closed:
            raise RuntimeError(f"flagos_shm {name}: process group {self._group_name!r} has been shut down")
        if isinstance(opts, timedelta) or opts is None:
            timeout_s = options.timeout_seconds(opts if opts is not None else timeout)
        else:
            timeout_s = options.timeout_seconds(getattr(opts, "timeout", timeout))
        timeout_s = timeout_s or self._timeout_s
        seq = getattr(self, "_mb_seq", 0)
        self._mb_seq = seq + 1
        base = f"flagos_shm/monitored_barrier/{seq}"
        store = self._store
        if self._rank != 0:
            store.set(f"{base}/arrived/{self._rank}", "1")
            deadline = time.monotonic() + timeout_s
            while not store.check([f"{base}/release"]):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"flagos_shm {name} on group {self._group_name!r} (rank {self._rank}/{self._world_size}): "
                        f"group rank 0 did not release this rank within {timeout_s:.3f} s")
                time.sleep(_POLL_S)
            return
        deadline = time.monotonic() + timeout_s
        missing = list(range(1, self._world_size))
        while missing:
            missing = [r for r in missing if not store.check([f"{base}/arrived/{r}"])]
            if not missing:
                break
            if time.monotonic() > deadline:
                shown = missing if wait_all_ranks else missing[:1]
                raise RuntimeError(
                    f"flagos_shm {name} on group {self._group_name!r} (rank 0/{self._world_size}): "
                    f"rank(s) {shown} did not arrive within {timeout_s:.3f} s"
                    + ("" if wait_all_ranks else " (wait_all_ranks=True names every missing rank)"))
            time.sleep(_POLL_S)
        store.set(f"{base}/release", "1")
