"""Point-to-point: ``send``, ``recv`` (with tags), ``recv_anysource``, and so ``isend``,
``irecv`` and ``batch_isend_irecv``, on CPU and device tensors.

Each pair of group ranks that talk gets one small shared-memory segment, made on first use
(:class:`flagos_shm._core.P2PChannel`, ``rust/p2p/``): two rings (one per direction) of
``FLAGOS_SHM_P2P_SLOTS`` slots (default 4) of ``FLAGOS_SHM_P2P_SLOT_BYTES`` (default 64 KiB),
through which messages of any size stream; a slow receiver holds the sender back. Whichever
rank of the pair comes first creates the segment and publishes its path in the group's store
(key ``flagos_shm/p2p/<group segment>/<lo>-<hi>``); the file is unlinked as soon as both
ranks attached. Pairs that never talk cost nothing; ``recv_anysource`` connects this rank
to every peer.

Every operation runs on a worker thread of its own (peer, direction) — one for sends to a
peer, one for receives from it, one for ``recv_anysource`` — never on the group's
collective progress thread, so two ranks that each ``isend`` then ``irecv`` large messages
make progress. A synchronous ``send``/``recv`` is the same operation waited for. A send
completes when the matching receive has taken the message (as with Gloo and NCCL), or when
a receive of another tag from this rank has read it ahead (``docs/p2p.md``, Completion); a
receive of another size raises ``ValueError`` on both ranks; a dead or closing peer, an
abort, the group's timeout or Ctrl-C in ``Work.wait()`` raise ``RuntimeError`` naming the
peer. Device tensors are staged through pinned host memory like the collectives' tensors
(:mod:`flagos_shm.staging`): a send copies a device tensor out when it is issued, a receive
writes it back on the stream current at the call.

The work ``dist.isend``/``irecv`` return reports completion, and a receive's source rank
(``_source_rank()``, which ``dist.recv(src=None)`` reads), through the c10d adapter from
this module's :class:`P2PWork`. Memory cost and limits: ``docs/p2p.md``.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Optional


from ... import _core, staging
from ...work import ShmWork
from .. import options
from ...config import p2p_geometry, segment_config
from ..hierarchy import p2p as hierarchy_p2p
from ..rendezvous import published
from .base import CollectiveBase

__all__ = ["PointToPoint", "P2PWork"]

_KEY = "flagos_shm/p2p"
_ERROR = "error:"
_ANY_POLL_MAX_S = 0.001  # recv_anysource polls its channels, backing off up to 1 ms


class P2PWork(ShmWork):
    """The work of a send or receive; ``_source_rank()`` (what ``dist.recv`` and
    ``irecv(...)._source_rank()`` read) is the group rank the message came from."""

    _src: int = -1

    def _source_rank(self) -> int:
        return self._src


_live: "weakref.WeakSet[_Mailbox]" = weakref.WeakSet()


def _abort_all_at_exit() -> None:
    # Runs before the interpreter joins worker threads: a worker still blocked in a
    # transfer (its peer gone, nobody waiting) stops now instead of at the timeout.
    for box in list(_live):
        box.close(abort=True)


if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_abort_all_at_exit)


class _Mailbox:
    """The point-to-point state of one group on this rank: channels and workers."""

    def __init__(self, group: "PointToPoint"):
        self.rank, self.world_size = group._rank, group._world_size
        self.store = group._store
        self.group_name = group._group_name
        self.pids = list(getattr(group, "_pids", None) or [0] * self.world_size)
        self.segment_id = os.path.basename(group._comm.path)
        #: The group's core communicator on one node (None across nodes): tells whether a
        #: group rank has closed the group, so that waiting for it ends then.
        self.comm = group._comm if isinstance(group._comm, _core.Communicator) else None
        self.channels: dict = {}
        self.lock = threading.Lock()
        self.connecting: dict = {}  # peer -> lock held while connecting
        self.workers: dict = {}
        self.inflight = 0  # submitted operations not finished yet
        self.closed = False
        self.aborted = False
        _live.add(self)

    def peer_name(self, peer: int) -> str:
        pid = self.pids[peer] if peer < len(self.pids) else 0
        return f"group rank {peer}" + (f" (pid {pid})" if pid else "")

    # ---- workers --------------------------------------------------------------------

    def submit(self, key, fn) -> None:
        with self.lock:
            if self.closed:
                raise RuntimeError(f"process group {self.group_name!r} has been shut down")
            pool = self.workers.get(key)
            if pool is None:
                pool = self.workers[key] = ThreadPoolExecutor(1, thread_name_prefix=f"flagos_shm-p2p-{key}")
            self.inflight += 1

        def run() -> None:
            try:
                fn()
            finally:
                with self.lock:
                    self.inflight -= 1

        pool.submit(run)

    # ---- channels -------------------------------------------------------------------

    def channel(self, peer: int, deadline: float):
        """This rank's channel with ``peer``, connecting on first use."""
        chan = self.channels.get(peer)
        if chan is not None:
            return chan
        with self.lock:
            if self.closed:  # a transfer queued before the close: no new channel
                raise RuntimeError(f"process group {self.group_name!r} has been shut down")
            gate = self.connecting.setdefault(peer, threading.Lock())
        with gate:
            chan = self.channels.get(peer)
            if chan is None:
                chan = self._connect(peer, deadline)
                with self.lock:
                    if self.closed:
                        chan.close()
                        raise RuntimeError(f"process group {self.group_name!r} has been shut down")
                    self.channels[peer] = chan
                    if self.aborted:
                        chan.abort()
            return chan

    def _connect(self, peer: int, deadline: float):
        lo, hi = sorted((self.rank, peer))
        key = f"{_KEY}/{self.segment_id}/{lo}-{hi}"
        if self.store.add(key + "/claim", 1) == 1:  # first of the pair here: create it
            try:
                directory, _ = segment_config()
                slots, slot_bytes = p2p_geometry()
                path = _core.P2PChannel.create(directory, slots, slot_bytes)
            except Exception as exc:
                self.store.set(key, f"{_ERROR}{type(exc).__name__}: {exc}")
                raise
            self.store.set(key, path)
        else:
            pause = 0.0005
            while not self.store.check([key]):
                pid = self.pids[peer] if peer < len(self.pids) else 0
                if pid and _core.process_exited(pid) and not published(self.store, [key]):
                    raise RuntimeError(f"connecting to {self.peer_name(peer)}: the peer exited")
                if self.comm is not None and self.comm.peer_left(peer):
                    raise RuntimeError(f"connecting to {self.peer_name(peer)}: the peer closed the group "
                                       "(destroy_process_group)")
                if self.aborted or self.closed:
                    raise RuntimeError(f"connecting to {self.peer_name(peer)}: the group was aborted or shut down")
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"connecting to {self.peer_name(peer)}: its channel's path was not published "
                                       "within the group's timeout")
                time.sleep(pause)
                pause = min(2 * pause, 0.01)
            path = self.store.get(key).decode()
            if path.startswith(_ERROR):
                raise RuntimeError(f"connecting to {self.peer_name(peer)}: the peer could not create the channel: "
                                   f"{path[len(_ERROR):]}")
        side = 0 if self.rank == lo else 1
        pid = self.pids[peer] if peer < len(self.pids) else 0
        try:
            return _core.P2PChannel(path, side, pid, self.peer_name(peer), self.comm, peer)
        except FileNotFoundError as exc:
            raise RuntimeError(f"connecting to {self.peer_name(peer)}: its channel is gone (the peer closed or "
                               f"exited before this rank attached) ({exc})") from exc

    # ---- lifetime -------------------------------------------------------------------

    def abort(self, peers=None) -> None:
        """Abort the channels with ``peers`` (all, and later ones, when None)."""
        with self.lock:
            if peers is None:
                self.aborted = True
            chans = [c for p, c in self.channels.items() if peers is None or p in peers]
        for chan in chans:
            chan.abort()

    def close(self, abort: bool = False) -> None:
        """Stop the workers (aborting transfers still running if ``abort``) and close
        every channel."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            workers, self.workers = list(self.workers.values()), {}
            # Let go of the channels: each is unmapped once no transfer holds it any more,
            # not when the group object goes (a Work or dist.group.WORLD can keep that).
            chans, self.channels = list(self.channels.values()), {}
            busy = self.inflight > 0
        if abort or busy:
            for chan in chans:
                chan.abort()
        for pool in workers:
            pool.shutdown(wait=not abort)
        for chan in chans:
            chan.close()
        _live.discard(self)


class PointToPoint(CollectiveBase):
    """send / recv / recv_anysource of a group (see the module docstring)."""

    _mailbox: Optional[_Mailbox] = None

    def _p2p(self) -> _Mailbox:
        box = self._mailbox
        if box is None:
            with self._lock:
                box = self._mailbox
                if box is None:
                    box = self._mailbox = _Mailbox(self)
        return box

    def _p2p_check(self, name: str, tensors, peer: Optional[int], arg: str):
        """Validate a p2p call; return its one tensor. Errors are this rank's own (no peer
        is told, unlike a collective's argument errors)."""
        if self._closed:
            raise RuntimeError(f"flagos_shm {name}: process group {self._group_name!r} has been shut down")
        tensor = options.single(tensors, "tensors")
        if peer is not None:
            if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < self._world_size:
                raise ValueError(f"{arg}: expected a group rank in [0, {self._world_size}), got {peer!r}")
            if peer == self._rank:
                raise ValueError(f"{arg}: rank {peer} is this rank; flagos_shm does not send to itself")
        if self._pending or self._inflight:
            self._order_after([tensor])
        return tensor

    def _remote(self, peer: int) -> bool:
        """Whether ``peer`` is on another node (a group spanning nodes: Gloo, not a channel)."""
        is_remote = getattr(self._comm, "is_remote", None)
        return is_remote is not None and is_remote(peer)

    def _remote_issue(self, name: str, tensor, buf, peer: int, tag, direction: str) -> P2PWork:
        """Issue a send or receive to a peer on another node (:mod:`..hierarchy.p2p`): one
        worker per (peer, direction, tag), so that a receive never waits behind a message of
        another tag. Ctrl-C in ``wait()`` aborts the whole group (Gloo cannot abort one pair)."""
        comm = self._comm
        peer_name = f"group rank {peer} (node {comm.node_of(peer)})"
        tag = hierarchy_p2p.check_tag(tag, peer_name)
        data = hierarchy_p2p.byte_view(buf.ptr, buf.nbytes)

        def job(box, deadline, timeout_s):
            if direction == "send":
                comm.send_remote(peer, peer_name, data, tag, deadline)
                return self._rank
            comm.recv_remote(peer, peer_name, data, tag, deadline)
            buf.finish()
            return peer

        return self._issue(name, tensor, (peer, direction, tag), job, None,
                           abort=lambda: comm.abort(f"{name} with {peer_name} was interrupted"))

    def _issue(self, name: str, tensor, key, job, abort_peers, abort=None) -> P2PWork:
        box = self._p2p()
        work = P2PWork([tensor], pending=True, abort=abort or (lambda: box.abort(abort_peers)))
        deadline_s = self._timeout_s

        def run() -> None:
            try:
                src = job(box, time.monotonic() + deadline_s, deadline_s)
            except BaseException as exc:  # noqa: BLE001  stored in the work, re-raised by wait()
                work._complete(self._error(name, exc) if isinstance(exc, Exception) else exc)
            else:
                work._src = src
                work._complete()

        box.submit(key, run)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def send(self, tensors, dstRank, tag=0):
        """Send ``tensors[0]`` to group rank ``dstRank`` with ``tag``; the work completes
        when ``dstRank``'s matching receive has taken it."""
        tensor = self._p2p_check("send", tensors, dstRank, "dstRank")
        buf = staging.stage(tensor, "tensors[0]", read=True)
        if self._remote(dstRank):
            return self._remote_issue("send", tensor, buf, dstRank, tag, "send")
        tag = int(tag)

        def job(box, deadline, timeout_s):
            chan = box.channel(dstRank, deadline)
            chan.send(buf.ptr, buf.nbytes, tag, max(deadline - time.monotonic(), 0.0))
            return self._rank

        return self._issue("send", tensor, (dstRank, "send"), job, [dstRank])

    def recv(self, tensors, srcRank, tag=0):
        """Receive the next message with ``tag`` from group rank ``srcRank`` into
        ``tensors[0]`` (the sizes must match)."""
        tensor = self._p2p_check("recv", tensors, srcRank, "srcRank")
        buf = staging.stage(tensor, "tensors[0]", read=False, write=True)
        if self._remote(srcRank):
            return self._remote_issue("recv", tensor, buf, srcRank, tag, "recv")
        tag = int(tag)

        def job(box, deadline, timeout_s):
            chan = box.channel(srcRank, deadline)
            chan.recv(buf.ptr, buf.nbytes, tag, max(deadline - time.monotonic(), 0.0))
            buf.finish()
            return srcRank

        return self._issue("recv", tensor, (srcRank, "recv"), job, [srcRank])

    def recv_anysource(self, tensors, tag=0):
        """Receive the next message with ``tag`` from whichever peer has one first;
        ``work._source_rank()`` says which."""
        tensor = self._p2p_check("recv_anysource", tensors, None, "")
        if self._world_size < 2:
            raise ValueError(f"recv_anysource: group {self._group_name!r} has no other rank to receive from")
        remote = [r for r in range(self._world_size) if r != self._rank and self._remote(r)]
        if remote:
            raise NotImplementedError(f"recv_anysource: group {self._group_name!r} spans nodes (group ranks "
                                      f"{remote} are on other nodes); flagos_shm receives from any source only "
                                      "inside one node: pass the source rank")
        buf = staging.stage(tensor, "tensors[0]", read=False, write=True)
        tag = int(tag)
        peers = [r for r in range(self._world_size) if r != self._rank]

        def job(box, deadline, timeout_s):
            chans = [(p, box.channel(p, deadline)) for p in peers]
            pause = 0.00005
            while True:
                for peer, chan in chans:
                    if chan.try_recv(buf.ptr, buf.nbytes, tag, max(deadline - time.monotonic(), 0.0)):
                        buf.finish()
                        return peer
                if box.aborted or box.closed:
                    raise RuntimeError("the group's point-to-point channels were aborted or shut down")
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"no message with tag {tag} from any of group ranks {peers} within the "
                                       f"timeout of {timeout_s:.3f} s")
                time.sleep(pause)
                pause = min(2 * pause, _ANY_POLL_MAX_S)

        return self._issue("recv_anysource", tensor, ("any", "recv"), job, None)

    # ---- lifetime -----------------------------------------------------------------------

    def abort(self) -> None:
        if self._mailbox is not None:
            self._mailbox.abort()
        super().abort()

    def shutdown(self) -> None:
        box = self._mailbox
        if box is not None:
            if box.inflight and hasattr(self._comm, "is_remote"):  # Gloo waits cannot be cut short one by one
                self._comm.abort("the group was shut down with point-to-point transfers in flight")
            box.close()
        super().shutdown()

