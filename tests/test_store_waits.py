"""A set-up wait that finds a watched rank's process gone fails only if what it waits for
is still missing when it looks again, after that finding.

The rank may have published the last key and exited between the wait's own check of the
keys and its liveness check (its keys precede its exit); that is no failure. The same
order serves ``monitored_barrier``'s non-zero ranks (rank 0 releases, then exits) and
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
