"""Synchronisation without data: barrier, and monitored_barrier, which names the ranks that
did not arrive."""

from __future__ import annotations

import time
from datetime import timedelta

from ... import _core
from ...work import ShmWork
from .. import options
from ..rendezvous import published, watchable
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
        the timeout (``opts.timeout``, a ``timedelta`` or seconds, else the group's; 0 means
        no waiting at all) are named in the error; with ``wait_all_ranks=False`` the first
        missing rank is reported, with True all of them. A rank whose process has exited is
        not waited for where this rank can see it (same machine and PID namespace,
        ``rendezvous.watchable``; ranks on other machines are waited for until the timeout):
        rank 0 fails as soon as it sees one missing (with ``wait_all_ranks``, once every rank
        still missing has exited or the timeout has passed; a rank that arrived and then
        exited has arrived), and the other ranks as soon as
        rank 0 has exited, as Gloo's closed connections make it fail (Gloo: 0.5 s after the
        death; before, flagos_shm waited out the whole timeout). Returns once every rank has
        arrived
        (c10d's ``monitoredBarrier`` returns nothing: failures are raised here, not through
        a work). The messages carry Gloo's wording, which callers (and PyTorch's own tests)
        match on.

        Raises:
            RuntimeError: on group rank 0, ``"Rank 1 failed to pass monitoredBarrier in N ms"``
                (``"Ranks 1, 2 failed ..."`` with ``wait_all_ranks`` and several missing; the
                ranks whose process exited are named with it), or,
                with a zero timeout, ``"Rank 0 timed out in monitoredBarrier after 0 ms"``; on
                the other ranks, ``"Rank r successfully reached monitoredBarrier, but received
                errors while waiting for send/recv from rank 0"`` as soon as rank 0 fails, or
                once their own timeout has passed. Each message starts with ``flagos_shm
                monitored_barrier`` and the group's name.
        """
        name = "monitored_barrier"
        if self._closed:
            raise RuntimeError(f"flagos_shm {name}: process group {self._group_name!r} has been shut down")
        timeout_s = _barrier_timeout(opts if isinstance(opts, timedelta) or opts is None
                                     else getattr(opts, "timeout", timeout), timeout, self._timeout_s)
        ms = int(round(timeout_s * 1000))
        seq = getattr(self, "_mb_seq", 0)
        self._mb_seq = seq + 1
        base = f"flagos_shm/monitored_barrier/{seq}"
        where = f"flagos_shm {name} on group {self._group_name!r} (rank {self._rank}/{self._world_size})"
        store = self._store
        # The ranks whose processes this rank can watch (group rank -> pid): not those of
        # other machines, whose pids mean nothing here.
        pids = watchable(self._layout, self._rank, None)

        def exited(r: int) -> bool:
            return r in pids and _core.process_exited(pids[r])

        if self._rank != 0:
            store.set(f"{base}/arrived/{self._rank}", "1")
            deadline = time.monotonic() + timeout_s
            while not store.check([f"{base}/release"]):
                failed = store.check([f"{base}/failed"])
                gone = not failed and exited(0) and not published(store, [f"{base}/release"])
                if failed or gone or time.monotonic() > deadline:
                    why = ("rank 0 reported missing ranks" if failed else
                           f"rank 0's process {pids[0]} exited" if gone else
                           f"rank 0 did not release it within {ms} ms")
                    raise RuntimeError(
                        f"{where}: Rank {self._rank} successfully reached monitoredBarrier, but received errors "
                        f"while waiting for send/recv from rank 0 ({why}); see rank 0's error for the faulty rank")
                time.sleep(_POLL_S)
            return
        deadline = time.monotonic() + timeout_s
        missing = list(range(1, self._world_size))
        while missing:
            missing = [r for r in missing if not store.check([f"{base}/arrived/{r}"])]
            if not missing:
                break
            dead = [r for r in missing if exited(r)]
            if dead:  # looked for again after finding them gone: their arrival precedes their exit
                arrived = [r for r in dead if published(store, [f"{base}/arrived/{r}"])]
                missing = [r for r in missing if r not in arrived]
                dead = [r for r in dead if r not in arrived]
                if not missing:
                    break
            timed_out = time.monotonic() > deadline
            if timed_out or (dead and (not wait_all_ranks or len(dead) == len(missing))):
                store.set(f"{base}/failed", "1")
                if timeout_s == 0 and not wait_all_ranks and not dead:
                    raise RuntimeError(f"{where}: Rank 0 timed out in monitoredBarrier after 0 ms; "
                                       f"rank(s) {missing} had not arrived")
                named = missing if wait_all_ranks else (dead or missing)[:1]
                who = ("Ranks " if len(named) > 1 else "Rank ") + ", ".join(str(r) for r in named)
                why = "did not arrive"
                if any(r in dead for r in named):
                    why += "; exited: " + ", ".join(f"rank {r} (pid {pids[r]})" for r in named if r in dead)
                raise RuntimeError(
                    f"{where}: {who} failed to pass monitoredBarrier in {ms} ms ({why})"
                    + ("" if wait_all_ranks else "; wait_all_ranks=True names every missing rank"))
            time.sleep(_POLL_S)
        store.set(f"{base}/release", "1")


def _barrier_timeout(primary, secondary, group_timeout_s: float) -> float:
    """monitored_barrier's timeout in seconds: the first of ``primary``/``secondary`` that is
    set (a ``timedelta`` or seconds; c10d's -1 ms means unset), else the group's. Unlike the
    collectives' timeouts, 0 is kept: rank 0 then reports at once who has not arrived."""
    for value in (primary, secondary):
        if value is None or value == options.UNSET_TIMEOUT:
            continue
        seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
        return max(seconds, 0.0)
    return group_timeout_s
