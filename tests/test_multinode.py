"""Groups that span nodes (issue 13), simulated on one machine.

Two "nodes" of ranks are made with ``FLAGOS_SHM_NODE_ID`` and, for some tests, by running
the second node's ranks in their own mount namespace with a private tmpfs on ``/dev/shm``
(``unshare -m``; needs root), so that they cannot open the first node's segments at all
and the node detection's probe must find that out. Gloo talks over loopback.

Each test runs fresh rank processes (``support/spawn.py``) with a group timeout of
:data:`support.multinode.GROUP_TIMEOUT_S` and a deadline; results are compared with
references computed another way (in float64 / exact integer arithmetic from every rank's inputs, which every
rank can generate), and bitwise across ranks. Both nodes' segment directories must be
empty afterwards (``spawn`` checks the first node's, :func:`private_shm_namespace` the
second's).

Failures across nodes (a killed rank, disagreement, set-up deaths): ``test_multinode_failures.py``.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from support.multinode import (GLOO_ENV, REDUCE_CASES, SPAWN_DEADLINE_S, close_enough, digest, init_group, input_of,
                               op_of, reference_of)
from support.namespaces import needs_unshare, private_shm_namespace
from support.spawn import spawn


def every_collective(rank: int, world_size: int, tmp: str, expect_nodes: list) -> dict:
    """Every collective (several dtypes, every reduce op) against references; returns the
    failures and a digest of every result (compared bitwise across ranks by the test)."""
    part = init_group(rank, world_size)
    comm = part._comm
    nodes = getattr(comm, "nodes", None)
    bad, digests = [], {}
    n = world_size

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        digests[name] = digest(got)
        if not close_enough(got, want):
            bad.append(f"{name}: got {got.flatten()[:6].tolist()} want {want.flatten()[:6].tolist()}")

    for numel in (1, 7, 4099):
        for dtype, op in REDUCE_CASES:
            if numel == 4099 and dtype not in (torch.float32, torch.int32):
                continue
            inputs = [input_of(r, numel, dtype, op) for r in range(n)]
            x = inputs[rank].clone()
            dist.all_reduce(x, op=op_of(op))
            check(f"allreduce/{dtype}/{op}/{numel}", x, reference_of(op, inputs))
    # a strided (non-contiguous) view, and an async call
    base = torch.stack([input_of(rank, 5, torch.float32), torch.zeros(5)], 1)
    view = base[:, 0]
    dist.all_reduce(view)
    check("allreduce/strided", base[:, 0].contiguous(),
          reference_of("SUM", [input_of(r, 5, torch.float32) for r in range(n)]))
    y = input_of(rank, 33, torch.float32)
    w = dist.all_reduce(y, async_op=True)
    w2 = dist.all_reduce(y, async_op=True)  # reuses y before the first has completed
    w.wait()
    w2.wait()
    check("allreduce/async-twice", y, reference_of("SUM", [input_of(r, 33, torch.float32) for r in range(n)]) * n)
    for root in range(n):
        for dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16):
            x = input_of(rank, 9, dtype, seed=root)
            dist.broadcast(x, root)
            check(f"broadcast/{dtype}/root{root}", x, input_of(root, 9, dtype, seed=root))
    for root in (0, n - 1):
        for op in ("SUM", "MAX"):
            inputs = [input_of(r, 11, torch.float32, op) for r in range(n)]
            x = inputs[rank].clone()
            dist.reduce(x, root, op=op_of(op))
            check(f"reduce/{op}/root{root}", x, reference_of(op, inputs) if rank == root else inputs[rank])
    for dtype in (torch.float32, torch.int8, torch.bool):
        inputs = [input_of(r, 6, dtype) for r in range(n)]
        outs = [torch.empty(6, dtype=dtype) for _ in range(n)]
        dist.all_gather(outs, inputs[rank])
        check(f"allgather/{dtype}", torch.stack(outs), torch.stack(inputs))
        flat = torch.empty(n * 6, dtype=dtype)
        dist.all_gather_into_tensor(flat, inputs[rank])
        check(f"allgather_into_tensor/{dtype}", flat, torch.cat(inputs))
    empty = [torch.empty(0) for _ in range(n)]
    dist.all_gather(empty, torch.empty(0))
    for op in ("SUM", "AVG", "MAX"):
        inputs = [input_of(r, 4 * n, torch.float32, op) for r in range(n)]
        out = torch.empty(4)
        dist.reduce_scatter_tensor(out, inputs[rank].clone(), op=op_of(op))
        check(f"reduce_scatter_tensor/{op}", out, reference_of(op, inputs)[4 * rank:4 * rank + 4])
        out = torch.empty(4)
        dist.reduce_scatter(out, list(inputs[rank].clone().chunk(n)), op=op_of(op))
        check(f"reduce_scatter/{op}", out, reference_of(op, inputs)[4 * rank:4 * rank + 4])
    for root in (0, n - 1):
        inputs = [input_of(r, 5, torch.float64) for r in range(n)]
        outs = [torch.empty(5, dtype=torch.float64) for _ in range(n)] if rank == root else None
        dist.gather(inputs[rank], outs, dst=root)
        if rank == root:
            check(f"gather/root{root}", torch.stack(outs), torch.stack(inputs))
        pieces = [input_of(q, 3, torch.int32, seed=7) for q in range(n)]
        out = torch.empty(3, dtype=torch.int32)
        dist.scatter(out, pieces if rank == root else None, src=root)
        check(f"scatter/root{root}", out, pieces[rank])
    # all-to-all: even, uneven splits, lists
    send = torch.arange(2 * n, dtype=torch.float32) + 100 * rank
    got = torch.empty(2 * n)
    dist.all_to_all_single(got, send)
    want = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * q for q in range(n)])
    check("all_to_all_single", got, want)
    in_splits = [(rank + q) % 3 + 1 for q in range(n)]
    out_splits = [(q + rank) % 3 + 1 for q in range(n)]
    send = torch.full((sum(in_splits),), float(rank))
    got = torch.empty(sum(out_splits))
    dist.all_to_all_single(got, send, out_splits, in_splits)
    check("all_to_all_single/uneven", got, torch.cat([torch.full((out_splits[q],), float(q)) for q in range(n)]))
    outs = [torch.empty(2, dtype=torch.int64) for _ in range(n)]
    dist.all_to_all(outs, [torch.tensor([rank, q]) for q in range(n)])
    check("all_to_all", torch.stack(outs), torch.stack([torch.tensor([q, rank]) for q in range(n)]))
    # uneven with zeros, asynchronous (alltoallv), and sizes that disagree (on every rank)
    in_splits, out_splits = [(rank * q) % 3 for q in range(n)], [(q * rank) % 3 for q in range(n)]
    got = torch.empty(sum(out_splits))
    dist.all_to_all_single(got, torch.full((sum(in_splits),), float(rank)), out_splits, in_splits,
                           async_op=True).wait()
    check("all_to_all_single/uneven-async", got, torch.cat([torch.full((out_splits[q],), float(q)) for q in range(n)]))
    wrong = [2 + (rank == 1 and q == 0) for q in range(n)]
    try:
        dist.all_to_all_single(torch.empty(2 * n), torch.ones(sum(wrong)), [2] * n, wrong)
        bad.append("all_to_all_single/mismatch: no error")
    except ValueError as exc:
        if "rank 1 sends 3 elements to rank 0" not in str(exc):
            bad.append(f"all_to_all_single/mismatch: {exc}")
    # coalesced batches (mixed sizes, and dtypes for the gathers)
    ts = [input_of(rank, k, torch.float32) for k in (3, 0, 17)]
    with dist._coalescing_manager():
        for t in ts:
            dist.all_reduce(t)
    for i, (t, k) in enumerate(zip(ts, (3, 0, 17))):
        check(f"allreduce_coalesced/{i}", t, reference_of("SUM", [input_of(r, k, torch.float32) for r in range(n)]))
    ins = [input_of(rank, 5, torch.float32), input_of(rank, 4, torch.int64)]
    outs = [torch.empty(n * 5), torch.empty(n * 4, dtype=torch.int64)]
    with dist._coalescing_manager():
        for o, t in zip(outs, ins):
            dist.all_gather_into_tensor(o, t)
    check("allgather_coalesced/f32", outs[0], torch.cat([input_of(r, 5, torch.float32) for r in range(n)]))
    check("allgather_coalesced/i64", outs[1], torch.cat([input_of(r, 4, torch.int64) for r in range(n)]))
    inputs = [input_of(r, 2 * n, torch.float32) for r in range(n)]
    out = torch.empty(2)
    with dist._coalescing_manager():
        dist.reduce_scatter_tensor(out, inputs[rank].clone())
    check("reduce_scatter_coalesced", out, reference_of("SUM", inputs)[2 * rank:2 * rank + 2])
    dist.barrier()
    # object collectives (uint8/int64 broadcast and allgather underneath)
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank})
    if objs != [{"rank": r} for r in range(n)]:
        bad.append(f"all_gather_object: {objs}")
    # subgroups: inside one node (pure shared memory) and across nodes
    subgroups = {}
    for members in ([0, 1], [1, 2], [0, 2, 3], [3, 2]):
        g = dist.new_group(sorted(members))
        if rank in members:
            x = torch.full((3,), float(rank + 1))
            dist.all_reduce(x, group=g)
            want = torch.full((3,), float(sum(m + 1 for m in members)))
            check(f"subgroup/{sorted(members)}", x, want)
            import flagos_shm

            sub = flagos_shm.backend.shm_part(g)
            subgroups[str(sorted(members))] = getattr(sub._comm, "nodes", None)
    dist.destroy_process_group()
    return {"bad": bad, "digests": digests, "nodes": nodes, "expect": expect_nodes, "subgroups": subgroups}


def _check_collectives(results: list, expect_nodes: list) -> None:
    for rank, res in enumerate(results):
        assert res["nodes"] == expect_nodes, (rank, res["nodes"])
        assert not res["bad"], f"rank {rank}: " + "\n".join(res["bad"])
    first = results[0]["digests"]
    for rank, res in enumerate(results[1:], 1):
        differ = [k for k, v in res["digests"].items() if k in first and first[k] != v and "reduce/" not in k
                  and "gather/" not in k and "scatter" not in k and "all_to_all" not in k]
        assert not differ, f"rank {rank} differs bitwise from rank 0 in {differ[:10]}"
    # which subgroups are hierarchical: exactly those whose members span nodes
    node_of = {r: k for k, m in enumerate(expect_nodes) for r in m}
    for res in results:
        for members, nodes in res["subgroups"].items():
            ranks = eval(members)
            spans = len({node_of[r] for r in ranks}) > 1
            assert (nodes is not None) == spans, (members, nodes)


def test_two_nodes_by_node_id_every_collective():
    """2 nodes x 2 ranks by FLAGOS_SHM_NODE_ID: every collective, op and dtype."""
    layout = ["a", "a", "b", "b"]
    results = spawn(every_collective, 4, env=GLOO_ENV, args=([[0, 1], [2, 3]],), timeout=SPAWN_DEADLINE_S,
                    rank_env={r: {"FLAGOS_SHM_NODE_ID": k} for r, k in enumerate(layout)})
    _check_collectives(results, [[0, 1], [2, 3]])


@pytest.mark.parametrize("layout,nodes", [
    (["a", "a", "a", "b"], [[0, 1, 2], [3]]),      # 3 + 1: a node with a single rank
    (["a", "b", "a", "b"], [[0, 2], [1, 3]]),      # non-contiguous placement
])
def test_uneven_layouts_every_collective(layout, nodes):
    results = spawn(every_collective, 4, env=GLOO_ENV, args=(nodes,), timeout=SPAWN_DEADLINE_S,
                    rank_env={r: {"FLAGOS_SHM_NODE_ID": k} for r, k in enumerate(layout)})
    _check_collectives(results, nodes)


@needs_unshare
def test_second_node_in_its_own_mount_namespace_is_detected():
    """Ranks 2 and 3 run with a private /dev/shm (their own mount namespace): no
    FLAGOS_SHM_NODE_ID, the probe finds that they cannot open rank 0's segment and makes them
    a second node; every collective works; both /dev/shm are clean afterwards."""
    with private_shm_namespace() as (prefix, leftovers):
        results = spawn(every_collective, 4, env=GLOO_ENV, args=([[0, 1], [2, 3]],), timeout=SPAWN_DEADLINE_S,
                        wrap={2: prefix, 3: prefix})
        assert leftovers() == []
    _check_collectives(results, [[0, 1], [2, 3]])


# ==== DDP ========================================================================================


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _batches(steps: int, world: int):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 1, generator=g)) for _ in range(steps)]


def ddp_rank(rank: int, world_size: int, tmp: str, steps: int) -> list:
    init_group(rank, world_size)
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(steps, world_size):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4]).backward()
        opt.step()
    params = [p.detach().reshape(-1).tolist() for p in model.module.parameters()]
    dist.destroy_process_group()
    return params


def test_ddp_on_two_nodes_trains_like_one_process():
    steps = 5
    results = spawn(ddp_rank, 4, env=GLOO_ENV, args=(steps,), timeout=SPAWN_DEADLINE_S,
                    rank_env={r: {"FLAGOS_SHM_NODE_ID": k} for r, k in enumerate("aabb")})
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(steps, 4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    want = [p.detach().reshape(-1) for p in model.parameters()]
    for rank, params in enumerate(results):
        assert params == results[0], f"rank {rank}'s parameters differ from rank 0's"
        for got, w in zip(params, want):
            assert torch.allclose(torch.tensor(got), w, atol=1e-5), rank


# ==== device tensors (the emulated flagos device) ==================================================


def device_rank(rank: int, world_size: int, tmp: str) -> dict:
    import flagos_shm.emulation

    flagos_shm.emulation.enable()
    part = init_group(rank, world_size)
    dev = torch.device("flagos", rank % 2)
    bad = []
    n = world_size
    x = torch.full((1000,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    if not torch.equal(x.cpu(), torch.full((1000,), float(n * (n + 1) / 2))):
        bad.append(f"allreduce: {x.cpu()[:4].tolist()}")
    h = (torch.arange(6, dtype=torch.bfloat16) * (rank + 1)).to(dev)
    w = dist.all_reduce(h, op=dist.ReduceOp.AVG, async_op=True)
    w.wait()
    want = (torch.arange(6, dtype=torch.float32) * sum(range(1, n + 1)) / n).to(torch.bfloat16)
    if not torch.equal(h.cpu(), want):
        bad.append(f"allreduce bf16 AVG: {h.cpu().tolist()} != {want.tolist()}")
    b = torch.arange(5, device=dev) if rank == 3 else torch.zeros(5, dtype=torch.int64, device=dev)
    dist.broadcast(b, 3)
    if not torch.equal(b.cpu(), torch.arange(5)):
        bad.append(f"broadcast: {b.cpu().tolist()}")
    out = torch.empty(n * 3, device=dev)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank), device=dev))
    if not torch.equal(out.cpu(), torch.arange(n).float().repeat_interleave(3)):
        bad.append(f"allgather: {out.cpu().tolist()}")
    nodes = part._comm.nodes
    dist.destroy_process_group()
    return {"bad": bad, "nodes": nodes}


def test_device_tensors_on_two_nodes():
    """flagos (emulated) tensors are staged to host memory once; the Gloo step works on it."""
    results = spawn(device_rank, 4, env=GLOO_ENV, timeout=SPAWN_DEADLINE_S,
                    rank_env={r: {"FLAGOS_SHM_NODE_ID": k} for r, k in enumerate("aabb")})
    for rank, res in enumerate(results):
        assert res["nodes"] == [[0, 1], [2, 3]], res
        assert not res["bad"], (rank, res["bad"])


def callbacks_rank(rank: int, world_size: int, tmp: str) -> dict:
    """test_async's callbacks that issue collectives, and torch's PowerSGD DDP hook on several
    buckets, on a group that spans nodes (its calls go through the hierarchy's worker)."""
    from test_async import (rank_callbacks_issue_while_calls_wait, rank_collectives_from_callbacks,
                            rank_futures_taken_late, rank_powersgd)

    init_group(rank, world_size)
    try:
        return {"callbacks": rank_collectives_from_callbacks("cpu"),
                "beside_calls": rank_callbacks_issue_while_calls_wait(5),
                "late": rank_futures_taken_late(5),
                "powersgd": rank_powersgd(4, 6, 0.02)}
    finally:
        dist.destroy_process_group()


def test_callbacks_that_issue_collectives_on_two_nodes():
    """Before, a callback's call waited forever for the worker that was running the callback."""
    from test_async import check_collectives_from_callbacks

    n = 3
    results = spawn(callbacks_rank, n, env=GLOO_ENV, timeout=SPAWN_DEADLINE_S,
                    rank_env={r: {"FLAGOS_SHM_NODE_ID": k} for r, k in enumerate("aab")})
    check_collectives_from_callbacks([res["callbacks"] for res in results], n)
    for res in results:
        assert res["beside_calls"] == {"values": [[n * (n + 1) / 2]] * 5, "issued": 3}, res
        assert res["late"] == {"shared": [6.0, 600.0, 3.0, 3.0, 3.0], "nested": [6.0, 60.0, 600.0],
                               "waiters": [[6.0]] * 5, "waits_later": [[6.0, 60.0, 600.0, 6000.0]] * 6,
                               "waited_state": [[True, True]] * 5, "waited_failed": [[True, False, True]]}, res
        assert res["powersgd"]["buckets"] >= 4 and res["powersgd"]["equal_to_inline"], res
        assert res["powersgd"]["moved"], res
