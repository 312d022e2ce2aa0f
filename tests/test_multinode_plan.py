"""The plan of each node of a group that spans nodes (``flagos_shm.backend.plan``), on nodes
simulated with ``FLAGOS_SHM_NODE_ID`` as in ``test_multinode.py``.

Each node's segment gets a plan as a single-node group's does: the one ``FLAGOS_SHM_PLAN``
asks for, or the one measured on (and cached for) that node's machine; and a malformed
or disagreeing request on any rank of any node raises on every rank. (Groups spanning
nodes kept the core's fallback plan on every node and never read ``FLAGOS_SHM_PLAN``.)
Results of the collectives run under those plans are checked against references computed
from every rank's inputs.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from support.spawn import cache_dir_with_builds, spawn
from test_plan import init_rank  # init_process_group (env://) and one allreduce: the error and its time

from flagos_shm.backend import plan

GROUP_TIMEOUT_S = 60.0
SPAWN_DEADLINE_S = 150.0
GLOO_ENV = {"GLOO_SOCKET_IFNAME": "lo"}
EXPLICIT = "one_shot_max=1K,allreduce_single_copy=never"


def _nodes(layout: str) -> dict:
    return {r: {"FLAGOS_SHM_NODE_ID": k} for r, k in enumerate(layout)}


def _checked_calls(rank: int, world_size: int) -> bool:
    """Allreduce (one-shot and two-step sizes under both plans of these tests) and allgather
    against references built from every rank's inputs."""
    ok = True
    for numel in (64, 1024, 16 << 10):  # 256 B, 4 KiB, 64 KiB of float32
        t = torch.arange(numel, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(t)
        ok &= bool(torch.equal(t, torch.arange(numel, dtype=torch.float32) * (world_size * (world_size + 1) // 2)))
        out = torch.empty(world_size * numel, dtype=torch.int64)
        dist.all_gather_into_tensor(out, torch.full((numel,), rank, dtype=torch.int64))
        ok &= bool(torch.equal(out, torch.arange(world_size).repeat_interleave(numel)))
    return ok


def plans_rank(rank: int, world_size: int, tmp: str, groups: int) -> list:
    """``groups`` times: init_process_group, this rank's plan and its source, whether the
    collectives were right, destroy. The machine counts as idle, so that every
    calibration is cached whatever the load of the test machine."""
    from flagos_shm.backend import shm_part

    plan.BUSY_MARGIN = float("inf")
    out = []
    for _ in range(groups):
        dist.init_process_group("flagos_shm", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        part = shm_part(dist.group.WORLD)
        out.append({"plan": part._comm.plan, "source": part._plan_source, "nodes": part._comm.nodes,
                    "correct": _checked_calls(rank, world_size)})
        dist.destroy_process_group()
    return out


def test_every_node_takes_the_plan_flagos_shm_plan_asks_for():
    results = spawn(plans_rank, 4, env={**GLOO_ENV, "FLAGOS_SHM_PLAN": EXPLICIT}, args=(1,),
                    timeout=SPAWN_DEADLINE_S, rank_env=_nodes("aabb"))
    want = plan.parse(EXPLICIT)
    assert want["one_shot_max_bytes"] != plan.FALLBACK["one_shot_max_bytes"]
    for rank, (group,) in enumerate(results):
        assert group["nodes"] == [[0, 1], [2, 3]], (rank, group)
        assert group["plan"] == want and group["source"] == "env", (rank, group)
        assert group["correct"], (rank, group)


def test_a_node_measures_its_own_plan_once_and_reads_it_from_the_cache_after(tmp_path):
    """Node a (2 ranks) calibrates at its first group and reads its cache entry (made for 2
    ranks) at the second; node b (1 rank) has nothing to choose between."""
    cache = tmp_path / "cache"
    env = {**GLOO_ENV, "FLAGOS_SHM_PLAN": "auto", "FLAGOS_SHM_CACHE_DIR": cache_dir_with_builds(cache)}
    results = spawn(plans_rank, 3, env=env,
                    args=(2,), timeout=SPAWN_DEADLINE_S, rank_env=_nodes("aab"))
    for rank, groups in enumerate(results):
        assert all(g["correct"] for g in groups), (rank, groups)
        want = ["calibrated", "cache"] if rank < 2 else ["fallback", "fallback"]
        assert [g["source"] for g in groups] == want, (rank, groups)
    assert results[0][0]["plan"] == results[1][0]["plan"] == results[0][1]["plan"] == results[1][1]["plan"]
    # (a node of one rank has no single-copy transfers: the core reports those as None)
    assert results[2][0]["plan"]["one_shot_max_bytes"] == plan.FALLBACK["one_shot_max_bytes"]
    files = [name for name in os.listdir(cache) if name.startswith("plan-")]
    assert len(files) == 1, os.listdir(cache)
    with open(cache / files[0]) as fh:
        assert "|n=2|" in json.load(fh)["key"]


@pytest.mark.parametrize("bad_rank,var,value,says", [
    (3, "FLAGOS_SHM_PLAN", "fast", "group rank 3"),
    (0, "FLAGOS_SHM_PLAN", "one_shot_max=12X", "group rank 0"),
    (2, "FLAGOS_SHM_PLAN", "single_copy=64X", "group rank 2"),
    (2, "FLAGOS_SHM_PLAN", EXPLICIT, "ranks [2] have"),
])
def test_a_bad_request_on_any_node_raises_on_every_rank_at_once(bad_rank, var, value, says):
    """A malformed request, or one that differs from the others, on one rank of either node:
    every rank of both nodes raises ValueError naming the variable and the rank, at once
    (not at the group's timeout), also when the bad rank holds the store."""
    results = spawn(init_rank, 4, env=GLOO_ENV, timeout=SPAWN_DEADLINE_S,
                    rank_env={r: {**env, **({var: value} if r == bad_rank else {})}
                              for r, env in _nodes("aabb").items()})
    for rank, res in enumerate(results):
        assert res["error"] and res["error"].startswith("ValueError"), (rank, res)
        assert var in res["error"] and says in res["error"], (rank, res)
        assert res["s"] < GROUP_TIMEOUT_S / 3, (rank, res)


def plan_death_rank(rank: int, world_size: int, tmp: str, victim: int, when: str) -> dict:
    """``victim`` exits in the plan phase: before publishing its request (``"before"``), or
    while it waits for the others' (``"after"``); the others set the group up and run one
    allreduce. The error each of them raised, and how long that took."""
    if rank == victim:
        from flagos_shm.backend import rendezvous

        def die(*args, **kwargs):
            os._exit(3)
        if when == "before":
            plan.setup = die
        else:  # the plan's first wait (the rendezvous' own waits do not go through it)
            rendezvous.wait_keys = die
    return init_rank(rank, world_size, tmp)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_rank_alone_on_its_node_dying_in_the_plan_phase_fails_every_rank_at_once(when):
    """Rank 2 is node b's only rank: no node mate notices its exit and publishes it, so the
    other node's ranks watch its process themselves (nodes on one machine share the PID
    namespace), while its request is missing and while its leader is awaited (before: both
    waited for the group's timeout)."""
    results = spawn(plan_death_rank, 3, env=GLOO_ENV, args=(2, when), timeout=SPAWN_DEADLINE_S,
                    rank_env=_nodes("aab"), may_die=(2,))
    for rank, res in enumerate(results[:2]):
        assert res["error"] and res["error"].startswith("RuntimeError"), (rank, res)
        assert res["s"] < GROUP_TIMEOUT_S / 3, (rank, res)


def calibration_death_rank(rank: int, world_size: int, tmp: str, victim: int) -> dict:
    """``victim`` exits as its node starts to calibrate (``FLAGOS_SHM_PLAN=calibrate``); the
    others set the group up (see :func:`init_rank`)."""
    if rank == victim:
        def die(*args, **kwargs):
            os._exit(3)
        plan.calibrate = die
    return init_rank(rank, world_size, tmp)


def test_a_calibration_failing_names_the_group_ranks_of_the_node():
    """Layout abab: node 0 is group ranks [0, 2], node 1 is [1, 3]. Group rank 3 (node 1's
    local rank 1) exits instead of calibrating: its node mate's error, from the core's
    collective, names the node and how its local ranks map to group ranks, as the errors of
    a multi-node group's collectives do (before: only "rank 1 exited", a live rank's group
    number)."""
    results = spawn(calibration_death_rank, 4, env={**GLOO_ENV, "FLAGOS_SHM_PLAN": "calibrate"}, args=(3,),
                    timeout=SPAWN_DEADLINE_S, rank_env=_nodes("abab"), may_die=(3,))
    res = results[1]
    assert res["error"] and res["error"].startswith("RuntimeError"), res
    assert "node 1, whose ranks 0..1 are group ranks [1, 3]" in res["error"], res
    for rank in (0, 1, 2):
        assert results[rank]["error"] and results[rank]["s"] < GROUP_TIMEOUT_S / 3, (rank, results[rank])
