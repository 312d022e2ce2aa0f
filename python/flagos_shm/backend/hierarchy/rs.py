"""The reduce-scatter variant of the hierarchical allreduce (nodes of equal size).

In a :class:`~flagos_shm.backend.hierarchy.HierarchicalComm` group whose ``m`` nodes all
have ``k > 1`` ranks, an allreduce (and the allreduce inside reduce and reduce-scatter) of
at least ``FLAGOS_SHM_HIER_RS_MIN_BYTES`` bytes (default 4 MiB, measured: docs/multinode.md)
runs as (Horovod's hierarchical allreduce):

1. in the node, a reduce-scatter (shared memory): local rank ``j`` holds the node's partial
   result of chunk ``j`` (``ceil(numel / k)`` elements; the last chunk padded);
2. the leaders exchange the call's descriptor (as every multi-node call does), then an
   in-node barrier hands their verdict to the node's other ranks;
3. among the ``m`` ranks of local rank ``j`` (one per node; a ``ProcessGroupGloo`` per
   local rank, made on the group's store under the private prefix ``gloo-col/<j>`` on first
   use; local rank 0's is the leaders' group), a Gloo allgather of the chunk's ``m``
   partial results, which every one of them combines in node order;
4. in the node, an allgather of the ``k`` chunks (shared memory).

Every link carries ``1/k`` of the tensor, instead of the leader path's whole tensor through
each leader. The cross-node step is an allgather plus a combination in node order (not a
Gloo allreduce, whose algorithm and order depend on Gloo and which does not take every op
and dtype the core does): so every rank of a column computes the same bits, with the
core's accumulation rules (float16/bfloat16 in float32, rounded once at the end; integer
AVG in int64, divided rounding toward zero; PREMUL_SUM scaled in the node step).

Reduction order, per element: the node's ranks in the core's reduce-scatter order, then
the nodes in node order. The leader path (smaller messages, nodes of unequal size, one
rank per node) uses the core's reduce order inside the node, so the two may differ in the
last bit of a float; which one runs depends only on the element count, the dtype, the
layout and the threshold, and the descriptor (kind ``allreduce_rs``...) makes ranks that
would choose differently raise ``ValueError`` instead of mixing them. Results are bitwise
identical on every rank either way.
"""

from __future__ import annotations

import torch
from torch._C._distributed_c10d import ProcessGroupGloo

from ... import staging
from ... import config
from . import groups
from ..options import AVG, PREMUL_SUM, SUM
from .host import _acc_dtype, _clone, _convert, _nbytes, _reduce_into
from .protocol import _DTYPE_CODE, _KIND_CODE, factor_code

__all__ = ["eligible", "allreduce_rs", "close_columns"]


def _threshold(comm):
    value = getattr(comm, "_rs_min_bytes", False)
    if value is False:
        value = comm._rs_min_bytes = config.hier_rs_min_bytes()
    return value


def eligible(comm, x: torch.Tensor) -> bool:
    """Whether an allreduce of ``x`` runs as reduce-scatter + allgather in the node: equal
    nodes of more than one rank, at least one element per local rank, and at least the
    threshold's bytes. Depends only on what every rank agrees on (checked by the descriptor)."""
    limit = _threshold(comm)
    k = comm.local_size
    return (limit is not None and k > 1 and len({len(m) for m in comm._nodes}) == 1
            and x.numel() >= k and x.numel() * x.element_size() >= limit)


def _column(comm, j: int) -> ProcessGroupGloo:
    """The Gloo group of the ranks of local rank ``j`` (one per node, ranked by node)."""
    if j == 0:
        return comm._gloo("leaders")
    cols = comm.__dict__.setdefault("_columns", {})
    pg = cols.get(j)
    if pg is None:
        if comm._aborted is not None:
            raise RuntimeError(f"flagos_shm: the multi-node group was aborted ({comm._aborted})")
        pg = cols[j] = groups.make_column(comm._store, comm._layout.base, j, comm._layout.node, len(comm._nodes),
                                          comm._timeout_s)
    return pg


def close_columns(comm, abort: bool) -> None:
    """Abort (``abort``) or shut down and drop the column groups (idempotent)."""
    cols = comm.__dict__.get("_columns") or {}
    comm._columns = {}
    groups.release(cols.values(), abort)


def allreduce_rs(comm, kind: str, x: torch.Tensor, dtype: str, op: int, factor: float, root: int,
                 t: float) -> None:
    """In-place allreduce of ``x`` (1-D host tensor of core dtype ``dtype``) by the path of the
    module docstring; ``kind``/``root`` name the call in the descriptor.

    Raises:
        ValueError: ranks disagree (every rank raises; the group stays usable).
        RuntimeError: a rank died, Gloo failed or the timeout ``t`` (seconds) passed (the group is aborted).
    """
    k, n = comm.local_size, x.numel()
    c = -(-n // k)
    acc = _acc_dtype(x.dtype, op)
    acc_name = staging.CORE_DTYPES[acc]
    if acc == x.dtype and n == k * c:
        work = x
    else:
        work = torch.empty(k * c, dtype=acc)
        work[n:].zero_()  # the padding (fewer than k elements)
        _convert(work[:n], x)
    part = torch.empty(c, dtype=acc)
    j = comm._layout.local_rank

    def pre() -> None:
        comm.local.reduce_scatter(work.data_ptr(), _nbytes(work), part.data_ptr(), _nbytes(part), c, acc_name,
                                  SUM if op == AVG else op, factor, t)

    def post() -> None:
        comm.local.barrier(t)  # raises ValueError here if this node's leader found a disagreement
        pg = _column(comm, j)
        try:
            rows = groups.allgather_rows(pg, part, t)
        except RuntimeError as exc:
            raise RuntimeError(f"among the ranks of local rank {j} (Gloo; another node failed, or a rank there "
                               f"exited or was aborted): {exc}") from exc
        # node order, the same on every rank of the column; by the core's kernels (AVG: the
        # sum divided by the group size), on this thread
        result = torch.empty(c, dtype=acc)
        _reduce_into(result, list(rows), SUM if op == PREMUL_SUM else op, world=comm._n)
        mine = result if acc == x.dtype else _clone(result, x.dtype)
        into = x if n == k * c else torch.empty(k * c, dtype=x.dtype)
        comm.local.allgather(mine.data_ptr(), _nbytes(mine), into.data_ptr(), _nbytes(into), c, dtype, t)
        if into is not x:
            staging.copy_into(x, into[:n])

    comm._phases((_KIND_CODE[kind + "_rs"], n, _DTYPE_CODE[dtype], op, root, factor_code(op, factor)), t, pre, None,
                 post)
