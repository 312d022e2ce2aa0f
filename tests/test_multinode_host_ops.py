"""The multi-node hierarchy's leaders combine, convert and copy on their own thread
(``_core.reduce_into`` / ``convert_into``, ``staging.copy_into``), not on torch's intra-op
thread pool, which torch uses for a CPU op of 32768 elements or more and whose threads
outnumber the CPUs when every rank of a node has one (docs/benchmark.md, "torch's copy
threads").

Checked three ways: the host helpers against the torch formula the hierarchy used before
(bitwise, in this process); every op and dtype through simulated nodes
(``FLAGOS_SHM_NODE_ID``, as ``test_multinode.py``) against references computed in float64 /
exact integers from every rank's inputs; and, while those calls run, a count of the torch
ops of at least the grain that the hierarchy's jobs run (a dispatch mode entered on the
group's worker thread around each job), which must be none.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.multinode import (GLOO_ENV, REDUCE_CASES, SPAWN_DEADLINE_S, close_enough, init_group, input_of, op_of,
                               reference_of)
from support.spawn import spawn

pytestmark = pytest.mark.timeout(300)

GRAIN = 32768  # staging._TORCH_GRAIN
#: aten ops that move no element (allocation, views, metadata).
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "_unsafe_view", "slice",
         "select", "alias", "as_strided", "detach", "unsqueeze", "squeeze", "reshape", "_reshape_alias", "t",
         "expand", "split", "split_with_sizes", "chunk", "unbind", "lift_fresh", "set_", "resize_", "view_as_real",
         "view_as_complex", "_neg_view", "_conj", "resolve_conj", "resolve_neg", "is_same_size", "sym_size",
         "sym_numel", "sym_stride", "sym_storage_offset"}


def _count_big_ops(comm) -> list:
    """Install on ``comm`` (a HierarchicalComm) a wrapper that runs each job under a
    dispatch mode recording the aten ops that touch a tensor of at least :data:`GRAIN`
    elements; returns the list it appends their names to."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    big = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace == "aten" and func.overloadpacket.__name__ not in _FREE:
                flat = tree_flatten((args, kwargs, out))[0]
                if any(isinstance(t, torch.Tensor) and t.numel() >= GRAIN for t in flat):
                    big.append(str(func))
            return out

    guarded = comm._guarded

    def counted(fn):
        def job():
            with Count():
                fn()
        return guarded(job)
    comm._guarded = counted
    return big


