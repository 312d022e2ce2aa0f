"""The collectives of a :class:`~flagos_shm.backend.hierarchy.HierarchicalComm`: the core
``Communicator``'s methods (raw host addresses, element counts, core dtype names, the
``done`` callback of asynchronous calls), each a job of the group's worker built from the
phases of :mod:`.protocol` (``L`` = in-node step through shared memory, ``G`` = among the
leaders):

* allreduce: L reduce to the leader, G allgather of the leaders' partial results, each
  leader combines them in node order (so every leader computes the same bits), L broadcast;
  large ones on nodes of equal size take the reduce-scatter path of :mod:`.rs`.
* broadcast: L broadcast on the root's node, G broadcast from its leader, L broadcast on
  the others. barrier: L barrier, G exchange, L barrier.
* allgather: L gather to the leader, G allgather (padded to the largest node), L broadcast.
* reduce, reduce-scatter: an allreduce of a scratch copy, each rank keeping its part;
  gather: an allgather; scatter: a broadcast of the root's whole input.
* alltoall: the all-ranks Gloo group; alltoallv and coalesced batches: :mod:`.alltoallv_coalesced`.
"""

from __future__ import annotations

import torch
from torch._C._distributed_c10d import AllToAllOptions, BroadcastOptions

from ... import staging
from . import alltoallv_coalesced, groups, rs
from ..options import AVG, PREMUL_SUM, SUM
from .host import _TORCH, _acc_dtype, _checked_view, _clone, _convert, _nbytes, _reduce_into
from .protocol import _ALLTOALL_NAMES, _DTYPE_CODE, _KIND_CODE, aborting, factor_code


