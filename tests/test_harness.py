"""The rank-process harness itself: results, error reports, timeouts and cleanup."""

from __future__ import annotations

import os
import time

import pytest

from support.harness import RankError, World, WorldDied, WorldTimeout
from support.leaks import alive, check_world_closed


def _identity(tag):
    import torch.distributed as dist

    return tag, dist.get_rank(), dist.get_world_size(), dist.get_backend(), os.getpid()


def _fail_on(rank_to_fail):
    import torch.distributed as dist

    if dist.get_rank() == rank_to_fail:
        raise ValueError(f"deliberate failure on rank {rank_to_fail}")
    return "fine"


def _sleep(seconds):
    time.sleep(seconds)


def _exit_on(rank_to_exit):
    import torch.distributed as dist

    if dist.get_rank() == rank_to_exit:
        os._exit(3)
    time.sleep(30)


def test_results_in_rank_order(worlds):
    world = worlds(3)
    results = world.run(_identity, "x")
    assert [r[:3] for r in results] == [("x", r, 3) for r in range(3)]
    assert all(r[3] == worlds.backend for r in results)
    assert [r[4] for r in results] == world.pids  # the pool's own processes answered


def test_rank_error_is_reported_and_pool_survives(worlds):
    world = worlds(2)
    with pytest.raises(RankError, match=r"(?s)rank\(s\) \[1\].*deliberate failure on rank 1"):
        world.run(_fail_on, 1)
    assert world.alive
    assert world.run(_fail_on, 5) == ["fine", "fine"]


def test_timeout_kills_every_rank_and_leaves_nothing(backend):
    world = World(2, backend)
    pids = world.pids
    try:
        with pytest.raises(WorldTimeout, match="did not answer within"):
            world.run(_sleep, 60, timeout=2)
        assert not world.alive
        assert not any(alive(pid) for pid in pids)
    finally:
        problems = check_world_closed(world)
    assert problems == []


def test_dead_rank_kills_the_pool(backend):
    world = World(2, backend)
    pids = world.pids
    try:
        with pytest.raises(WorldDied, match="rank 1 .* exited"):
            world.run(_exit_on, 1, timeout=60)
        assert not any(alive(pid) for pid in pids)
    finally:
        problems = check_world_closed(world)
    assert problems == []
