"""Groups that span nodes: shared memory inside each node, Gloo between the nodes.

When :func:`~flagos_shm.backend.rendezvous.rendezvous` finds a group on several nodes,
:meth:`CollectiveBase._setup` gives the group a :class:`HierarchicalComm` instead of a core
``Communicator``. It has the core communicator's interface (raw host addresses, element
counts, core dtype names, the ``done`` callback of asynchronous calls), so the collectives
layer, its argument checks and its staging (device tensors are staged to host memory once;
every inter-node step works on that host buffer) serve both kinds of group unchanged.

What it holds:

* a core ``Communicator`` over the ranks of this rank's node (its segment comes from the
  rendezvous, through the group's store);
* on each node's leader (its lowest group rank), a ``ProcessGroupGloo`` over the leaders,
  made directly on the group's store under a private prefix;
* a ``ProcessGroupGloo`` over all ranks, made on first use with Gloo's lazy connections
  (all_to_all, and point-to-point between nodes: :mod:`.hierarchy_p2p`);
* on nodes of equal size, a ``ProcessGroupGloo`` per local rank index, made on first use
  (the reduce-scatter path of large allreduces: :mod:`.hierarchy_rs`).

Algorithms (``L`` = in-node step through shared memory, ``G`` = among the leaders):

* allreduce: L reduce to the leader, G allgather of the leaders' partial results, each
  leader combines them in node order (so every leader computes the same bits), L broadcast.
  float16/bfloat16 are reduced in float32 and rounded once at the end; integer AVG sums in
  int64 and divides rounding toward zero; AVG divides by the group size; PREMUL_SUM scales
  in the node step: the core's rules (see ``rust/reduce.rs``), applied per level. Results
  are bitwise identical on every rank; they may differ in the last bit from the one-node
  order (ranks are combined node by node). From ``FLAGOS_SHM_HIER_RS_MIN_BYTES`` on nodes of
  equal size: L reduce-scatter, Gloo among the ranks of each local rank, L allgather
  (:mod:`.hierarchy_rs`, which also states the order of each path).
* broadcast: L broadcast on the root's node, G broadcast from its leader, L broadcast on
  the others. barrier: L barrier, G exchange, L barrier.
* allgather: L gather to the leader, G allgather (padded to the largest node), L broadcast.
* reduce, reduce-scatter: an allreduce of a scratch copy, each rank keeping its part;
  gather: an allgather; scatter: a broadcast of the root's whole input.
* alltoall: the all-ranks Gloo group; alltoallv (uneven) and coalesced batches:
  :mod:`.hierarchy_coll`.

Before the data of every call the leaders exchange a small descriptor (kind, element count,
dtype, op, root) and a failure flag: ranks that disagree raise ``ValueError`` on every rank
(the group stays usable), as on one node. Any other failure (a dead rank, a timeout, an
abort) aborts the whole group: this rank's node communicator and its Gloo groups are torn
down, which makes the other nodes' Gloo calls fail at once and them abort theirs, so every
rank raises within the group's timeout. The Gloo groups are destroyed with the group.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllToAllOptions,
    BroadcastOptions,
    ProcessGroupGloo,
)

from .. import staging
from . import hierarchy_coll, hierarchy_p2p, hierarchy_rs, options, rendezvous
from .collectives.base import attach

__all__ = ["HierarchicalComm"]

_log = logging.getLogger("flagos_shm")

SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM = range(9)
_TORCH = {name: dtype for dtype, name in staging.CORE_DTYPES.items()}
_DTYPE_CODE = {name: i + 1 for i, name in enumerate(staging.CORE_DTYPES.values())}
_KINDS = ("barrier", "allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "gather", "scatter", "alltoall",
          "allreduce_rs", "reduce_rs", "reduce_scatter_rs")  # *_rs: hierarchy_rs's path
_KIND_CODE = {k: i + 1 for i, k in enumerate(_KINDS)}
_ALLTOALL_NAMES = ("alltoall", "all_to_all_single", "alltoall_base", "alltoallv")
_GLOO_LAZY = "TORCH_GLOO_LAZY_INIT"
_ALL_LOCK = threading.Lock()  # making the all-ranks group (and setting the variable above)

_FLOAT_OPS = {SUM: torch.add, PRODUCT: torch.mul, MIN: torch.minimum, MAX: torch.maximum,
              BAND: torch.bitwise_and, BOR: torch.bitwise_or, BXOR: torch.bitwise_xor}
_BOOL_OPS = {SUM: torch.logical_or, MAX: torch.logical_or, BOR: torch.logical_or, PRODUCT: torch.logical_and,
             MIN: torch.logical_and, BAND: torch.logical_and, BXOR: torch.logical_xor}


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of a contiguous tensor's elements (what the core is told the buffer holds)."""
    return t.numel() * t.element_size()


