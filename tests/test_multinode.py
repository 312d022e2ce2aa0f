"""Groups that span nodes (issue 13), simulated on one machine.

Two "nodes" of ranks are made with ``FLAGOS_SHM_NODE_ID`` and, for some tests, by running
the second node's ranks in their own mount namespace with a private tmpfs on ``/dev/shm``
(``unshare -m``; needs root), so that they cannot open the first node's segments at all
and the node detection's probe must find that out. Gloo talks over loopback.

Each test runs fresh rank processes (``spawn.py``) with a group timeout of
:data:`GROUP_TIMEOUT_S` and a deadline; results are compared with references computed
another way (in float64 / exact integer arithmetic from every rank's inputs, which every
rank can generate), and bitwise across ranks. Both nodes' segment directories must be
empty afterwards (``spawn`` checks the first node's, :func:`private_shm_namespace` the
second's).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from support.namespaces import needs_unshare, private_shm_namespace
from support.spawn import spawn

GROUP_TIMEOUT_S = 60.0
SPAWN_DEADLINE_S = 150.0
GLOO_ENV = {"GLOO_SOCKET_IFNAME": "lo"}


def _init(rank: int, world_size: int, timeout_s: float = GROUP_TIMEOUT_S):
    import flagos_shm

    dist.init_process_group("flagos_shm", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return flagos_shm.backend.shm_part(dist.group.WORLD)


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    return hashlib.sha1(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


# ==== references ==================================================================================

_OPS = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "PRODUCT": dist.ReduceOp.PRODUCT,
        "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX, "BAND": dist.ReduceOp.BAND,
        "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR}
FACTOR = 0.5


def _input(r: int, numel: int, dtype: torch.dtype, op: str = "SUM", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + 17 * r + numel)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) < 0.5
    if dtype.is_complex:
        return torch.complex(torch.randn(numel, generator=g), torch.randn(numel, generator=g)).to(dtype)
    if dtype.is_floating_point:
        x = torch.randn(numel, generator=g)
        if op == "PRODUCT":
            x = 0.5 + torch.rand(numel, generator=g)
        return x.to(dtype)
    lo, hi = (1, 3) if op == "PRODUCT" else (-50, 50)
    if dtype == torch.uint8:
        lo, hi = (1, 3) if op == "PRODUCT" else (0, 60)
    return torch.randint(lo, hi, (numel,), generator=g).to(dtype)


def _reference(op: str, inputs: list) -> torch.Tensor:
    dtype = inputs[0].dtype
    n = len(inputs)
    if dtype == torch.bool:
        stack = torch.stack(inputs)
        if op in ("SUM", "MAX", "BOR"):
            return stack.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return stack.all(0)
        return (stack.to(torch.int64).sum(0) % 2).bool()
    if dtype.is_complex:
        s = torch.stack([x.to(torch.complex128) for x in inputs]).sum(0)
        return (s / n if op == "AVG" else s * FACTOR if op == "PREMUL_SUM" else s).to(dtype)
    if dtype.is_floating_point:
        s = torch.stack([x.double() for x in inputs])
        out = {"SUM": lambda: s.sum(0), "AVG": lambda: s.sum(0) / n, "PRODUCT": lambda: s.prod(0),
               "MIN": lambda: s.min(0).values, "MAX": lambda: s.max(0).values,
               "PREMUL_SUM": lambda: (s * FACTOR).sum(0)}[op]()
        return out.to(dtype)
    s = torch.stack([x.to(torch.int64) for x in inputs])
    out = {"SUM": lambda: s.sum(0), "AVG": lambda: torch.div(s.sum(0), n, rounding_mode="trunc"),
           "PRODUCT": lambda: s.prod(0), "MIN": lambda: s.min(0).values, "MAX": lambda: s.max(0).values}
    if op in out:
        return out[op]().to(dtype)
    acc = inputs[0].clone()
    f = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    for x in inputs[1:]:
        acc = f(acc, x)
    return acc


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype.is_floating_point or got.is_complex():
        tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(got.dtype, 1e-5)
        return torch.allclose(got.to(torch.complex128 if got.is_complex() else torch.float64),
                              want.to(torch.complex128 if want.is_complex() else torch.float64), rtol=tol, atol=tol)
    return torch.equal(got, want)


REDUCE_CASES = [(d, op) for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
                for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM")]
REDUCE_CASES += [(d, op) for d in (torch.int8, torch.uint8, torch.int32, torch.int64)
                 for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")]
REDUCE_CASES += [(torch.bool, op) for op in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")]
REDUCE_CASES += [(torch.complex64, op) for op in ("SUM", "AVG", "PREMUL_SUM")]


def _op(name: str):
    return dist._make_nccl_premul_sum(FACTOR) if name == "PREMUL_SUM" else _OPS[name]


def every_collective(rank: int, world_size: int, tmp: str, expect_nodes: list) -> dict:
    """Every collective (several dtypes, every reduce op) against references; returns the
    failures and a digest of every result (compared bitwise across ranks by the test)."""
    part = _init(rank, world_size)
    comm = part._comm
    nodes = getattr(comm, "nodes", None)
    bad, digests = [], {}
    n = world_size

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        digests[name] = _digest(got)
        if not _close(got, want):
            bad.append(f"{name}: got {got.flatten()[:6].tolist()} want {want.flatten()[:6].tolist()}")

    for numel in (1, 7, 4099):
        for dtype, op in REDUCE_CASES:
            if numel == 4099 and dtype not in (torch.float32, torch.int32):
                continue
            inputs = [_input(r, numel, dtype, op) for r in range(n)]
            x = inputs[rank].clone()
            dist.all_reduce(x, op=_op(op))
            check(f"allreduce/{dtype}/{op}/{numel}", x, _reference(op, inputs))
    # a strided (non-contiguous) view, and an async call
    base = torch.stack([_input(rank, 5, torch.float32), torch.zeros(5)], 1)
    view = base[:, 0]
    dist.all_reduce(view)
    check("allreduce/strided", base[:, 0].contiguous(),
          _reference("SUM", [_input(r, 5, torch.float32) for r in range(n)]))
    y = _input(rank, 33, torch.float32)
    w = dist.all_reduce(y, async_op=True)
    w2 = dist.all_reduce(y, async_op=True)  # reuses y before the first has completed
    w.wait()
    w2.wait()
    check("allreduce/async-twice", y, _reference("SUM", [_input(r, 33, torch.float32) for r in range(n)]) * n)
    for root in range(n):
        for dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16):
            x = _input(rank, 9, dtype, seed=root)
            dist.broadcast(x, root)
            check(f"broadcast/{dtype}/root{root}", x, _input(root, 9, dtype, seed=root))
    for root in (0, n - 1):
        for op in ("SUM", "MAX"):
            inputs = [_input(r, 11, torch.float32, op) for r in range(n)]
            x = inputs[rank].clone()
            dist.reduce(x, root, op=_op(op))
            check(f"reduce/{op}/root{root}", x, _reference(op, inputs) if rank == root else inputs[rank])
    for dtype in (torch.float32, torch.int8, torch.bool):
        inputs = [_input(r, 6, dtype) for r in range(n)]
        outs = [torch.empty(6, dtype=dtype) for _ in range(n)]
        dist.all_gather(outs, inputs[rank])
        check(f"allgather/{dtype}", torch.stack(outs), torch.stack(inputs))
        flat = torch.empty(n * 6, dtype=dtype)
        dist.all_gather_into_tensor(flat, inputs[rank])
        check(f"allgather_into_tensor/{dtype}", flat, torch.cat(inputs))
    empty = [torch.empty(0) for _ in range(n)]
    dist.all_gather(empty, torch.empty(0))
    for op in ("SUM", "AVG", "MAX"):
        inputs = [_input(r, 4 * n, torch.float32, op) for r in range(n)]
        out = torch.empty(4)
        dist.reduce_scatter_tensor(out, inputs[rank].clone(), op=_op(op))
        check(f"reduce_scatter_tensor/{op}", out, _reference(op, inputs)[4 * rank:4 * rank + 4])
        out = torch.empty(4)
        dist.reduce_scatter(out, list(inputs[rank].clone().chunk(n)), op=_op(op))
        check(f"reduce_scatter/{op}", out, _reference(op, inputs)[4 * rank:4 * rank + 4])
    for root in (0, n - 1):
        inputs = [_input(r, 5, torch.float64) for r in range(n)]
        outs = [torch.empty(5, dtype=torch.float64) for _ in range(n)] if rank == root else None
        dist.gather(inputs[rank], outs, dst=root)
        if rank == root:
            check(f"gather/root{root}", torch.stack(outs), torch.stack(inputs))
        pieces = [_input(q, 3, torch.int32, seed=7) for q in range(n)]
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
    ts = [_input(rank, k, torch.float32) for k in (3, 0, 17)]
    with dist._coalescing_manager():
        for t in ts:
            dist.all_reduce(t)
    for i, (t, k) in enumerate(zip(ts, (3, 0, 17))):
        check(f"allreduce_coalesced/{i}", t, _reference("SUM", [_input(r, k, torch.float32) for r in range(n)]))
    ins = [_input(rank, 5, torch.float32), _input(rank, 4, torch.int64)]
    outs = [torch.empty(n * 5), torch.empty(n * 4, dtype=torch.int64)]
    with dist._coalescing_manager():
        for o, t in zip(outs, ins):
            dist.all_gather_into_tensor(o, t)
    check("allgather_coalesced/f32", outs[0], torch.cat([_input(r, 5, torch.float32) for r in range(n)]))
    check("allgather_coalesced/i64", outs[1], torch.cat([_input(r, 4, torch.int64) for r in range(n)]))
    inputs = [_input(r, 2 * n, torch.float32) for r in range(n)]
    out = torch.empty(2)
    with dist._coalescing_manager():
        dist.reduce_scatter_tensor(out, inputs[rank].clone())
    check("reduce_scatter_coalesced", out, _reference("SUM", inputs)[2 * rank:2 * rank + 2])
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
    _init(rank, world_size)
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


# ==== failures ===================================================================================


def killed_rank(rank: int, world_size: int, tmp: str, victim: int, timeout_s: float) -> dict:
    _init(rank, world_size, timeout_s)
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
    res["gloo_threads"] = _gloo_threads()
    return res


def _gloo_threads() -> list:
    """Names of this process's threads that belong to Gloo (its process groups' workers,
    ``pt_gloo_runloop``, and its devices' event loops, ``gloo_tcp_loop``)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread has just exited
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)


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
    part = _init(rank, world_size)
    comm = part._comm
    res = {}
    # rank 3 (on the other node) passes another element count: every rank raises ValueError
    x = torch.ones(8 if rank != 3 else 9)
    try:
        dist.all_reduce(x)
        res["count"] = None
    except Exception as exc:  # noqa: BLE001
        res["count"] = type(exc).__name__
    # rank 2 passes an op its dtype cannot take: it raises TypeError, its peers ValueError
    y = torch.ones(4)
    try:
        dist.all_reduce(y, op=dist.ReduceOp.BAND if rank == 2 else dist.ReduceOp.SUM)
        res["invalid"] = None
    except Exception as exc:  # noqa: BLE001
        res["invalid"] = type(exc).__name__
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
    _init(rank, world_size)
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


# ==== device tensors (the emulated flagos device) ==================================================


def device_rank(rank: int, world_size: int, tmp: str) -> dict:
    import flagos_shm.emulation

    flagos_shm.emulation.enable()
    part = _init(rank, world_size)
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
    t0 = time.monotonic()
    try:
        _init(rank, world_size)
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
