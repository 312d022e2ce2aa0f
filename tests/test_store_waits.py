"""A set-up wait that finds a watched rank's process gone fails only if what it waits for
is still missing when it looks again, after that finding.

The rank may have published the last key and exited between the wait's own check of the
keys and its liveness check (its keys precede its exit); that is no failure. The same
order serves ``monitored_barrier`` (rank 0 releases, then exits; a rank arrives, then
exits) and point-to-point connection (the peer publishes its channel, then exits), and
mirrors the core's waits (``shm::wait::Waiter::until``: a peer that arrived, finished the
call and closed the group). Likewise a wait whose keys come in at its deadline does not
time out. In-process: a ``HashStore`` and the process id of a child that has exited.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from flagos_shm.backend import rendezvous
from flagos_shm.backend.collectives import barrier, p2p


@pytest.fixture(scope="module")
def exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


class PublishesOnFirstCheck:
    """A store whose keys appear right after the wait's first check of them: the
    interleaving where the watched rank publishes and exits in between."""

    def __init__(self, keys):
        self.inner, self.keys, self.checks = dist.HashStore(), keys, 0

    def check(self, keys):
        self.checks += 1
        found = self.inner.check(keys)
        if self.checks == 1:
            for k in self.keys:
                self.inner.set(k, "1")
        return found

    def set(self, key, value):
        self.inner.set(key, value)


def test_keys_published_before_the_exit_end_the_wait_without_error(exited_pid):
    keys = ["base/a", "base/b"]
    store = PublishesOnFirstCheck(keys)
    rendezvous._store_wait(store, keys, time.monotonic() + 30, "waiting for a and b", lambda: {1: exited_pid})
    assert store.inner.check(keys)


def test_keys_still_missing_after_the_exit_fail_at_once_naming_the_rank(exited_pid):
    store = dist.HashStore()
    store.set("base/a", "1")
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"waiting for a and b: group rank 1 \(pid {exited_pid}\) exited"):
        rendezvous._store_wait(store, ["base/a", "base/b"], time.monotonic() + 30, "waiting for a and b",
                               lambda: {1: exited_pid})
    assert time.monotonic() - t < 20, "fails at once, not at the 30 s deadline"


class Unreachable:
    def check(self, keys):
        raise RuntimeError("Broken pipe")


def test_published_reports_an_unreachable_store_as_not_published():
    store = dist.HashStore()
    store.set("k", "1")
    assert rendezvous.published(store, ["k"]) is True
    assert rendezvous.published(store, ["k", "absent"]) is False
    assert rendezvous.published(Unreachable(), ["k"]) is False


def test_keys_that_come_in_at_the_deadline_end_the_wait_without_error():
    keys = ["base/a"]
    store = PublishesOnFirstCheck(keys)
    rendezvous._store_wait(store, keys, time.monotonic() - 1, "waiting for a", lambda: {})
    assert store.inner.check(keys)


def test_a_key_still_in_flight_when_the_exit_is_seen_counts_as_published():
    # TCPStore's set has no reply: the key the rank sent before exiting may reach the
    # server after the first look. The look after the settling time finds it.
    store = PublishesOnFirstCheck(["k"])
    assert rendezvous.published(store, ["k"], settle_s=0.001) is True
    assert store.checks == 2
    assert rendezvous.published(dist.HashStore(), ["k"], settle_s=0.001) is False


class Rank0:
    """What ``Barrier.monitored_barrier`` reads of its group, for group rank 0 of 2."""

    def __init__(self, store):
        self._closed, self._group_name, self._rank, self._world_size = False, "stub", 0, 2
        self._timeout_s, self._store, self._layout = 30.0, store, None


def test_monitored_barrier_counts_a_rank_that_arrived_and_then_exited_as_arrived(exited_pid, monkeypatch):
    # Rank 1's arrival lands right after rank 0's first look, and its process is gone by
    # the time rank 0 checks it: it passed the barrier, so rank 0 releases it, no error.
    monkeypatch.setattr(barrier, "watchable", lambda layout, rank, ranks: {1: exited_pid})
    store = PublishesOnFirstCheck(["flagos_shm/monitored_barrier/0/arrived/1"])
    barrier.Barrier.monitored_barrier(Rank0(store), timeout=30)
    assert store.inner.check(["flagos_shm/monitored_barrier/0/release"])


def test_monitored_barrier_names_a_rank_that_exited_without_arriving(exited_pid, monkeypatch):
    monkeypatch.setattr(barrier, "watchable", lambda layout, rank, ranks: {1: exited_pid})
    with pytest.raises(RuntimeError, match=rf"Rank 1 failed to pass monitoredBarrier in 30000 ms "
                                           rf"\(did not arrive; exited: rank 1 \(pid {exited_pid}\)\)"):
        barrier.Barrier.monitored_barrier(Rank0(dist.HashStore()), timeout=30)


def test_a_channel_published_before_the_peer_exited_is_reported_as_gone_not_as_never_made(exited_pid, tmp_path):
    # The peer (rank 0, the pair's creator) published its channel's path right after this
    # rank's first look, then exited and took the channel with it.
    key = "flagos_shm/p2p/seg/0-1"
    store = PublishesOnFirstCheck([key])
    store.add = lambda k, n: 2  # the peer claimed the pair first: this rank waits for the path
    store.get = lambda k: str(tmp_path / "gone").encode()
    box = object.__new__(p2p._Mailbox)
    box.rank, box.world_size, box.store, box.segment_id = 1, 2, store, "seg"
    box.pids, box.comm, box.aborted, box.closed = [exited_pid, 0], None, False, False
    with pytest.raises(RuntimeError, match=rf"group rank 0 \(pid {exited_pid}\): its channel is gone"):
        box._connect(0, time.monotonic() + 30)
