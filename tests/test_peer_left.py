"""A peer that destroys its process group and lives on: its peers' calls that wait for it
raise ``RuntimeError`` at once, naming it, instead of waiting out the group's timeout (Gloo's
peers see the connection close).

Rank 1 makes three groups with rank 0, uses them, calls ``destroy_process_group()`` and then
waits (alive) until rank 0 has finished. Rank 0 then calls on each group: a collective, a
receive on a channel never used before (rank 0 is the first of the pair to connect, so it
waits for a peer that never attaches), and a receive on a channel used before."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from support.spawn import spawn

pytestmark = pytest.mark.timeout(150)

#: The groups' timeout, seconds: a wait that ends at it would not be the close being seen.
TIMEOUT_S = 60


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + 90
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear")
        time.sleep(0.01)


def peer_destroys_and_lives_on(rank: int, world_size: int, tmp: str) -> dict:
    from datetime import timedelta

    import flagos_shm  # noqa: F401

    timeout = timedelta(seconds=TIMEOUT_S)
    dist.init_process_group("flagos_shm", rank=rank, world_size=world_size, timeout=timeout)
    coll, fresh, used = (dist.new_group(backend="flagos_shm", timeout=timeout) for _ in range(3))
    t = torch.ones(8)
    for g in (coll, fresh, used):
        dist.all_reduce(t, group=g)
    if rank == 1:
        dist.send(t, 0, group=used)
    else:
        dist.recv(t, 1, group=used)
    if rank == 1:
        dist.destroy_process_group()
        open(os.path.join(tmp, "left"), "w").close()
        _wait_for(os.path.join(tmp, "done"))
        return {}
    _wait_for(os.path.join(tmp, "left"))
    out = {}
    for name, call in (("collective", lambda: dist.all_reduce(t, group=coll)),
                       ("recv_fresh", lambda: dist.recv(t, 1, group=fresh)),
                       ("recv_used", lambda: dist.recv(t, 1, group=used))):
        start = time.monotonic()
        try:
            call()
            out[name] = ("no error", 0.0)
        except RuntimeError as exc:
            out[name] = (str(exc), time.monotonic() - start)
    open(os.path.join(tmp, "done"), "w").close()
    dist.destroy_process_group()
    return out


def test_calls_waiting_for_a_peer_that_destroyed_its_group_raise_at_once():
    res = spawn(peer_destroys_and_lives_on, 2, timeout=120)[0]
    for name, needle in (("collective", "rank 1 (pid"), ("recv_fresh", "group rank 1"), ("recv_used", "group rank 1")):
        message, took = res[name]
        assert needle in message and "closed" in message and "destroy" in message, (name, message)
        # Raised by the close being seen, not by the group's timeout.
        assert took < TIMEOUT_S / 2, (name, took, message)