class Algorithms:
    """Mixin of :class:`~flagos_shm.backend.hierarchy.HierarchicalComm`: every collective
    (module docstring); the group state, worker and phases come from the class."""

    def barrier(self, timeout_s=None, done=None) -> int:
        t = self._t(timeout_s)
        multi = self.local_size > 1
        step = (lambda: self.local.barrier(t)) if multi else None
        return self._dispatch(lambda: self._phases((_KIND_CODE["barrier"], 0, 0, 0, 0), t, step, None, step), done)

    def fail(self, collective: str, message: str = "", timeout_s=None) -> None:
        """This rank's arguments to ``collective`` were invalid: make its peers raise too."""
        t = self._t(timeout_s)
        kind = _KIND_CODE.get(collective, _KIND_CODE["allreduce"])

        def job() -> None:
            if collective in _ALLTOALL_NAMES:
                self._exchange((_KIND_CODE["alltoall"], 0, 0, 0, 0), t, failed=True, group="all")
                return
            if self.local_size > 1:
                self.local.fail(collective, message, t)
            if self.leader:
                self._exchange((kind, 0, 0, 0, 0), t, failed=True)
        self._dispatch(job, None)

    def _allreduce_job(self, kind: str, x: torch.Tensor, dtype: str, op: int, factor: float, root: int,
                       t: float) -> None:
        numel = x.numel()
        acc = _acc_dtype(x.dtype, op)
        work = x if acc == x.dtype else _clone(x, acc)
        acc_name = staging.CORE_DTYPES[acc]
        multi = self.local_size > 1

        def pre() -> None:
            self.local.reduce(work.data_ptr(), _nbytes(work), numel, acc_name, SUM if op == AVG else op, 0, factor, t)

        def inter() -> None:
            if not numel:
                return
            part = work
            if op == PREMUL_SUM and not multi:  # one rank per node: scale here (the core does it in a node)
                part = torch.empty_like(work)
                _reduce_into(part, [work], PREMUL_SUM, factor)
            rows = self._allgather_rows(part, t)
            # combined in node order by the core's kernels (AVG: the sum divided by the group
            # size), straight into x where no conversion follows
            result = x if acc == x.dtype else torch.empty_like(rows[0])
            _reduce_into(result, list(rows), SUM if op == PREMUL_SUM else op, world=self._n)
            if result is not x:
                _convert(x, result)

        def post() -> None:
            self.local.broadcast(x.data_ptr(), _nbytes(x), numel, dtype, 0, t)
        self._phases((_KIND_CODE[kind], numel, _DTYPE_CODE[dtype], op, root, factor_code(op, factor)), t,
                     pre if multi else None, inter, post if multi else None)

    def _reduce_all(self, kind: str, x: torch.Tensor, dtype: str, op: int, factor: float, root: int, t: float) -> None:
        """An allreduce of ``x`` by the leader path or, for large tensors on nodes of equal
        size, by in-node reduce-scatter (:mod:`.rs`); records which in
        ``last_reduce_path`` (``"leader"`` or ``"reduce_scatter"``)."""
        if rs.eligible(self, x):
            self.last_reduce_path = "reduce_scatter"
            rs.allreduce_rs(self, kind, x, dtype, op, factor, root, t)
        else:
            self.last_reduce_path = "leader"
            self._allreduce_job(kind, x, dtype, op, factor, root, t)

    def allreduce(self, ptr, nbytes, numel, dtype, op, factor=1.0, timeout_s=None, done=None) -> int:
        t = self._t(timeout_s)
        x = _checked_view("nbytes", ptr, nbytes, numel, dtype)
        return self._dispatch(lambda: self._reduce_all("allreduce", x, dtype, op, factor, 0, t), done)

    def reduce(self, ptr, nbytes, numel, dtype, op, root, factor=1.0, timeout_s=None, done=None) -> int:
        t = self._t(timeout_s)
        x = _checked_view("nbytes", ptr, nbytes, numel, dtype)

        def job() -> None:
            scratch = _clone(x)
            self._reduce_all("reduce", scratch, dtype, op, factor, root, t)
            if self._rank == root:
                staging.copy_into(x, scratch)
        return self._dispatch(job, done)

    def reduce_scatter(self, in_ptr, in_nbytes, out_ptr, out_nbytes, numel, dtype, op, factor=1.0, timeout_s=None,
                       done=None) -> int:
        t = self._t(timeout_s)
        inp = _checked_view("in_nbytes", in_ptr, in_nbytes, self._n * numel, dtype)
        out = _checked_view("out_nbytes", out_ptr, out_nbytes, numel, dtype)

        def job() -> None:
            scratch = _clone(inp)
            self._reduce_all("reduce_scatter", scratch, dtype, op, factor, 0, t)
            staging.copy_into(out, scratch[self._rank * numel:(self._rank + 1) * numel])
        return self._dispatch(job, done)

    def _broadcast_job(self, kind: str, x: torch.Tensor, dtype: str, root: int, t: float) -> None:
        numel = x.numel()
        root_node = self._node_of[root]
        here = self._layout.node == root_node
        multi = self.local_size > 1
        ptr = x.data_ptr() if numel else 0

        def pre() -> None:
            self.local.broadcast(ptr, _nbytes(x), numel, dtype, self._index[root], t)

        def inter() -> None:
            if not numel:
                return
            opts = groups.timed(BroadcastOptions, t)
            opts.rootRank, opts.rootTensor = root_node, 0
            self._gloo("leaders").broadcast([x.view(torch.uint8)], opts).wait()

        def post() -> None:
            self.local.broadcast(ptr, _nbytes(x), numel, dtype, 0, t)
        self._phases((_KIND_CODE[kind], numel, _DTYPE_CODE[dtype], 0, root), t,
                     pre if multi and here else None, inter, post if multi and not here else None)

    def broadcast(self, ptr, nbytes, numel, dtype, root, timeout_s=None, done=None) -> int:
        t = self._t(timeout_s)
        x = _checked_view("nbytes", ptr, nbytes, numel, dtype)
        return self._dispatch(lambda: self._broadcast_job("broadcast", x, dtype, root, t), done)

    def scatter(self, in_ptr, in_nbytes, out_ptr, out_nbytes, numel, dtype, root, timeout_s=None, done=None) -> int:
        t = self._t(timeout_s)
        inp = _checked_view("in_nbytes", in_ptr, in_nbytes, self._n * numel, dtype) if self._rank == root else None
        out = _checked_view("out_nbytes", out_ptr, out_nbytes, numel, dtype)

        def job() -> None:
            scratch = _clone(inp) if inp is not None else torch.empty(self._n * numel, dtype=_TORCH[dtype])
            self._broadcast_job("scatter", scratch, dtype, root, t)
            staging.copy_into(out, scratch[self._rank * numel:(self._rank + 1) * numel])
        return self._dispatch(job, done)

    def _allgather_job(self, kind: str, inp: torch.Tensor, out: torch.Tensor, dtype: str, root: int,
                       t: float) -> None:
        numel = inp.numel()
        multi = self.local_size > 1
        widest = max(len(m) for m in self._nodes)
        block = torch.empty(widest * numel, dtype=inp.dtype) if self.leader else None

        def pre() -> None:
            self.local.gather(inp.data_ptr() if numel else 0, _nbytes(inp),
                              block.data_ptr() if self.leader and numel else 0, _nbytes(block) if self.leader else 0,
                              numel, dtype, 0, t)

        def inter() -> None:
            if not numel:
                return
            if not multi:
                staging.copy_into(block[:numel], inp)
            rows = self._allgather_rows(block, t)
            for r in range(self._n):
                i = self._index[r]
                staging.copy_into(out[r * numel:(r + 1) * numel], rows[self._node_of[r], i * numel:(i + 1) * numel])

        def post() -> None:
            self.local.broadcast(out.data_ptr() if numel else 0, _nbytes(out), self._n * numel, dtype, 0, t)
        self._phases((_KIND_CODE[kind], numel, _DTYPE_CODE[dtype], 0, root), t,
                     pre if multi else None, inter, post if multi else None)

    def allgather(self, in_ptr, in_nbytes, out_ptr, out_nbytes, numel, dtype, timeout_s=None, done=None) -> int:
        t = self._t(timeout_s)
        inp = _checked_view("in_nbytes", in_ptr, in_nbytes, numel, dtype)
        out = _checked_view("out_nbytes", out_ptr, out_nbytes, self._n * numel, dtype)
        return self._dispatch(lambda: self._allgather_job("allgather", inp, out, dtype, 0, t), done)

    def gather(self, in_ptr, in_nbytes, out_ptr, out_nbytes, numel, dtype, root, timeout_s=None, done=None) -> int:
        t = self._t(timeout_s)
        inp = _checked_view("in_nbytes", in_ptr, in_nbytes, numel, dtype)
        out = _checked_view("out_nbytes", out_ptr, out_nbytes, self._n * numel, dtype) if self._rank == root else None

        def job() -> None:
            scratch = torch.empty(self._n * numel, dtype=_TORCH[dtype])
            self._allgather_job("gather", inp, scratch, dtype, root, t)
            if out is not None:
                staging.copy_into(out, scratch)
        return self._dispatch(job, done)

    def alltoall(self, in_ptr, in_nbytes, out_ptr, out_nbytes, numel, dtype, timeout_s=None, done=None) -> int:
        """``numel`` elements to each rank, through the all-ranks Gloo group."""
        t = self._t(timeout_s)
        inp = _checked_view("in_nbytes", in_ptr, in_nbytes, self._n * numel, dtype).view(torch.uint8)
        out = _checked_view("out_nbytes", out_ptr, out_nbytes, self._n * numel, dtype).view(torch.uint8)

        def job() -> None:
            with aborting(self):
                self._exchange((_KIND_CODE["alltoall"], numel, _DTYPE_CODE[dtype], 0, 0), t, group="all")
                if numel:
                    self._gloo("all").alltoall_base(out, inp, [], [], groups.timed(AllToAllOptions, t)).wait()
        return self._dispatch(job, done)

    # ---- alltoallv and coalesced batches: :mod:`.alltoallv_coalesced` ----------------------

    def alltoallv(self, *args, **kwargs) -> int:
        return alltoallv_coalesced.alltoallv(self, *args, **kwargs)

    def allreduce_coalesced(self, *args, **kwargs) -> int:
        return alltoallv_coalesced.allreduce_coalesced(self, *args, **kwargs)

    def allgather_coalesced(self, *args, **kwargs) -> int:
        return alltoallv_coalesced.allgather_coalesced(self, *args, **kwargs)

    def reduce_scatter_coalesced(self, *args, **kwargs) -> int:
        return alltoallv_coalesced.reduce_scatter_coalesced(self, *args, **kwargs)
