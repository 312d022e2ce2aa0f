"""The :class:`HierarchicalComm` itself: its group state, the sub-groups it holds, its
lifetime (abort, close), the worker its calls run on, and the point-to-point entry points;
the collectives and the per-call protocol are mixed in (:mod:`.algorithms`, :mod:`.protocol`).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from .. import options, plan, rendezvous
from . import groups, p2p, rs
from .algorithms import Algorithms
from .protocol import Protocol
from .worker import _Worker

__all__ = ["HierarchicalComm"]

_ALL_LOCK = threading.Lock()  # making the all-ranks group (and setting TORCH_GLOO_LAZY_INIT)


class HierarchicalComm(Algorithms, Protocol):
    """The core ``Communicator`` interface over a group that spans nodes (package docstring).

    Args:
        store: the group's store (the Gloo groups are made under private prefixes of it).
        layout: the group's :class:`~flagos_shm.backend.rendezvous.Layout`.
        rank, world_size: this rank's group rank and the group's size.
        timeout_s: the group's timeout, seconds (node communicator and Gloo groups).
        where: the group, for error messages.

    Raises:
        RuntimeError, ValueError: attaching to the node segment, agreeing on its plan
            (:func:`~flagos_shm.backend.plan.setup`) or connecting the leaders failed.
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
        local = None
        try:
            local = self.local = rendezvous.attach(layout, timeout_s, where)
            # this node's plan: each node may be another kind of machine (plan.setup)
            _, self.plan_source = plan.setup(local, store, layout, rank, world_size, where, timeout_s)
            if self.leader:  # once every node has attached
                self._leaders = groups.connect_leaders(store, layout, timeout_s)
        except BaseException as exc:  # e.g. a rank of this node exited: the other nodes learn it at once
            rendezvous.publish_failure(store, layout.base, rank, exc)
            if local is not None:
                local.abort()
                local.close()
            if isinstance(exc, Exception):  # a store living in this rank outlasts the peers' reads of why
                rendezvous.leave_together(store, layout.base, rank, world_size,
                                          time.monotonic() + rendezvous.LEAVE_WAIT_S)
            if local is not None and isinstance(exc, RuntimeError):  # (attach's errors name the group)
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
    def plan(self) -> dict:
        """This node's plan (:mod:`flagos_shm.backend.plan`)."""
        return self.local.plan

    @property
    def stream_mode(self) -> str:
        """How this node's ranks store into their slots (``FLAGOS_SHM_STREAM``)."""
        return self.local.stream_mode

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
        rs.close_columns(self, abort=True)
        pgs, self._leaders, self._all = [self._leaders, self._all], None, None
        groups.release(pgs, abort=True)
        del pgs

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
        rs.close_columns(self, abort=False)
        pgs, self._leaders, self._all = [self._leaders, self._all], None, None
        groups.release(pgs, abort=False)
        del pgs

    def wait_ticket(self, ticket: int, timeout_s: Optional[float] = None) -> None:
        """``Communicator.wait_ticket``: see :meth:`_Worker.wait`."""
        self._worker.wait(ticket, timeout_s)

    def anchor(self, ticket: int) -> None:
        """The future of call ``ticket`` has been taken (:meth:`_Worker.anchor`)."""
        self._worker.anchor(ticket)

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
        """``fn`` as a job: refused on an aborted or closed group; an error it raises keeps
        none of its frames' locals (:func:`.groups.forgetting_locals`: no Gloo group
        outlives the group's close through an error)."""
        def run() -> None:
            if self._aborted is not None:
                raise RuntimeError(f"flagos_shm: the multi-node group was aborted earlier ({self._aborted})")
            if self._closed:
                raise RuntimeError("the process group has been shut down")
            with groups.forgetting_locals():
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
        point-to-point between nodes), with Gloo's lazy connections (:func:`.groups.make_all`)."""
        with _ALL_LOCK:
            if self._all is None and self._aborted is None and not self._closed:
                self._all = groups.make_all(self._store, self._layout.base, self._rank, self._n, self._timeout_s)
            pg = self._all
        if pg is None:
            raise RuntimeError(f"flagos_shm: the multi-node group was aborted or shut down ({self._aborted})")
        return pg

    # ---- point-to-point between nodes (:mod:`.p2p`) ---------------------------------------

    def node_of(self, rank: int) -> int:
        """The node index of group rank ``rank``."""
        return self._node_of[rank]

    def is_remote(self, peer: int) -> bool:
        """Whether group rank ``peer`` is on another node than this rank."""
        return self._node_of[peer] != self._layout.node

    def send_remote(self, peer: int, peer_name: str, data: torch.Tensor, tag: int, deadline: float) -> None:
        """:func:`.p2p.send` over the all-ranks Gloo group (an error keeps no locals, as in
        :meth:`_guarded`)."""
        with groups.forgetting_locals():
            p2p.send(self._all_group(), peer, peer_name, data, tag, deadline)

    def recv_remote(self, peer: int, peer_name: str, data: torch.Tensor, tag: int, deadline: float) -> None:
        """:func:`.p2p.recv` over the all-ranks Gloo group (an error keeps no locals, as in
        :meth:`_guarded`)."""
        with groups.forgetting_locals():
            p2p.recv(self._all_group(), peer, peer_name, data, tag, deadline)