def _checked_view(arg: str, ptr: int, nbytes: int, numel: int, dtype: str) -> torch.Tensor:
    """:func:`_view` of ``numel`` elements of core dtype ``dtype`` at ``ptr``, after checking
    them against the buffer's ``nbytes``, as the core does for its own buffers.

    Raises:
        ValueError: ``numel`` elements do not fit in ``nbytes`` bytes (naming ``arg``).
    """
    tdt = _TORCH[dtype]
    need = numel * torch.empty((), dtype=tdt).element_size()
    if need > nbytes:
        raise ValueError(f"{arg}: {numel} elements of {dtype} need {need} bytes, the buffer has {nbytes}")
    return _view(ptr, numel, tdt)


def _view(ptr: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor over ``numel`` elements of ``dtype`` at host address ``ptr`` (no copy;
    the caller keeps the memory alive)."""
    if numel == 0 or ptr == 0:
        return torch.empty(0, dtype=dtype)
    size = numel * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * size).from_address(ptr), dtype=dtype)


def _acc_dtype(dtype: torch.dtype, op: int) -> torch.dtype:
    """The dtype a reduction accumulates in across levels (the core's rules)."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if op == AVG and not dtype.is_floating_point and dtype not in (torch.int64, torch.bool):
        return torch.int64  # integer AVG: the exact sum, then division rounding toward zero
    return dtype


def _combine(acc: torch.Tensor, other: torch.Tensor, op: int) -> None:
    """``acc = op(acc, other)`` elementwise, in place."""
    table = _BOOL_OPS if acc.dtype == torch.bool else _FLOAT_OPS
    table[op](acc, other, out=acc)


class _Worker:
    """Runs the group's calls one at a time in issue order: queued ones (``submit``, for
    asynchronous calls) on its own thread, synchronous ones (``run``) on the caller's thread
    once every earlier call has finished."""

    def __init__(self, name: str):
        self._cv = threading.Condition()
        self._jobs: collections.deque = collections.deque()
        self._issued = self._finished = 0
        self._busy = self._stop = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None], done: Callable) -> int:
        with self._cv:
            if self._stop:
                raise RuntimeError("the process group has been shut down")
            self._issued += 1
            self._jobs.append((self._issued, fn, done))
            self._cv.notify_all()
            return self._issued

    def run(self, fn: Callable[[], None]) -> None:
        with self._cv:
            while self._busy or self._jobs:
                self._cv.wait(0.05)
            if self._stop:
                raise RuntimeError("the process group has been shut down")
            self._busy = True
        try:
            fn()
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def wait(self, ticket: int) -> None:
        with self._cv:
            while self._finished < ticket and not (self._stop and not self._jobs and not self._busy):
                self._cv.wait(0.05)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (self._busy or not self._jobs) and not self._stop:
                    self._cv.wait()
                if not self._jobs:
                    return
                ticket, fn, done = self._jobs.popleft()
                self._busy = True
            error = None
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001  handed to the work
                error = exc
            try:
                done(error)
            except Exception:  # noqa: BLE001
                _log.exception("flagos_shm: completing a work failed")
            with self._cv:
                self._busy = False
                self._finished = ticket
                self._cv.notify_all()

    def close(self) -> list:
        """Stop taking calls; return the queued ones that never started (their ``done``)."""
        with self._cv:
            self._stop = True
            left = [done for _, _, done in self._jobs]
            self._jobs.clear()
            self._cv.notify_all()
        return left

    def join(self) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join()


