"""The reduce-scatter variant of the hierarchical allreduce (``backend/hierarchy/rs.py``),
simulated 2 nodes x 2 ranks by ``FLAGOS_SHM_NODE_ID`` as in ``test_multinode.py``: every
op and dtype of the one-node path against references computed in float64 / exact integer
arithmetic, results bitwise identical on every rank, which path each call took
(``last_reduce_path``), and ranks that would take different paths raising ValueError.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.multinode import (GLOO_ENV, REDUCE_CASES, SPAWN_DEADLINE_S, close_enough, digest, init_group, input_of,
                               op_of, reference_of)
from support.faults import raised
from support.spawn import spawn

ENV_RS = "FLAGOS_SHM_HIER_RS_MIN_BYTES"


def _layout_env(layout: str, extra: dict) -> dict:
    return {r: {"FLAGOS_SHM_NODE_ID": k, **extra} for r, k in enumerate(layout)}


def reductions_rank(rank: int, world_size: int, tmp: str, sizes: list) -> dict:
    import logging

    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("flagos_shm")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    part = init_group(rank, world_size)
    log.removeHandler(handler)
    comm = part._comm
    n = world_size
    bad, digests, paths = [], {}, {}

    def check(name, got, want):
        digests[name] = digest(got)
        paths[name] = comm.last_reduce_path
        if not close_enough(got, want):
            bad.append(f"{name}: got {got.flatten()[:6].tolist()} want {want.flatten()[:6].tolist()}")

    for numel in sizes:
        for dtype, op in REDUCE_CASES:
            inputs = [input_of(r, numel, dtype, op) for r in range(n)]
            x = inputs[rank].clone()
            dist.all_reduce(x, op=op_of(op))
            check(f"allreduce/{dtype}/{op}/{numel}", x, reference_of(op, inputs))
    for op in ("SUM", "AVG", "MAX"):
        inputs = [input_of(r, 4 * n * 301, torch.float32, op) for r in range(n)]
        x = inputs[rank].clone()
        dist.reduce(x, 3, op=op_of(op))
        if rank == 3:
            check(f"reduce/{op}", x, reference_of(op, inputs))
        out = torch.empty(4 * 301)
        dist.reduce_scatter_tensor(out, inputs[rank].clone(), op=op_of(op))
        check(f"reduce_scatter/{op}", out, reference_of(op, inputs)[4 * 301 * rank:4 * 301 * (rank + 1)])
    dist.destroy_process_group()
    return {"bad": bad, "digests": digests, "paths": paths, "log": records}


def _check(results: list, path_of) -> None:
    for rank, res in enumerate(results):
        assert not res["bad"], f"rank {rank}: " + "\n".join(res["bad"][:20])
        wrong = {k: v for k, v in res["paths"].items() if v != path_of(k)}
        assert not wrong, (rank, list(wrong.items())[:5])
    first = results[0]["digests"]
    for rank, res in enumerate(results[1:], 1):
        differ = [k for k, v in res["digests"].items() if k.startswith("allreduce") and first[k] != v]
        assert not differ, f"rank {rank} differs bitwise from rank 0 in {differ[:10]}"


def test_reduce_scatter_path_every_op_and_dtype():
    """Threshold 0: every allreduce of at least 2 elements takes the reduce-scatter path (7
    and 4099 elements: the last chunk padded; 4100: even chunks); 1 element the leader path
    (but a complex element is two float32 ones to the core)."""
    results = spawn(reductions_rank, 4, env=GLOO_ENV, args=([1, 7, 4099, 4100],), timeout=SPAWN_DEADLINE_S,
                    rank_env=_layout_env("aabb", {ENV_RS: "0"}))
    _check(results, lambda k: "leader" if k.endswith("/1") and "complex" not in k else "reduce_scatter")
    # the set-up log line a user reads to check the layout (INFO)
    for rank, res in enumerate(results):
        lines = [m for m in res["log"] if "2 nodes: node 0 = ranks [0, 1] on" in m]
        assert len(lines) == 1, (rank, res["log"])
        assert "node 1 = ranks [2, 3]" in lines[0] and "FLAGOS_SHM_NODE_ID='b'" in lines[0], lines
        assert f"local rank {rank % 2} of 2 on node {rank // 2}" in lines[0], lines


@pytest.mark.parametrize("layout", ["aaab", "abab"])
def test_leader_path_on_unequal_nodes_and_below_the_threshold(layout):
    """3 + 1 ranks: always the leader path. Non-contiguous 2 + 2 with a 64 KiB threshold:
    4100 elements (at most 32 KiB) take the leader path; 16400 elements take the
    reduce-scatter path from 4 bytes an element (64 KiB) on."""
    rs_env = {ENV_RS: "0"} if layout == "aaab" else {ENV_RS: str(64 << 10)}
    results = spawn(reductions_rank, 4, env=GLOO_ENV, args=([7, 4100] if layout == "aaab" else [4100, 16400],),
                    timeout=SPAWN_DEADLINE_S, rank_env=_layout_env(layout, rs_env))

    def path_of(name: str) -> str:
        if layout == "aaab":
            return "leader"
        dtype = getattr(torch, name.split("/")[1].split(".")[1]) if name.startswith("allreduce") else torch.float32
        numel = int(name.split("/")[-1]) if name.startswith("allreduce") else 4 * 4 * 301
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return "reduce_scatter" if nbytes >= 64 << 10 else "leader"
    _check(results, path_of)


def test_threshold_setting(monkeypatch):
    from flagos_shm import config

    monkeypatch.delenv(ENV_RS, raising=False)
    assert config.hier_rs_min_bytes() == config.DEFAULT_HIER_RS_MIN_BYTES == 4 << 20
    for raw, want in (("0", 0), ("65536", 65536), ("off", None)):
        monkeypatch.setenv(ENV_RS, raw)
        assert config.hier_rs_min_bytes() == want
    for raw in ("-1", "4k", "many"):
        monkeypatch.setenv(ENV_RS, raw)
        with pytest.raises(ValueError, match=ENV_RS):
            config.hier_rs_min_bytes()


def disagree_rank(rank: int, world_size: int, tmp: str) -> dict:
    init_group(rank, world_size)
    res = {}
    x = torch.ones(1 << 20)  # 4 MiB: node a takes the reduce-scatter path, node b (off) the leader path
    res["paths"] = raised(lambda: dist.all_reduce(x))
    y = torch.ones(1 << 20 if rank != 3 else (1 << 20) + 4)  # another count on rank 3
    res["count"] = raised(lambda: dist.all_reduce(y))
    z = torch.full((5,), float(rank))
    dist.all_reduce(z)
    res["after"] = z.tolist()
    dist.destroy_process_group()
    return res


def test_ranks_that_would_take_different_paths_raise_value_error_everywhere():
    env = {r: {"FLAGOS_SHM_NODE_ID": k, ENV_RS: "off" if k == "b" else ""} for r, k in enumerate("aabb")}
    results = spawn(disagree_rank, 4, env=GLOO_ENV, timeout=SPAWN_DEADLINE_S, rank_env=env)
    for rank, res in enumerate(results):
        assert res == {"paths": "ValueError", "count": "ValueError", "after": [6.0] * 5}, (rank, res)
