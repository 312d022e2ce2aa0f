"""Uneven all-to-all and coalesced batches of a :class:`~flagos_shm.backend.hierarchy.HierarchicalComm`.

* alltoallv: an allgather of every rank's send and receive counts over the all-ranks Gloo
  group, checked as on one node (ValueError on every rank naming the first pair whose sizes
  disagree, before any data moves), then Gloo's alltoall with split sizes. A rank that
  rejected its arguments is seen in the descriptor exchange before it (as for alltoall).
* coalesced batches: one call (one ticket of the group's worker) that runs the batch's
  tensors one after another through the single-tensor paths; tensors are compared one by
  one, so ranks whose batches differ in length are not told apart as on one node.
"""

from __future__ import annotations

import torch
from torch._C._distributed_c10d import AllToAllOptions

from .. import options
from . import groups
from ... import staging
from .host import _TORCH, _checked_view, _clone
from .protocol import _DTYPE_CODE, _KIND_CODE, aborting


def alltoallv(comm, in_ptr, in_nbytes, out_ptr, out_nbytes, send_counts, recv_counts, dtype, timeout_s=None,
              done=None) -> int:
    """Per-peer counts (elements), through the all-ranks Gloo group (the core's checks)."""
    t = comm._t(timeout_s)
    send, recv = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    for arg, counts in (("send_counts", send), ("recv_counts", recv)):
        if len(counts) != comm._n or any(c < 0 for c in counts):
            raise ValueError(f"{arg}: expected {comm._n} non-negative counts, got {counts}")
    inp = _checked_view("in_nbytes", in_ptr, in_nbytes, sum(send), dtype).view(torch.uint8)
    out = _checked_view("out_nbytes", out_ptr, out_nbytes, sum(recv), dtype).view(torch.uint8)
    es = torch.empty((), dtype=_TORCH[dtype]).element_size()

    def job() -> None:
        with aborting(comm):
            comm._exchange((_KIND_CODE["alltoall"], -1, _DTYPE_CODE[dtype], 0, 0), t, group="all")
            rows = groups.allgather_rows(comm._gloo("all"), torch.tensor(send + recv, dtype=torch.int64), t)
            n = comm._n
            bad = [(p, q) for p in range(n) for q in range(n) if rows[p, q] != rows[q, n + p]]
            if bad:
                p, q = bad[0]
                got, expected = int(rows[p, q]), int(rows[q, n + p])
                raise options.disagreement(f"split sizes disagree between ranks: rank {p} sends {got} elements to "
                                           f"rank {q}, which expects {expected} from it ({len(bad)} such pair(s)); "
                                           "no data was exchanged", "counts", p, q, expected, got, len(bad))
            if int(rows[:, :n].sum()):
                comm._gloo("all").alltoall_base(out, inp, [c * es for c in recv], [c * es for c in send],
                                                groups.timed(AllToAllOptions, t)).wait()
    return comm._dispatch(job, done)

# ---- coalesced batches: the tensors one after another, in one call ---------------------


def allreduce_coalesced(comm, ptrs, nbytes, numels, dtypes, op, factor=1.0, timeout_s=None, done=None) -> int:
    t = comm._t(timeout_s)
    xs = [_checked_view(f"nbytes[{i}]", p, b, k, d)
          for i, (p, b, k, d) in enumerate(zip(ptrs, nbytes, numels, dtypes))]

    def job() -> None:
        for x, d in zip(xs, dtypes):
            comm._reduce_all("allreduce", x, d, op, factor, 0, t)
    return comm._dispatch(job, done)


def allgather_coalesced(comm, in_ptrs, in_nbytes, out_ptrs, out_nbytes, numels, dtypes, timeout_s=None,
                        done=None) -> int:
    t = comm._t(timeout_s)
    items = [(_checked_view(f"in_nbytes[{i}]", ip, ib, k, d), _checked_view(f"out_nbytes[{i}]", op_, ob,
                                                                              comm._n * k, d), d)
             for i, (ip, ib, op_, ob, k, d) in enumerate(zip(in_ptrs, in_nbytes, out_ptrs, out_nbytes, numels,
                                                             dtypes))]

    def job() -> None:
        for inp, out, d in items:
            comm._allgather_job("allgather", inp, out, d, 0, t)
    return comm._dispatch(job, done)


def reduce_scatter_coalesced(comm, in_ptrs, in_nbytes, out_ptrs, out_nbytes, numels, dtypes, op, factor=1.0,
                             timeout_s=None, done=None) -> int:
    t = comm._t(timeout_s)
    items = [(_checked_view(f"in_nbytes[{i}]", ip, ib, comm._n * k, d), _checked_view(f"out_nbytes[{i}]", op_,
                                                                                       ob, k, d), k, d)
             for i, (ip, ib, op_, ob, k, d) in enumerate(zip(in_ptrs, in_nbytes, out_ptrs, out_nbytes, numels,
                                                             dtypes))]

    def job() -> None:
        for inp, out, k, d in items:
            scratch = _clone(inp)
            comm._reduce_all("reduce_scatter", scratch, d, op, factor, 0, t)
            staging.copy_into(out, scratch[comm._rank * k:(comm._rank + 1) * k])
    return comm._dispatch(job, done)