def host_ops_rank(rank: int, world_size: int, tmp: str, cases: list, numel: int) -> dict:
    part = init_group(rank, world_size)
    comm = part._comm
    big = _count_big_ops(comm)
    n = world_size
    bad, counts = [], {}

    def check(name, got, want, before):
        counts[name] = big[before:]
        if not close_enough(got, want):
            bad.append(f"{name}: got {got.flatten()[:6].tolist()} want {want.flatten()[:6].tolist()}")

    for dtype_name, op in cases:
        dtype = getattr(torch, dtype_name)
        inputs = [input_of(r, numel, dtype, op) for r in range(n)]
        want = reference_of(op, inputs)
        x, mark = inputs[rank].clone(), len(big)
        dist.all_reduce(x, op=op_of(op))
        check(f"allreduce/{dtype_name}/{op}", x, want, mark)
        x, mark = inputs[rank].clone(), len(big)
        dist.reduce(x, n - 1, op=op_of(op))
        check(f"reduce/{dtype_name}/{op}", x, want if rank == n - 1 else inputs[rank], mark)
    k = numel // n
    inputs = [input_of(r, n * k, torch.float32) for r in range(n)]
    out, mark = torch.empty(k), len(big)
    dist.reduce_scatter_tensor(out, inputs[rank], op=dist.ReduceOp.AVG)
    check("reduce_scatter_tensor/AVG", out, reference_of("AVG", inputs)[rank * k:(rank + 1) * k], mark)
    flat, mark = torch.empty(n * numel, dtype=torch.int32), len(big)
    dist.all_gather_into_tensor(flat, input_of(rank, numel, torch.int32))
    check("allgather", flat, torch.cat([input_of(r, numel, torch.int32) for r in range(n)]), mark)
    outs = [torch.empty(numel, dtype=torch.int32) for _ in range(n)] if rank == 0 else None
    mark = len(big)
    dist.gather(input_of(rank, numel, torch.int32), outs, dst=0)
    if rank == 0:
        check("gather", torch.cat(outs), torch.cat([input_of(r, numel, torch.int32) for r in range(n)]), mark)
    pieces = [input_of(q, numel, torch.float64, seed=3) for q in range(n)]
    got, mark = torch.empty(numel, dtype=torch.float64), len(big)
    dist.scatter(got, pieces if rank == n - 1 else None, src=n - 1)
    check("scatter", got, pieces[rank], mark)
    ins = [input_of(rank, numel, torch.float32), input_of(rank, numel + 1, torch.float32)]
    outs = [torch.empty(numel // n), torch.empty(numel // n)]
    mark = len(big)
    with dist._coalescing_manager():
        dist.reduce_scatter_tensor(outs[0], ins[0][:n * (numel // n)])
    want = reference_of("SUM", [input_of(r, numel, torch.float32)[:n * (numel // n)] for r in range(n)])
    check("reduce_scatter_coalesced", outs[0], want[rank * (numel // n):(rank + 1) * (numel // n)], mark)
    paths = getattr(comm, "last_reduce_path", None)
    dist.destroy_process_group()
    return {"bad": bad, "counts": {k: v for k, v in counts.items() if v}, "path": paths}


_CASES = [(str(d).split(".")[1], op) for d, op in REDUCE_CASES]


def _check(results):
    for rank, res in enumerate(results):
        assert not res["bad"], f"rank {rank}: " + "\n".join(res["bad"][:20])
        assert not res["counts"], f"rank {rank}: torch ops of >= {GRAIN} elements in the hierarchy: {res['counts']}"


def test_one_rank_per_node_every_op_and_dtype():
    """2 ranks on 2 simulated nodes (leaders only): every op and dtype of the one-node path."""
    results = spawn(host_ops_rank, 2, env=GLOO_ENV, args=(_CASES, GRAIN + 37), timeout=SPAWN_DEADLINE_S,
                    rank_env={r: {"FLAGOS_SHM_NODE_ID": k} for r, k in enumerate("ab")})
    _check(results)


@pytest.mark.parametrize("rs_min", ["0", "off"])
def test_two_by_two_both_paths(rs_min):
    """2 + 2 ranks: the reduce-scatter path (threshold 0; the last chunk padded) and the
    leader path (off), for the ops and dtypes that convert (float16/bfloat16 in float32,
    integer AVG in int64), scale (PREMUL_SUM) or are logical (bool)."""
    cases = [("float32", "SUM"), ("float32", "PREMUL_SUM"), ("float16", "AVG"), ("bfloat16", "SUM"),
             ("int8", "AVG"), ("uint8", "PRODUCT"), ("int32", "BXOR"), ("int64", "AVG"), ("bool", "MIN"),
             ("float64", "MAX"), ("complex64", "AVG")]
    results = spawn(host_ops_rank, 4, env=GLOO_ENV, args=(cases, GRAIN + 37), timeout=SPAWN_DEADLINE_S,
                    rank_env={r: {"FLAGOS_SHM_NODE_ID": k, "FLAGOS_SHM_HIER_RS_MIN_BYTES": rs_min}
                              for r, k in enumerate("aabb")})
    _check(results)
    assert {res["path"] for res in results} == {"reduce_scatter" if rs_min == "0" else "leader"}


# ---- the host helpers against the torch formula they replace (in this process) ----------


def _old_combine(rows: torch.Tensor, op: str, n: int) -> torch.Tensor:
    """What the hierarchy computed before with torch ops, from the leaders' rows (node order)."""
    ops = {"SUM": torch.add, "PREMUL_SUM": torch.add, "AVG": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum,
           "MAX": torch.maximum, "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}
    if rows.dtype == torch.bool:
        ops.update(SUM=torch.logical_or, MAX=torch.logical_or, BOR=torch.logical_or, PRODUCT=torch.logical_and,
                   MIN=torch.logical_and, BAND=torch.logical_and, BXOR=torch.logical_xor)
    result = ops[op](rows[0], rows[1])
    for k in range(2, rows.shape[0]):
        result = ops[op](result, rows[k])
    if op == "AVG":
        if result.dtype.is_floating_point:
            result = result / torch.tensor(n, dtype=result.dtype)
        else:
            result = torch.div(result, n, rounding_mode="trunc")
    return result


@pytest.mark.parametrize("dtype,op", [(d, o) for d, o in REDUCE_CASES if not d.is_complex])
def test_host_helpers_equal_the_torch_formula_bitwise(dtype, op):
    from flagos_shm.backend import options
    from flagos_shm.backend.hierarchy import host

    numel, m, n = GRAIN + 3, 3, 5
    acc = host._acc_dtype(dtype, options.PREMUL_SUM if op == "PREMUL_SUM" else getattr(options, op))
    rows = torch.stack([input_of(r, numel, acc if acc != torch.int64 or dtype == torch.int64 else dtype, op, seed=9)
                        .to(acc) for r in range(m)])
    code = options.SUM if op == "PREMUL_SUM" else getattr(options, op)
    got = torch.empty(numel, dtype=acc)
    host._reduce_into(got, list(rows), code, world=n)
    want = _old_combine(rows, op, n)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (dtype, op)
    final = torch.empty(numel, dtype=dtype)
    host._convert(final, got)
    assert torch.equal(final.view(torch.uint8), want.to(dtype).view(torch.uint8)), (dtype, op)
    if op == "PREMUL_SUM":  # one rank per node: the leader scales its own row first
        scaled = torch.empty_like(rows[0])
        host._reduce_into(scaled, [rows[0]], options.PREMUL_SUM, 0.37)
        assert torch.equal(scaled, rows[0] * 0.37)
    wide = host._clone(final, acc) if acc != dtype else host._clone(final)
    assert torch.equal(wide, final.to(acc))


def test_host_helpers_reject_bad_buffers():
    from flagos_shm import _core
    from flagos_shm.backend import options

    x = torch.zeros(8)
    with pytest.raises(ValueError, match=r"srcs\[1\]"):
        _core.reduce_into(x.data_ptr(), 32, [x.data_ptr(), x.data_ptr()], [32, 16], 8, "float32", options.SUM)
    with pytest.raises(ValueError, match="dst"):
        _core.reduce_into(x.data_ptr(), 16, [x.data_ptr()], [32], 8, "float32", options.SUM)
    with pytest.raises(ValueError, match="overlap"):
        _core.reduce_into(x.data_ptr(), 16, [x.data_ptr() + 4], [16], 4, "float32", options.SUM)
    with pytest.raises(ValueError, match="aligned"):
        _core.reduce_into(x.data_ptr() + 1, 16, [x.data_ptr() + 16], [16], 2, "float32", options.SUM)
    with pytest.raises(ValueError, match="world"):
        _core.reduce_into(x.data_ptr(), 32, [x.data_ptr()], [32], 8, "float32", options.AVG, 1.0, 0)
    with pytest.raises(TypeError, match="BAND"):
        _core.reduce_into(x.data_ptr(), 32, [x.data_ptr()], [32], 8, "float32", options.BAND)
    with pytest.raises(ValueError, match="null"):
        _core.reduce_into(0, 32, [x.data_ptr()], [32], 8, "float32", options.SUM)
    h = torch.zeros(8, dtype=torch.float16)
    with pytest.raises(ValueError, match="src"):
        _core.convert_into(h.data_ptr(), 16, "float16", x.data_ptr(), 16, "float32", 8)
    with pytest.raises(ValueError, match="overlap"):
        _core.convert_into(x.data_ptr(), 32, "float32", x.data_ptr() + 8, 16, "float16", 8)
    with pytest.raises(TypeError, match="int8"):
        _core.convert_into(h.data_ptr(), 16, "float16", x.data_ptr(), 8, "int8", 8)
