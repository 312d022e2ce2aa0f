"""The rank-process harness itself: results, error reports, timeouts and cleanup."""

from __future__ import annotations

import os
import signal
import time

import pytest

from support.harness import RankError, World, WorldDied, WorldTimeout
from support.leaks import alive, check_world_closed
from support.spawn import spawn


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
        with pytest.raises(WorldTimeout, match="did not answer within") as info:
            world.run(_sleep, 60, timeout=2)
        # the silent ranks' process states and the machine's memory come with the logs
        assert all(f"rank {r}: pid {pid}: state " in str(info.value) for r, pid in enumerate(pids)), info.value
        assert "MemAvailable" in str(info.value), info.value
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


def test_rank_that_died_between_calls_is_reported_with_its_signal(backend):
    """A rank killed while the pool is idle (issue 27: the OOM killer, say) makes the next
    call raise WorldDied naming the rank and the signal, with the logs, instead of the
    BrokenPipeError its send used to raise with nothing else."""
    world = World(2, backend)
    pids = world.pids
    try:
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not world.dead_ranks():
            assert time.monotonic() < deadline, "SIGKILL did not end rank 1"
            time.sleep(0.01)
        with pytest.raises(WorldDied, match=rf"rank 1 \(pid {pids[1]}\) was killed by SIGKILL") as info:
            world.run(_identity, "x")
        assert "--- rank 0 log (tail) ---" in str(info.value) and "MemAvailable" in str(info.value)
        assert not world.alive and not any(alive(pid) for pid in pids)
    finally:
        problems = check_world_closed(world)
    assert problems == []


def child_never_runs(rank: int, world_size: int, tmp: str) -> dict:
    return {}


def test_spawned_rank_that_cannot_dump_its_stack_is_described_by_the_kernel():
    """A fresh rank still there at the deadline with an empty log (issue 27: "both ranks
    still running at the deadline, empty logs, no stack dump") is described from /proc and
    the machine's memory and load are given: here a rank stopped (SIGSTOP) before its
    interpreter started, so that it cannot dump its own stack."""
    stop_first = ["sh", "-c", 'kill -STOP $$; exec "$@"', "sh"]
    with pytest.raises(AssertionError, match=r"(?s)MemAvailable.*--- rank 0 \(pid \d+: state T \(stopped\).*"
                                             r"at the deadline\) ---"):
        spawn(child_never_runs, 1, timeout=2, wrap={0: stop_first})
