"""Point-to-point in groups that span nodes (issue 13), simulated on one machine as in
``test_multinode.py``: 2 nodes x 2 ranks (``FLAGOS_SHM_NODE_ID``, and for one test the
second node in its own mount namespace with a private ``/dev/shm``, so that nothing can
cross between the nodes through shared memory). Pairs inside a node use shared-memory
channels, pairs across nodes Gloo (``flagos_shm/backend/hierarchy/p2p.py``).

Values are checked against what the sender generates (every rank can generate every
rank's tensors from a seed); a pipeline-style exchange against the same stages computed
in one process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import torch
import torch.distributed as dist
from support.multinode import GLOO_ENV, SPAWN_DEADLINE_S, gloo_threads, init_group
from support.namespaces import needs_unshare, private_shm_namespace
from support.spawn import spawn

NODE_ENV = {r: {"FLAGOS_SHM_NODE_ID": k} for r, k in enumerate("aabb")}
DTYPES = (torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.uint8)


def _msg(src: int, dst: int, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100000 * seed + 1000 * src + 10 * dst + numel)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) < 0.5
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(0, 100, (numel,), generator=g).to(dtype)


def _stage(k: int, x: torch.Tensor) -> torch.Tensor:
    """Pipeline stage ``k``'s computation (deterministic, the same in every process)."""
    w = torch.Generator().manual_seed(77 + k)
    return torch.tanh(x @ torch.randn(x.shape[1], x.shape[1], generator=w)) + k


