"""Failures in groups that span nodes (issue 13), simulated on one machine: a rank killed on
either node is reported on every rank (and a failed call's locals are released), ranks that
disagree across nodes raise everywhere and the group stays usable, and a rank that dies while
a multi-node group is set up fails every rank at once.

Two "nodes" of ranks are made with ``FLAGOS_SHM_NODE_ID`` and, for some tests, by running
the second node's ranks in their own mount namespace with a private tmpfs on ``/dev/shm``
(``unshare -m``; needs root), so that they cannot open the first node's segments at all.
Gloo talks over loopback. Each test runs fresh rank processes (``support.spawn``) with a
group timeout of ``support.multinode.GROUP_TIMEOUT_S`` and a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from support.multinode import GLOO_ENV, SPAWN_DEADLINE_S, gloo_threads, init_group
from support.faults import raised
from support.spawn import spawn, start_together


# ==== failures ===================================================================================


def killed_rank(rank: int, world_size: int, tmp: str, victim: int, timeout_s: float) -> dict:
    init_group(rank, world_size, timeout_s)
    x = torch.ones(1000)
    dist.all_reduce(x)
    dist.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    res = {"error": None}
    try:
        for _ in range(1000):
            dist.all_reduce(x)
            time.sleep(0.01)
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"[:400]
    res["elapsed"] = time.monotonic() - t0
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    res["gloo_threads"] = gloo_threads()
    return res


def _innermost_locals(exc: BaseException) -> list:
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return sorted(tb.tb_frame.f_locals)


def test_forgetting_locals_clears_the_failed_call_but_not_the_error_being_handled():
    """What an error out of a Gloo call keeps (``groups.forgetting_locals``, which the
    hierarchy's jobs and cross-node point-to-point run in): the failed call's frames lose
    their locals (in the real case, the Gloo group), the frames and locals of an error the
    caller was already handling (a collective called in the user's ``except`` block) stay,
    and so does every traceback line."""
    from flagos_shm.backend.hierarchy import groups

    def users_step():
        users_state = [1, 2, 3]  # noqa: F841  (what a post-mortem debugger would look at)
        raise KeyError("the user's own error")

    def failed_call(pg):
        raise RuntimeError("Gloo: connection reset by peer")

    def call_from(handling: bool):
        try:
            if handling:
                try:
                    users_step()
                except KeyError:
                    with groups.forgetting_locals():
                        failed_call(pg=object())
            else:
                with groups.forgetting_locals():
                    failed_call(pg=object())
        except RuntimeError as exc:
            return exc

    plain = call_from(handling=False)
    assert _innermost_locals(plain) == []
    assert "failed_call" in "".join(traceback.format_exception(plain))
    inside = call_from(handling=True)
    assert _innermost_locals(inside) == []
    assert isinstance(inside.__context__, KeyError)
    assert _innermost_locals(inside.__context__) == ["users_state"]


@pytest.mark.parametrize("victim", [1, 2, 0])  # a node's second rank, the other node's leader, rank 0
def test_rank_killed_on_either_node_is_reported_on_every_rank(victim):
    """Every survivor raises within the timeout, and ``destroy_process_group`` frees the
    Gloo groups between the nodes there and then: an error that kept one alive (through
    its traceback) left Gloo's threads running into the interpreter's finalization, where
    rank 2 once aborted at exit when rank 0 had died."""
    timeout_s = 30.0
    results = spawn(killed_rank, 4, env=GLOO_ENV, args=(victim, timeout_s), timeout=SPAWN_DEADLINE_S,
                    rank_env={r: {"FLAGOS_SHM_NODE_ID": k} for r, k in enumerate("aabb")}, may_die=(victim,))
    assert results[victim] is None
    for rank, res in enumerate(results):
        if rank == victim:
            continue
        print(f"victim {victim}: rank {rank} raised after {res['elapsed']:.2f} s: {res['error']}")
        assert res["error"] is not None, rank
        assert res["elapsed"] < timeout_s, (rank, res)
        assert res["gloo_threads"] == [], (rank, res)


# ==== disagreement, invalid arguments, teardown ===================================================


def disagreement_rank(rank: int, world_size: int, tmp: str) -> dict:
    part = init_group(rank, world_size)
    comm = part._comm
    res = {}
    # rank 3 (on the other node) passes another element count: every rank raises ValueError
    x = torch.ones(8 if rank != 3 else 9)
    res["count"] = raised(lambda: dist.all_reduce(x))
    # rank 2 passes an op its dtype cannot take: it raises TypeError, its peers ValueError
    y = torch.ones(4)
    res["invalid"] = raised(lambda: dist.all_reduce(y, op=dist.ReduceOp.BAND if rank == 2 else dist.ReduceOp.SUM))
    # the group is still usable
    z = torch.full((5,), float(rank))
    dist.all_reduce(z)
    res["after"] = z.tolist()
    dist.destroy_process_group()
    res["torn_down"] = comm.closed and comm._leaders is None and comm._all is None
    return res


def test_disagreement_across_nodes_raises_everywhere_and_the_group_stays_usable():
    results = spawn(disagreement_rank, 4, env=GLOO_ENV, timeout=SPAWN_DEADLINE_S,
                    rank_env={r: {"FLAGOS_SHM_NODE_ID": k} for r, k in enumerate("aabb")})
    for rank, res in enumerate(results):
        assert res["count"] == "ValueError", (rank, res)
        assert res["invalid"] == ("TypeError" if rank == 2 else "ValueError"), (rank, res)
        assert res["after"] == [6.0] * 5, (rank, res)
        assert res["torn_down"], (rank, res)



def premul_factor_rank(rank: int, world_size: int, tmp: str, split: int) -> dict:
    """PREMUL_SUM with factor 1 on ranks below ``split``, 2 from it on (the same within
    each node of the tests' layouts): the error each rank raises, or the result; then a
    plain allreduce, to show the group is still usable."""
    init_group(rank, world_size)
    res = {}
    x = torch.full((1000,), 1.0 + rank)
    try:
        dist.all_reduce(x, op=dist._make_nccl_premul_sum(1.0 if rank < split else 2.0))
        res["error"], res["result"] = None, x[:3].tolist()
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
    z = torch.full((5,), float(rank))
    dist.all_reduce(z)
    res["after"] = z.tolist()
    dist.destroy_process_group()
    return res


@pytest.mark.parametrize("layout,split,rs_min", [("ab", 1, "off"), ("aab", 2, "off"), ("aabb", 2, "0")])
def test_premul_sum_factors_that_differ_between_nodes_raise_everywhere(layout, split, rs_min):
    """Ranks must pass the same PREMUL_SUM factor (README, Reduce ops); on one node the
    core refuses different ones. Factors equal within each node but different between
    nodes must be refused too, on every rank, with the group left usable: the leaders'
    descriptor had no factor, so each node scaled by its own and the call returned a sum
    that no single factor gives (two nodes of one rank, inputs 1 and 2, factors 1 and 2:
    5 on every rank), on the leader path and on the reduce-scatter path alike."""
    n = len(layout)
    results = spawn(premul_factor_rank, n, env=GLOO_ENV, args=(split,), timeout=SPAWN_DEADLINE_S,
                    rank_env={r: {"FLAGOS_SHM_NODE_ID": k, "FLAGOS_SHM_HIER_RS_MIN_BYTES": rs_min}
                              for r, k in enumerate(layout)})
    for rank, res in enumerate(results):
        assert res["error"] and res["error"].startswith("ValueError"), (rank, res)
        assert res["after"] == [float(sum(range(n)))] * 5, (rank, res)
    leaders = [results[r]["error"] for r in range(n) if r == 0 or layout[r] != layout[r - 1]]
    assert all("factor" in e for e in leaders), leaders


# ==== a rank that dies while a multi-node group is set up ==========================================


def setup_death_rank(rank: int, world_size: int, tmp: str, victim: int, slow_reader: bool = False) -> dict:
    """``victim`` exits just before attaching to its node's segment; the others try to set
    the group up and run one allreduce. ``slow_reader``: the others read why a rank gave
    up (the store's failure key) 1 s late."""
    if slow_reader and rank != victim:
        from flagos_shm.backend import rendezvous

        get_all = rendezvous._get_all

        def slow(store, keys):
            if any(k.endswith("/failed") for k in keys):
                time.sleep(1.0)
            return get_all(store, keys)
        rendezvous._get_all = slow
    if rank == victim:
        from flagos_shm import _core

        def die(*args, **kwargs):
            os._exit(3)
        _core.Communicator = die
    res = {"error": None}
    start_together(tmp, rank, world_size, SPAWN_DEADLINE_S)  # the clock leaves the ranks' start-up out
    t0 = time.monotonic()
    try:
        init_group(rank, world_size)
        x = torch.ones(4)
        dist.all_reduce(x)
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    res["elapsed"] = time.monotonic() - t0
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return res


@pytest.mark.parametrize("victim,slow_reader", [(3, False), (1, False), (1, True)])
def test_rank_dying_during_multi_node_set_up_fails_every_rank_at_once(victim, slow_reader):
    """Its node notices through the process id; it publishes the failure in the store, so the
    other node's leader stops waiting for the Gloo connection, and that leader's abort stops
    its node's ranks (before: the leaders waited the whole timeout in Gloo's connect).

    Victim 1 makes rank 0, which holds the store (``TCPStore``), fail to attach; with
    ``slow_reader`` the other node reads why 1 s late. Rank 0 used to leave at once and take
    the store along, and those ranks raised ``DistNetworkError`` instead of the cause."""
    results = spawn(setup_death_rank, 4, env=GLOO_ENV, args=(victim, slow_reader), timeout=SPAWN_DEADLINE_S,
                    rank_env={r: {"FLAGOS_SHM_NODE_ID": k} for r, k in enumerate("aabb")}, may_die=(victim,))
    for rank, res in enumerate(results):
        if rank == victim:
            continue
        print(f"set-up victim {victim}: rank {rank} raised after {res['elapsed']:.2f} s: {res['error']}")
        assert res["error"] is not None, (rank, res)
        assert res["elapsed"] < 10.0, (rank, res)
        assert "exited" in res["error"] and "DistNetworkError" not in res["error"], (rank, res)