class HierarchicalComm:
    """The core ``Communicator`` interface over a group that spans nodes (module docstring).

    Args:
        store: the group's store (the Gloo groups are made under private prefixes of it).
        layout: the group's :class:`~flagos_shm.backend.rendezvous.Layout`.
        rank, world_size: this rank's group rank and the group's size.
        timeout_s: the group's timeout, seconds (node communicator and Gloo groups).
        where: the group, for error messages.

    Raises:
        RuntimeError, ValueError: attaching to the node segment or connecting the leaders failed.
    """

    def __init__(self, store: dist.Store, layout, rank: int, world_size: int, timeout_s: float, where: str):
        self._store, self._layout, self._rank, self._n = store, layout, rank, world_size
        self._timeout_s = float(timeout_s)
        self._where = where
        self._nodes = layout.nodes
        self._node_of = layout.node_of
        self._index = [layout.nodes[layout.node_of[r]].index(r) for r in range(world_size)]
        self.local_size = layout.local_size
        self.leader = layout.local_rank == 0
        self._aborted: Optional[str] = None
        self._closed = False
        self._seq = 0
        self.last_reduce_path: Optional[str] = None  # of the last allreduce/reduce/reduce-scatter
        self._all: Optional[ProcessGroupGloo] = None
        self._leaders: Optional[ProcessGroupGloo] = None
        try:
            self.local = attach(layout, timeout_s, where)
        except BaseException as exc:  # e.g. a rank of this node exited: the other nodes learn it at once
            rendezvous.publish_failure(store, layout.base, rank, exc)
            raise
        try:
            if self.leader:
                # Every node attached before the leaders connect (Gloo's own connect would wait
                # for a leader that gave up until the store's timeout).
                base = layout.base
                store.set(f"{base}/leader-ready/{layout.node}", "1")
                rendezvous.wait_keys(store, [f"{base}/leader-ready/{k}" for k in range(len(layout.nodes))],
                                     time.monotonic() + timeout_s, "waiting for every node to attach",
                                     dict, base)
                self._leaders = ProcessGroupGloo(dist.PrefixStore(f"{base}/gloo-leaders", store), layout.node,
                                                 len(layout.nodes), timedelta(seconds=timeout_s))
        except BaseException as exc:
            rendezvous.publish_failure(store, layout.base, rank, exc)
            self.local.abort()
            self.local.close()
            if isinstance(exc, RuntimeError):
                raise options.with_context(exc, f"{where}: setting up: {exc}") from exc
            raise
        self._worker = _Worker(f"flagos_shm-hierarchy-{rank}")

    # ---- what the collectives layer reads -----------------------------------------------

    @property
    def path(self) -> str:
        return self.local.path

    @property
    def slot_bytes(self) -> int:
        return self.local.slot_bytes

    @property
    def segment_bytes(self) -> int:
        return self.local.segment_bytes

    @property
    def single_copy_min_bytes(self):
        return self.local.single_copy_min_bytes

    @property
    def nodes(self) -> list:
        """The group ranks of each node."""
        return [list(m) for m in self._nodes]

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"HierarchicalComm(rank={self._rank}, world_size={self._n}, nodes={self._nodes})"

    # ---- lifetime -------------------------------------------------------------------------

    def set_timeout(self, timeout_s: float) -> None:
        self._timeout_s = float(timeout_s)
        self.local.set_timeout(timeout_s)

    def abort(self, why: str = "the group was aborted") -> None:
        """Abort the group on this rank: the node's ranks wake up and raise, the Gloo groups
        are torn down (the other nodes' Gloo calls then fail at once); later calls raise."""
        if self._aborted is None:
            self._aborted = why
        self.local.abort()
        hierarchy_rs.close_columns(self, abort=True)
        groups, self._leaders, self._all = [self._leaders, self._all], None, None
        for pg in groups:
            if pg is not None:
                try:
                    pg.abort()
                except Exception:  # noqa: BLE001  best effort: dropping it closes its connections
                    pass
        del groups

    def close(self) -> None:
        """Release the node segment and the Gloo groups (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for done in self._worker.close():
            try:
                done(RuntimeError("the process group has been shut down"))
            except Exception:  # noqa: BLE001
                pass
        self._worker.join()
        self.local.close()
        hierarchy_rs.close_columns(self, abort=False)
        for name in ("_leaders", "_all"):
            pg = getattr(self, name)
            setattr(self, name, None)
            if pg is not None:
                try:
                    pg.shutdown()
                except Exception:  # noqa: BLE001
                    pass
            del pg

    def wait_ticket(self, ticket: int) -> None:
        self._worker.wait(ticket)

    # ---- dispatch ---------------------------------------------------------------------------

    def _dispatch(self, fn: Callable[[], None], done) -> int:
        self._seq += 1
        if done is not None:
            return self._worker.submit(self._guarded(fn), done)
        try:
            self._worker.run(self._guarded(fn))
        except (KeyboardInterrupt, SystemExit):
            self.abort("interrupted")
            raise
        return 0

    def _guarded(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            if self._aborted is not None:
                raise RuntimeError(f"flagos_shm: the multi-node group was aborted earlier ({self._aborted})")
            if self._closed:
                raise RuntimeError("the process group has been shut down")
            fn()
        return run

    def _t(self, timeout_s) -> float:
        return float(timeout_s) if timeout_s else self._timeout_s

    # ---- the leaders' level -----------------------------------------------------------------

    def _gloo(self, group: str) -> ProcessGroupGloo:
        pg = self._leaders if group == "leaders" else self._all
        if pg is None and group == "all" and self._aborted is None:
            pg = self._all_group()
        if pg is None:
            raise RuntimeError(f"flagos_shm: the multi-node group was aborted ({self._aborted})")
        return pg

    def _all_group(self) -> ProcessGroupGloo:
        """The all-ranks Gloo group, made on first use by whichever ranks use it (all-to-all,
        point-to-point between nodes). Gloo's lazy set-up (``TORCH_GLOO_LAZY_INIT``, read
        when a group is made) connects a pair when it first talks, so two ranks that only
        exchange messages need no one else."""
        with _ALL_LOCK:
            if self._all is None and self._aborted is None and not self._closed:
                saved = os.environ.get(_GLOO_LAZY)
                os.environ[_GLOO_LAZY] = "1"
                try:
                    self._all = ProcessGroupGloo(dist.PrefixStore(f"{self._layout.base}/gloo-all", self._store),
                                                 self._rank, self._n, timedelta(seconds=self._timeout_s))
                finally:
                    if saved is None:
                        os.environ.pop(_GLOO_LAZY, None)
                    else:
                        os.environ[_GLOO_LAZY] = saved
            pg = self._all
        if pg is None:
            raise RuntimeError(f"flagos_shm: the multi-node group was aborted or shut down ({self._aborted})")
        return pg

    # ---- point-to-point between nodes (hierarchy_p2p) -------------------------------------

    def node_of(self, rank: int) -> int:
        """The node index of group rank ``rank``."""
        return self._node_of[rank]

    def is_remote(self, peer: int) -> bool:
        """Whether group rank ``peer`` is on another node than this rank."""
        return self._node_of[peer] != self._layout.node

    def send_remote(self, peer: int, peer_name: str, data: torch.Tensor, tag: int, deadline: float) -> None:
        """:func:`hierarchy_p2p.send` over the all-ranks Gloo group."""
        hierarchy_p2p.send(self._all_group(), peer, peer_name, data, tag, deadline)

    def recv_remote(self, peer: int, peer_name: str, data: torch.Tensor, tag: int, deadline: float) -> None:
        """:func:`hierarchy_p2p.recv` over the all-ranks Gloo group."""
        hierarchy_p2p.recv(self._all_group(), peer, peer_name, data, tag, deadline)

    def _exchange(self, header: tuple, timeout_s: float, failed: bool = False, group: str = "leaders") -> None:
        """Allgather ``(failed, *header)`` among the leaders (or all ranks); ValueError if a
        peer failed the call or the headers differ (not when ``failed``: the caller raises its
        own error)."""
        pg = self._gloo(group)
        mine = torch.tensor([int(failed), *header], dtype=torch.int64)
        rows = torch.empty(pg.size() * mine.numel(), dtype=torch.int64)
        opts = AllgatherOptions()
        opts.timeout = timedelta(seconds=timeout_s)
        pg._allgather_base(rows, mine, opts).wait()
        if failed:
            return
        rows = rows.view(pg.size(), -1)
        who = (lambda k: f"node {k} (group ranks {self._nodes[k]})") if group == "leaders" else \
            (lambda k: f"group rank {k}")
        bad = [k for k in range(rows.shape[0]) if rows[k, 0]]
        if bad:
            raise ValueError(f"flagos_shm {_KINDS[header[0] - 1]}: {', '.join(map(who, bad))} rejected the call "
                             "(a rank there failed it; see its error)")
        if not bool((rows[:, 1:] == mine[1:]).all()):
            calls = "; ".join(f"{who(k)}: {self._describe(rows[k, 1:].tolist())}" for k in range(rows.shape[0]))
            raise ValueError(f"flagos_shm: ranks disagree on the collective (kind, element count, dtype, op, root): "
                             f"{calls}")

    @staticmethod
    def _describe(h: list) -> str:
        kind = _KINDS[h[0] - 1] if 0 < h[0] <= len(_KINDS) else h[0]
        dtype = next((n for n, c in _DTYPE_CODE.items() if c == h[2]), h[2])
        return f"{kind}({h[1]} x {dtype}, op {options.OP_NAMES[h[3]] if 0 <= h[3] < 9 else h[3]}, root {h[4]})"

    def _allgather_rows(self, t: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """Gloo allgather of ``t`` (1-D, contiguous) among the leaders: [n_nodes, numel]."""
        pg = self._gloo("leaders")
        flat = t.reshape(-1).view(torch.uint8)
        out = torch.empty(pg.size() * flat.numel(), dtype=torch.uint8)
        opts = AllgatherOptions()
        opts.timeout = timedelta(seconds=timeout_s)
        pg._allgather_base(out, flat, opts).wait()
        return out.view(t.dtype).view(pg.size(), -1)

    def _phases(self, header: tuple, timeout_s: float, pre, inter, post) -> None:
        """Run one call: the node step ``pre``, on the leaders the descriptor exchange and
        ``inter``, the node step ``post`` (each may be None). Disagreement (ValueError) is
        passed on so that every rank raises it and the group stays usable; any other error
        aborts the group (module docstring)."""
        pre, post = self._in_node(pre), self._in_node(post)
        try:
            if pre is not None:
                try:
                    pre()
                except ValueError:
                    if self.leader:
                        self._exchange(header, timeout_s, failed=True)
                    raise
            if self.leader:
                try:
                    self._exchange(header, timeout_s)
                    if inter is not None:
                        inter()
                except ValueError:
                    if post is not None:
                        self.local.fail(_KINDS[header[0] - 1], "", timeout_s)
                    raise
                except RuntimeError as exc:
                    raise options.with_context(exc, f"between the node leaders (Gloo; another node failed, or its "
                                                    f"leader exited or was aborted): {exc}") from exc
            if post is not None:
                post()
        except ValueError:
            raise
        except BaseException as exc:
            self.abort(f"{type(exc).__name__}: {exc}")
            raise

    def _in_node(self, step):
        """``step`` with its errors naming the node (the core numbers a node's ranks 0, 1, ...)."""
        if step is None:
            return None
        members = self._nodes[self._layout.node]

        def run() -> None:
            try:
                step()
            except Exception as exc:
                raise options.with_context(exc, f"{exc} (in node {self._layout.node}, whose ranks "
                                                f"0..{len(members) - 1} are group ranks {members})") from exc
        return run

    # ---- collectives ------------------------------------------------------------------------

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
        work = x if acc == x.dtype else x.to(acc)
        acc_name = staging.CORE_DTYPES[acc]
        multi = self.local_size > 1

        def pre() -> None:
            self.local.reduce(work.data_ptr(), _nbytes(work), numel, acc_name, SUM if op == AVG else op, 0, factor, t)

        def inter() -> None:
            if not numel:
                return
            part = work * factor if op == PREMUL_SUM and not multi else work
            rows = self._allgather_rows(part, t)
            # combined in node order, straight into x where no conversion follows
            result = x if acc == x.dtype and op != AVG else torch.empty_like(rows[0])
            inter_op = SUM if op in (AVG, PREMUL_SUM) else op
            (_BOOL_OPS if acc == torch.bool else _FLOAT_OPS)[inter_op](rows[0], rows[1], out=result)
            for k in range(2, rows.shape[0]):
                _combine(result, rows[k], inter_op)
            if op == AVG:
                if result.dtype.is_floating_point:
                    result.div_(torch.tensor(self._n, dtype=result.dtype))
                else:
                    result = torch.div(result, self._n, rounding_mode="trunc")
            if result is not x:
                x.copy_(result)

        def post() -> None:
            self.local.broadcast(x.data_ptr(), _nbytes(x), numel, dtype, 0, t)
        self._phases((_KIND_CODE[kind], numel, _DTYPE_CODE[dtype], op, root), t,
                     pre if multi else None, inter, post if multi else None)

    def _reduce_all(self, kind: str, x: torch.Tensor, dtype: str, op: int, factor: float, root: int, t: float) -> None:
        """An allreduce of ``x`` by the leader path or, for large tensors on nodes of equal
        size, by in-node reduce-scatter (:mod:`.hierarchy_rs`); records which in
        ``last_reduce_path`` (``"leader"`` or ``"reduce_scatter"``)."""
        if hierarchy_rs.eligible(self, x):
            self.last_reduce_path = "reduce_scatter"
            hierarchy_rs.allreduce_rs(self, kind, x, dtype, op, factor, root, t)
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
            scratch = x.clone()
            self._reduce_all("reduce", scratch, dtype, op, factor, root, t)
            if self._rank == root:
                x.copy_(scratch)
        return self._dispatch(job, done)

    def reduce_scatter(self, in_ptr, in_nbytes, out_ptr, out_nbytes, numel, dtype, op, factor=1.0, timeout_s=None,
                       done=None) -> int:
        t = self._t(timeout_s)
        inp = _checked_view("in_nbytes", in_ptr, in_nbytes, self._n * numel, dtype)
        out = _checked_view("out_nbytes", out_ptr, out_nbytes, numel, dtype)

        def job() -> None:
            scratch = inp.clone()
            self._reduce_all("reduce_scatter", scratch, dtype, op, factor, 0, t)
            out.copy_(scratch[self._rank * numel:(self._rank + 1) * numel])
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
            opts = BroadcastOptions()
            opts.rootRank, opts.rootTensor = root_node, 0
            opts.timeout = timedelta(seconds=t)
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
            scratch = inp.clone() if inp is not None else torch.empty(self._n * numel, dtype=_TORCH[dtype])
            self._broadcast_job("scatter", scratch, dtype, root, t)
            out.copy_(scratch[self._rank * numel:(self._rank + 1) * numel])
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
                block[:numel].copy_(inp)
            rows = self._allgather_rows(block, t)
            for r in range(self._n):
                i = self._index[r]
                out[r * numel:(r + 1) * numel].copy_(rows[self._node_of[r], i * numel:(i + 1) * numel])

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
                out.copy_(scratch)
        return self._dispatch(job, done)

    def alltoall(self, in_ptr, in_nbytes, out_ptr, out_nbytes, numel, dtype, timeout_s=None, done=None) -> int:
        """``numel`` elements to each rank, through the all-ranks Gloo group."""
        t = self._t(timeout_s)
        inp = _checked_view("in_nbytes", in_ptr, in_nbytes, self._n * numel, dtype).view(torch.uint8)
        out = _checked_view("out_nbytes", out_ptr, out_nbytes, self._n * numel, dtype).view(torch.uint8)

        def job() -> None:
            try:
                self._exchange((_KIND_CODE["alltoall"], numel, _DTYPE_CODE[dtype], 0, 0), t, group="all")
                if numel:
                    opts = AllToAllOptions()
                    opts.timeout = timedelta(seconds=t)
                    self._gloo("all").alltoall_base(out, inp, [], [], opts).wait()
            except ValueError:
                raise
            except BaseException as exc:
                self.abort(f"{type(exc).__name__}: {exc}")
                raise
        return self._dispatch(job, done)

    # ---- alltoallv and coalesced batches: :mod:`.hierarchy_coll` ---------------------------

    def alltoallv(self, *args, **kwargs) -> int:
        return hierarchy_coll.alltoallv(self, *args, **kwargs)

    def allreduce_coalesced(self, *args, **kwargs) -> int:
        return hierarchy_coll.allreduce_coalesced(self, *args, **kwargs)

    def allgather_coalesced(self, *args, **kwargs) -> int:
        return hierarchy_coll.allgather_coalesced(self, *args, **kwargs)

    def reduce_scatter_coalesced(self, *args, **kwargs) -> int:
        return hierarchy_coll.reduce_scatter_coalesced(self, *args, **kwargs)