def exchange_rank(rank: int, world_size: int, tmp: str) -> dict:
    part = init_group(rank, world_size)
    n = world_size
    bad = []

    def check(name, got, want):
        if got.dtype != want.dtype or not torch.equal(got, want):
            bad.append(f"{name}: got {got.flatten()[:5].tolist()} want {want.flatten()[:5].tolist()}")

    # every ordered pair at once (isend/irecv), several dtypes and sizes: 0 elements, one
    # element, and 1 MiB + 1 element (more than a channel's slots), in-node and cross-node
    works, recvs = [], []
    for i, (numel, dtype) in enumerate([(0, torch.float32), (1, torch.int64), (262145, torch.float32)]
                                       + [(33, d) for d in DTYPES]):
        for peer in range(n):
            if peer == rank:
                continue
            works.append(dist.isend(_msg(rank, peer, numel, dtype, i), peer, tag=i))
            out = torch.empty(numel, dtype=dtype)
            recvs.append((f"all-pairs/{peer}->{rank}/{dtype}/{numel}", out, _msg(peer, rank, numel, dtype, i)))
            works.append(dist.irecv(out, peer, tag=i))
    for w in works:
        w.wait()
    for name, got, want in recvs:
        check(name, got, want)
    # order per (source, destination, tag), and tags received out of order: rank 0 -> 2
    # (across nodes) and 0 -> 1 (in the node) send tag 5 three times, then tag 1; the
    # receiver takes tag 1 first
    for dst in (1, 2):
        if rank == 0:
            ws = [dist.isend(torch.full((4,), float(10 * dst + j)), dst, tag=5) for j in range(3)]
            ws.append(dist.isend(torch.full((2,), -1.0), dst, tag=1))
            for w in ws:
                w.wait()
        elif rank == dst:
            first = torch.empty(2)
            dist.recv(first, 0, tag=1)
            check(f"tag1-first/{dst}", first, torch.full((2,), -1.0))
            for j in range(3):
                got = torch.empty(4)
                dist.recv(got, 0, tag=5)
                check(f"in-order/{dst}/{j}", got, torch.full((4,), float(10 * dst + j)))
    # a ring with batch_isend_irecv: 1 -> 2 and 3 -> 0 cross nodes
    out = torch.empty(8, dtype=torch.float64)
    ops = [dist.P2POp(dist.isend, _msg(rank, (rank + 1) % n, 8, torch.float64, 9), (rank + 1) % n, tag=3),
           dist.P2POp(dist.irecv, out, (rank - 1) % n, tag=3)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    check("ring", out, _msg((rank - 1) % n, rank, 8, torch.float64, 9))
    # a pipeline: stage k = rank, forward 0 -> 1 -> 2 -> 3, then the result back 3 -> 0
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(4)) if rank == 0 else torch.empty(6, 5)
    if rank > 0:
        dist.recv(x, rank - 1, tag=7)
    y = _stage(rank, x)
    dist.send(y, (rank + 1) % n, tag=7 if rank < n - 1 else 8)
    if rank == 0:
        final = torch.empty(6, 5)
        dist.recv(final, n - 1, tag=8)
        want = torch.randn(6, 5, generator=torch.Generator().manual_seed(4))
        for k in range(n):
            want = _stage(k, want)
        check("pipeline", final, want)
    # recv from any source: not across nodes (NotImplementedError, a RuntimeError), but
    # inside a node's subgroup
    try:
        dist.irecv(torch.empty(1))
        bad.append("recv_anysource across nodes did not raise")
    except RuntimeError as exc:
        if "spans nodes" not in str(exc):
            bad.append(f"recv_anysource: {exc}")
    sub = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    lo = 2 * (rank // 2)
    if rank == lo:
        got = torch.empty(3)
        w = dist.irecv(got, group=sub)
        w.wait()
        check("anysource-in-node", got, torch.full((3,), float(lo + 1)))
    else:
        dist.send(torch.full((3,), float(rank)), lo, group=sub)
    # tags beyond Gloo's range (across nodes only) raise on this rank
    try:
        dist.send(torch.ones(1), (rank + 2) % n, tag=1 << 29)
        bad.append("tag 2**29 across nodes did not raise")
    except ValueError as exc:
        if "tag" not in str(exc):
            bad.append(f"big tag: {exc}")
    channels = sorted(part._mailbox.channels)
    dist.barrier()
    dist.destroy_process_group()
    return {"bad": bad, "channels": channels}


def _check_exchange(results: list) -> None:
    for rank, res in enumerate(results):
        assert not res["bad"], f"rank {rank}: " + "\n".join(res["bad"])
        # shared-memory channels only with the rank of its own node (cross-node pairs: Gloo)
        assert res["channels"] == [rank ^ 1], (rank, res["channels"])


def test_p2p_between_and_inside_simulated_nodes():
    results = spawn(exchange_rank, 4, env=GLOO_ENV, timeout=SPAWN_DEADLINE_S, rank_env=NODE_ENV)
    _check_exchange(results)


@needs_unshare
def test_p2p_with_the_second_node_in_its_own_mount_namespace():
    """Nothing can cross between the nodes through /dev/shm: cross-node messages must go
    through Gloo."""
    with private_shm_namespace() as (prefix, leftovers):
        results = spawn(exchange_rank, 4, env=GLOO_ENV, timeout=SPAWN_DEADLINE_S, wrap={2: prefix, 3: prefix})
        assert leftovers() == []
    _check_exchange(results)


def failure_rank(rank: int, world_size: int, tmp: str, timeout_s: float) -> dict:
    init_group(rank, world_size, timeout_s)
    res = {}
    # size mismatch across nodes (1 -> 2) and inside a node (2 -> 3): both sides raise
    # ValueError, and the pair stays usable
    for src, dst in ((1, 2), (2, 3)):
        if rank in (src, dst):
            try:
                if rank == src:
                    dist.send(torch.ones(5), dst, tag=2)
                else:
                    dist.recv(torch.empty(7), src, tag=2)
                res[f"mismatch{src}{dst}"] = None
            except Exception as exc:  # noqa: BLE001
                res[f"mismatch{src}{dst}"] = type(exc).__name__
                res[f"mismatch{src}{dst}-msg"] = str(exc)[:300]
            t = torch.full((3,), 4.0) if rank == src else torch.empty(3)
            (dist.send if rank == src else dist.recv)(t, dst if rank == src else src, tag=2)
            res[f"after{src}{dst}"] = t.tolist()
    # a dead peer on the other node: rank 3 exchanges a message with rank 0, then is killed
    # while rank 0 waits for its next message
    if rank in (0, 3):
        t = torch.ones(2)
        (dist.send if rank == 3 else dist.recv)(t, 3 - rank, tag=4)
    if rank == 3:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.recv(torch.empty(2), 3, tag=4)
            res["dead"] = None
        except Exception as exc:  # noqa: BLE001
            res["dead"] = f"{type(exc).__name__}: {exc}"[:400]
        res["dead_s"] = time.monotonic() - t0
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    res["gloo_threads"] = gloo_threads()
    return res


def test_p2p_mismatch_and_dead_peer_across_nodes_raise_clearly():
    timeout_s = 30.0
    results = spawn(failure_rank, 4, env=GLOO_ENV, args=(timeout_s,), timeout=SPAWN_DEADLINE_S, rank_env=NODE_ENV,
                    may_die=(3,))
    assert results[3] is None
    for src, dst in ((1, 2), (2, 3)):
        for r in (src, dst):
            if r == 3:
                continue
            res = results[r]
            assert res[f"mismatch{src}{dst}"] == "ValueError", (r, res)
            assert "bytes" in res[f"mismatch{src}{dst}-msg"], (r, res)
            assert res[f"after{src}{dst}"] == [4.0] * 3, (r, res)
    dead = results[0]
    print(f"rank 0, peer killed: raised after {dead['dead_s']:.2f} s: {dead['dead']}")
    assert dead["dead"] is not None and dead["dead"].startswith("RuntimeError"), dead
    assert "group rank 3" in dead["dead"], dead
    assert dead["dead_s"] < timeout_s, dead
    # the failed receive's error holds no Gloo group: destroying the group freed them all
    for r in (0, 1, 2):
        assert results[r]["gloo_threads"] == [], (r, results[r])
