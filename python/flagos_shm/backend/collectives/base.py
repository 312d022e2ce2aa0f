"""The state every collective of a group shares, and the per-call path around the core.

:class:`CollectiveBase` is mixed into both c10d adapters (``ProcessGroupShm`` and
``ShmBackend``); the collective families (``reduction``, ``allgather``, ``broadcast``,
``alltoall``, ``barrier``) build on it. A collective:

1. waits, if an earlier asynchronous call of this group still has to write results into
   memory that this call's tensors overlap (:meth:`_validating`): calls of one group behave
   as if issued on one stream, so a later call sees every earlier call's results;
2. validates and stages its arguments inside :meth:`_validating` (a rank whose arguments
   are invalid tells its peers through ``Communicator.fail``, so that they raise too);
3. issues its core calls through :meth:`_run`: inline, or queued on the group's progress
   thread for ``async_op=True`` (and every collective C++ callers such as DDP issue).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ... import _core, config, staging
from ...work import ShmWork
from .. import exiting, options, plan
from . import alltoall_errors
from ..rendezvous import attach, describe_layout, give_up, rendezvous

_log = logging.getLogger("flagos_shm")

__all__ = ["CollectiveBase", "SLOW"]

#: Returned by a collective's fast path (``_allreduce_fast``, ``_all_gather_single_fast``,
#: ``_reduce_scatter_single_fast``, ``_broadcast_fast``, ``_all_to_all_single_fast``) when the call is not its common
#: case: nothing was done, and the full path (all checks, staging) runs instead.
SLOW = object()
_CORE_DTYPES = staging.CORE_DTYPES  # real dtypes only: complex tensors take the full path
_STRIDED = torch.strided
_UNSET_TIMEOUT = options._UNSET_TIMEOUT


#: The groups this process set up (held weakly), for :func:`_shut_down_busy_groups_at_exit`.
_groups: "weakref.WeakSet[CollectiveBase]" = weakref.WeakSet()


def _shut_down_busy_groups_at_exit() -> None:
    """At interpreter exit, keep completion callbacks off the progress threads once Python
    may no longer run them:

    * each group of this process that still has asynchronous work queued or running (a
      call made with ``async_op=True``, or by DDP, and never waited for) is shut down as
      :meth:`CollectiveBase.shutdown` does: the work is aborted, so it fails with
      RuntimeError here and the peers' matching calls fail at once too, as for a rank
      that exits, and its callbacks run now, while Python can run them;
    * the other groups run later calls inline (as with ``FLAGOS_SHM_ASYNC=0``): an
      ``async_op=True`` call made after this (by an ``atexit`` handler registered before
      ``import flagos_shm``) returns a completed work;
    * ``_core.python_exiting`` keeps the binding's other threads out of Python from then
      on (``rust/binding/exit.rs``): a callback still left (a call queued by another thread
      meanwhile) is leaked, and a daemon thread still in a call stops checking for signals
      and, if its call ends while the interpreter finalizes, parks until the process exits;
    * a thread that left a failed call for torch before now (a daemon thread whose call a
      ``destroy_process_group`` just before the exit, or the exit's abort of point-to-point
      transfers, ended) is waited for, the GIL released, until it raises in Python
      (:func:`flagos_shm.backend.exiting.wait_for_landings`), and from now on such a thread
      parks instead (:func:`flagos_shm.backend.exiting.exit_handler_begins`): before,
      torch's frames took the GIL back for it during finalization and the process aborted.

    A queued call's callback used to run on the progress thread after the interpreter had
    finalized: two ranks exiting with ten 256 KiB ``reduce_scatter_tensor(async_op=True)``
    calls not waited for, 8 runs (Intel Xeon VM), printed a panic of the progress thread in 5
    and aborted with SIGABRT ("terminate called without an active exception") in 1.
    Registered with :func:`atexit.register` when this module is imported, so it runs after
    the ``atexit`` handlers registered later (a user's ``destroy_process_group`` at exit)."""
    exiting.exit_handler_begins()
    for group in list(_groups):
        if group._pid != os.getpid() or group._closed:
            continue
        group._async = False
        if group._busy():
            with contextlib.suppress(Exception):
                group.shutdown()
    _core.python_exiting()
    exiting.wait_for_landings()


atexit.register(_shut_down_busy_groups_at_exit)


def fast_dtype(t) -> Optional[str]:
    """The core dtype of ``t`` if it is a tensor the fast paths take as it is, else None:
    an exact ``torch.Tensor`` on the CPU, strided, contiguous, without a lazy negation,
    of a real core dtype. (Each fast path also checks that the tensor's address is a
    multiple of its element size, where it reads the address: the core refuses others,
    the full path stages them.)"""
    if type(t) is not torch.Tensor or not t.is_cpu or t.layout != _STRIDED or not t.is_contiguous() or t.is_neg():
        return None
    return _CORE_DTYPES.get(t.dtype)


class _Validation:
    """Context manager around a call's argument checks and staging: if they raise
    (ValueError/TypeError for bad arguments), tell the peers through
    ``Communicator.fail`` so that they raise too instead of waiting; the error propagates."""

    __slots__ = ("comm", "name")

    def __init__(self, comm, name: str):
        self.comm, self.name = comm, name

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and issubclass(exc_type, Exception):
            with contextlib.suppress(Exception):  # the caller's error matters more
                self.comm.fail(self.name, f"{exc_type.__name__}: {exc}")
        return False


class _CallGate:
    """Admits this rank's core calls on a group until the group is shut down, and tells the
    shutdown whether one is under way (in another thread: it is aborted first).

    Its lock is held to admit and to count, never across a call. A core call can block
    until the group's earlier asynchronous calls have finished, their completion callbacks
    included, and a callback may issue a collective of the group itself: on the progress
    thread, or on this very thread when the core runs the queued calls here (a call made
    from a callback, as torch's PowerSGD hook makes). A lock held across the call deadlocked
    both ways (found 2026-12-07: two ``async_op`` allreduces whose ``.then`` callbacks issue
    allreduces; a ``.then`` callback that issues one while the main thread makes a
    synchronous call). The calls need no lock for their order: the core runs them one at a
    time in issue order (``Progress::run``, ``Progress::submit``; a group spanning nodes:
    ``hierarchy.worker``)."""

    __slots__ = ("_lock", "_calls", "_closed")

    def __init__(self):
        self._lock = threading.Lock()
        self._calls = 0
        self._closed = False

    def __enter__(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the process group has been shut down")
            self._calls += 1

    def __exit__(self, exc_type, exc, tb) -> bool:
        with self._lock:
            self._calls -= 1
        return False

    def close(self) -> bool:
        """Admit no more calls; return whether one is under way."""
        with self._lock:
            self._closed = True
            return self._calls > 0


def _tensors(items, out: list) -> list:
    """Append every tensor of ``items`` (a tensor or nested lists/tuples of them) to ``out``."""
    if isinstance(items, torch.Tensor):
        out.append(items)
    elif isinstance(items, (list, tuple)):
        for item in items:
            _tensors(item, out)
    return out


def _extents(tensors) -> list:
    """(device, first byte, end byte) of each strided tensor's memory."""
    spans = []
    for t in tensors:
        if t.layout != torch.strided or t.is_meta or t.numel() == 0:
            continue
        start = t.data_ptr()
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
        spans.append((t.device, start, start + (last + 1) * t.element_size()))
    return spans


def _overlap(a: list, b: list) -> bool:
    return any(da == db and sa < eb and sb < ea for da, sa, ea in a for db, sb, eb in b)


class CollectiveBase:
    """Group state and the per-call path (see the module docstring). Not a c10d class on
    its own: the adapters mix it into ``dist.ProcessGroup`` or ``c10d.Backend``."""

    _coalesced: Optional[list] = None  # the works issued since start_coalescing (Backend route)
    #: A synchronous call (``asyncOp`` False) that succeeded returns ``None`` (c10d's "the
    #: backend synchronised at C++ level": ``dist.*`` then skips ``wait()``) and one that
    #: failed raises at once, instead of returning a completed work. The per-device adapter
    #: sets this: on that route a work costs a C++ holder and a trampoline call to
    #: ``wait()``. A call that asked for ``async_op=True`` always gets a work, also when it
    #: ran inline (``FLAGOS_SHM_ASYNC=0``).
    _sync_returns_none = False

    # ---- set-up and lifetime ----------------------------------------------------------

    def _setup(self, store: dist.Store, rank: int, world_size: int, timeout=default_pg_timeout,
               group_name: str = "", global_ranks: Optional[list] = None,
               known_peers: Optional[dict] = None) -> None:
        """Meet the group's other ranks through ``store`` and attach to the segment.

        Args:
            store: the group's store (private to the group; c10d passes a ``PrefixStore``).
            rank: this process's group rank, ``0 <= rank < world_size``.
            world_size: number of ranks in the group (on one node or several: see
                :mod:`flagos_shm.backend.rendezvous` and :mod:`flagos_shm.backend.hierarchy`).
            timeout: the group's timeout (``timedelta`` or seconds) for attaching and for
                each collective unless its options give another one.
            group_name: the c10d group name, used in error messages.
            global_ranks: the default group's rank of each of the group's ranks (c10d's
                ``global_ranks_in_group``), or None where unknown; kept for the groups made
                later (:meth:`identities_by_global_rank`).
            known_peers: group rank -> identity (:func:`..rendezvous.identity`) of the
                ranks whose process is known from this process's other live groups (the
                c10d adapter's ``known_peers``, a parent's layout for a split), or None: a
                rank among them that exited before joining is noticed at once instead of
                at the timeout.

        Raises:
            ValueError: ``timeout`` is zero or negative, a malformed setting on this rank
                (:func:`flagos_shm.config.check_group_settings`; the other ranks raise
                RuntimeError naming it), ``rank`` out of range, or a malformed or differing
                ``FLAGOS_SHM_PLAN`` on any rank (on every rank; :func:`.plan.setup`).
            OSError: the segment directory is too small (on rank 0).
            RuntimeError: a peer did not attach in time, exited, gave up (a malformed
                setting there), or rank 0 failed to create the segment.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
        self._rank, self._world_size = rank, world_size
        self._group_name = group_name
        self._store = store
        self._lock = threading.Lock()  # this object's own lazily made parts (the p2p mailbox)
        self._gate = _CallGate()
        self._closed = False
        self._async = config.async_enabled()
        self._pending: list = []  # (work, extents) of async works that write outputs back later
        # (work, output tensors) of async works that write their outputs in place, in issue
        # order: the core orders later core calls after them, but a full-path call copies
        # (stages) its tensors before its own core call, so it must wait for those first.
        self._inflight: collections.deque = collections.deque()
        self._pid = os.getpid()
        timeout_s = options.timeout_seconds(timeout)
        if timeout_s is None and timeout is not None and timeout != options.UNSET_TIMEOUT:
            # Gloo fails every call at once with 0 and refuses a negative timeout; this used to
            # become the 30-minute default silently. Every rank learns it (give_up).
            exc = ValueError(f"timeout: expected a positive duration for group {group_name!r}, got {timeout!r}")
            give_up(store, rank, world_size, exc)
            raise exc
        timeout_s = timeout_s or default_pg_timeout.total_seconds()
        self._timeout_s = timeout_s
        where = f"flagos_shm group {group_name!r} (rank {rank}/{world_size})"
        self._where = where
        # only a hint for the set-up: a list of another length (no c10d caller gives one) is ignored
        ok = global_ranks is not None and len(global_ranks) == world_size
        self._global_ranks = [int(g) for g in global_ranks] if ok else None
        try:
            layout = rendezvous(store, rank, world_size, timeout_s, known_peers or {})
        except RuntimeError as exc:  # a store wait timed out, a rank exited, or rank 0 failed to create
            raise options.with_context(exc, f"{where}: setting up: {exc}") from exc
        self._layout = layout
        if _log.isEnabledFor(logging.INFO):  # how a user checks where the ranks of a group are
            _log.info("%s: %s; this rank is local rank %d of %d on node %d", where, describe_layout(layout),
                      layout.local_rank, layout.local_size, layout.node)
        # group rank -> process id (0 unknown), for point-to-point
        self._pids = [int(peer.get("pid", 0)) for peer in layout.peers]
        if layout.single_node:
            self._comm = attach(layout, timeout_s, where)
            try:
                self._plan, self._plan_source = plan.setup(self._comm, store, layout, rank, world_size, where,
                                                           timeout_s)
            except BaseException as exc:
                self._comm.close()
                if isinstance(exc, RuntimeError):  # a peer exited or gave up while this waited
                    raise options.with_context(exc, f"{where}: setting up: {exc}") from exc
                raise
        else:  # the group spans nodes: shared memory inside each, Gloo between them
            from ..hierarchy import HierarchicalComm

            self._comm = HierarchicalComm(store, layout, rank, world_size, timeout_s, where)
            self._plan, self._plan_source = self._comm.plan, self._comm.plan_source
        _groups.add(self)

    def identities_by_global_rank(self) -> dict:
        """Default-group rank -> identity (:func:`..rendezvous.identity`) of each of this
        group's ranks, as its set-up learned them; empty when the group's global ranks are
        unknown, or it has been shut down, or it was made in another process (before a
        fork). What the c10d adapter tells a later group's set-up about its ranks."""
        if self._global_ranks is None or self._closed or self._pid != os.getpid():
            return {}
        return dict(zip(self._global_ranks, self._layout.peers))

    def set_timeout(self, timeout) -> None:
        """Set the default timeout of later collectives (``timedelta`` or seconds > 0).

        Raises:
            ValueError: not a positive duration.
        """
        seconds = options.timeout_seconds(timeout)
        if seconds is None:
            raise ValueError(f"timeout: expected a positive duration, got {timeout!r}")
        self._timeout_s = seconds
        self._comm.set_timeout(seconds)

    def abort(self) -> None:
        """Mark the group aborted: waiting peers wake up and every later call raises RuntimeError."""
        if not self._closed:
            self._comm.abort()

    def shutdown(self) -> None:
        """Release the shared memory (idempotent); later calls raise RuntimeError.

        A collective still running on this rank (in another thread) is cut short: the group
        is aborted first, so that call raises RuntimeError at once, as do the peers' calls,
        instead of holding the segment until the timeout."""
        if not self._closed:
            self._closed = True
            if self._gate.close():  # a collective under way on this rank
                self._comm.abort()
            self._comm.close()

    # ---- the per-call path ------------------------------------------------------------

    def _validating(self, name: str, tensors=()) -> _Validation:
        """Context for a call's argument checks and staging (see :class:`_Validation`).

        Args:
            tensors: the call's tensor arguments (tensors or nested lists of them): if an
                earlier asynchronous call of this group has still to write into memory they
                overlap, wait for it first.

        Raises:
            RuntimeError: the group has been shut down.
        """
        if self._closed:
            raise RuntimeError(f"flagos_shm {name}: process group {self._group_name!r} has been shut down")
        if self._pending or self._inflight:
            self._order_after(tensors)
        return _Validation(self._comm, name)

    def _order_after(self, tensors) -> None:
        """Wait for each earlier async work whose pending write-back, or in-place write,
        overlaps ``tensors``."""
        self._pending = [(w, e) for w, e in self._pending if not w.is_completed()]
        self._prune_inflight()
        if not self._pending and not self._inflight:
            return
        mine = _extents(_tensors(tensors, []))
        # Works of a group complete in issue order: waiting for the last overlapping one
        # covers the earlier ones. Its error is its own; this call goes on. A work whose
        # completion callbacks this thread runs (a call made from one) has its results in:
        # waiting for it would wait for this very call.
        last = None
        for i, (work, spans) in enumerate(self._pending):
            if _overlap(mine, spans) and not work.completing_here():
                last = i
        if last is not None:
            with contextlib.suppress(Exception):
                self._pending[last][0].wait()
            del self._pending[: last + 1]
        last = None
        for i, (work, outs) in enumerate(self._inflight):
            if _overlap(mine, _extents(outs)) and not work.completing_here():
                last = i
        if last is not None:
            with contextlib.suppress(Exception):
                self._inflight[last][0].wait()
            for _ in range(last + 1):
                self._inflight.popleft()

    def _writing_back(self) -> bool:
        """Whether an earlier async work still has to write outputs back (``_pending``): a
        fast path then returns :data:`SLOW` (the full path orders after it). Completed
        works are forgotten here too, not only on the full path, so one such call does not
        keep every later call off the fast paths. Call it as ``self._pending and
        self._writing_back()`` (nothing to do when the list is empty)."""
        self._pending = [(w, e) for w, e in self._pending if not w.is_completed()]
        return bool(self._pending)

    def _busy(self) -> bool:
        """Whether an asynchronous call of this group has not completed yet."""
        self._prune_inflight()
        return bool(self._inflight) or self._writing_back()

    def _prune_inflight(self) -> None:
        """Forget the finished works at the front of ``_inflight`` (they finish in order)."""
        while self._inflight and self._inflight[0][0].is_completed():
            self._inflight.popleft()

    def _track_inflight(self, work: ShmWork, outputs: list) -> None:
        """Remember a queued work that writes ``outputs`` in place (see ``_inflight``)."""
        self._prune_inflight()
        self._inflight.append((work, outputs))

    def _args(self, opts, loose: Optional[str] = None, *, op=None, root=None, timeout=None) -> options.Args:
        return options.parse(opts, self._world_size, loose, op=op, root=root, timeout=timeout)

    def _run(self, name: str, outputs: list, buffers: Sequence[staging.HostBuffer],
             calls: Sequence[Callable], opts=None, after: Optional[Callable[[], None]] = None,
             can_async: bool = True, async_op: Optional[bool] = None) -> Optional[ShmWork]:
        """Issue the core calls of one collective and return its ShmWork (``None`` for a
        synchronous call that succeeded when ``_sync_returns_none``; it then raises on failure).

        Args:
            outputs: the caller's output tensors (the work's result).
            buffers: staged buffers to write back (:func:`staging.finish`) after the calls.
            calls: each issues one core call, given the ``done`` argument to pass on to it
                (``None``: run inline; a callable: queue it on the progress thread).
            opts: the call's options; ``opts.asyncOp`` (c10d sets it from ``async_op``, and
                it defaults to True for C++ callers such as DDP) selects the asynchronous
                path unless ``FLAGOS_SHM_ASYNC=0`` or ``can_async`` is False.
            after: run once every call has succeeded, before the write-back (e.g. copying a
                scratch buffer out into the caller's list of tensors).
            async_op: the call's ``asyncOp`` when the caller has read it already (``opts``
                is then not looked at).

        Validation is over when this is called; errors raised by the transfer are stored in
        the work (``wait()`` re-raises them), prefixed with the group.
        """
        if async_op is None:
            async_op = getattr(opts, "asyncOp", False) is True
        if can_async and self._async and async_op:
            work = self._run_async(name, outputs, buffers, calls, after)
        else:
            error = self._run_inline(name, buffers, calls, after)
            # A caller that asked for async_op=True (run inline: FLAGOS_SHM_ASYNC=0, or a
            # call that cannot queue) still gets a work to wait on; None would crash C++
            # callers that wait on it (DDP's reducer and parameter check).
            if self._sync_returns_none and not async_op:
                if error is not None:
                    raise error
                return None
            work = ShmWork(outputs, error)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _fast_pair(self, opts, opts_type, small, big) -> Optional[str]:
        """The checks the two-tensor fast paths share (allgather: ``small`` the input,
        ``big`` the output; reduce-scatter the other way round): ``opts`` exactly of
        ``opts_type`` without a per-call timeout, nothing pending or coalescing, an open
        group, both tensors taken by :func:`fast_dtype`, of one dtype, ``small`` not empty
        and ``big`` exactly ``world_size`` times it. Returns the core dtype, or None."""
        if (type(opts) is not opts_type or (self._pending and self._writing_back()) or self._closed
                or self._coalesced is not None):
            return None
        dtype = fast_dtype(small)
        if (dtype is None or fast_dtype(big) is None or big.dtype != small.dtype or opts.timeout != _UNSET_TIMEOUT
                or small.numel() == 0 or big.numel() != self._world_size * small.numel()):
            return None
        return dtype

    def _fast_call(self, name: str, outputs: list, issue: Callable, async_op, inputs=()) -> Optional[ShmWork]:
        """The tail every fast path shares: one core call on the caller's own memory (no
        staging, no write-back), run inline, or queued on the progress thread when
        ``async_op`` is True (and async is on). What :meth:`_run` does for such a call,
        without what it does not need (staging, write-back); a queued call is recorded in
        ``_inflight``, so that later calls that stage overlapping memory wait for it.

        Args:
            outputs: the caller's tensors: the work's result; the work (and so the queued
                call's callback) holds them until the core has finished with their memory.
            inputs: the other tensors the call reads, held as long (an input the caller
                drops at once, such as a temporary, must not be freed under the core).
            issue: issues the core call, given its ``done`` argument (None: inline); returns
                the core's ticket.
            async_op: the call's ``opts.asyncOp``.

        The caller has checked that nothing is pending, coalescing or closed.
        """
        if async_op is True and self._async:
            comm = self._comm
            ticket = 0
            work = ShmWork(outputs, pending=True, abort=self.abort,
                           help=lambda *timeout_s: comm.wait_ticket(ticket, *timeout_s),
                           anchor=lambda: comm.anchor(ticket))

            def done(error, _inputs=inputs, *, early: bool = False) -> None:  # the core holds done, done the inputs
                work._complete(None if error is None else self._error(name, error), early=early)

            try:
                with self._gate:
                    ticket = issue(done)
            except Exception as exc:  # not queued: the callback never runs
                work._complete(self._error(name, exc))
            self._track_inflight(work, outputs)
            return work
        error = None
        try:
            with self._gate:
                issue(None)
        except Exception as exc:
            error = self._error(name, exc)
        if self._sync_returns_none and async_op is not True:  # as in _run
            if error is not None:
                raise error
            return None
        return ShmWork(outputs, error)

    def _run_inline(self, name: str, buffers: Sequence[staging.HostBuffer], calls: Sequence[Callable],
                    after: Optional[Callable[[], None]]) -> Optional[Exception]:
        """Run ``calls`` on this thread (after every earlier queued call of the group);
        return the error (with the group in its message), or ``None``."""
        try:
            with self._gate:
                for call in calls:
                    call(None)
                if after is not None:
                    after()
                staging.finish(buffers)
        except Exception as exc:
            return self._error(name, exc)
        return None

    def _run_async(self, name: str, outputs: list, buffers: Sequence[staging.HostBuffer],
                   calls: Sequence[Callable], after: Optional[Callable[[], None]]) -> ShmWork:
        """Queue ``calls`` on the progress thread; the work completes after the last one.

        The completion callback runs on the progress thread (GIL held): it runs ``after``
        and the write-back, then completes the work and its future. The callback holds the
        buffers (and so the caller's tensors and pinned staging memory) until then. A work
        that writes its outputs back this late is remembered in ``_pending`` so that later
        calls on overlapping memory wait for it (:meth:`_order_after`).
        """
        tickets = [0]
        comm = self._comm
        work = ShmWork(outputs, pending=True, abort=self.abort,
                       help=lambda *timeout_s: comm.wait_ticket(tickets[0], *timeout_s),
                       anchor=lambda: comm.anchor(tickets[0]))
        # The core only holds raw addresses: everything the calls read or write (captured
        # by the ``calls`` closures: inputs, scratch and packed buffers) must stay alive
        # until the last call has finished.
        keep_alive = [calls, buffers, after]
        left = [len(calls)]
        errors: list = []
        lock = threading.Lock()
        #: The work's outcome once written back early (``done(error, early=True)``).
        delivered: list = []

        def done(error, count: int = 1, *, early: bool = False) -> None:
            # ``early`` (the core, for the last call, waited for from an earlier-anchored
            # callback): write back and complete the work for its waiters only; the later
            # ``done(None)`` runs its callbacks (ShmWork._complete).
            if delivered:
                work._complete(delivered[0])
                return
            with lock:
                if error is not None:
                    errors.append(error)
                left[0] -= count
                last = left[0] == 0
            if not last:
                return
            first = errors[0] if errors else None
            keep_alive.clear()
            if first is None:
                try:
                    if after is not None:
                        after()
                    staging.finish(buffers)
                except Exception as exc:
                    first = exc
            outcome = None if first is None else self._error(name, first)
            if early:
                delivered.append(outcome)
            work._complete(outcome, early=early)

        if not calls:
            work._complete()
            return work
        if after is not None or any(b._write_back for b in buffers):
            self._pending.append((work, _extents(_tensors(outputs, []))))
        else:
            self._track_inflight(work, _tensors(outputs, []))
        for i, call in enumerate(calls):
            try:
                with self._gate:
                    tickets[0] = max(tickets[0], call(done) or 0)
            except Exception as exc:  # not queued: this and the later calls never report
                done(exc, len(calls) - i)
                break
        return work

    def _error(self, name: str, exc: Exception) -> Exception:
        """Re-create ``exc`` with the group, rank and collective in its message."""
        detail = alltoall_errors.name_arguments(name, exc)
        message = f"flagos_shm {name} on group {self._group_name!r} (rank {self._rank}/{self._world_size}): {detail}"
        try:
            wrapped = type(exc)(message)
        except Exception:
            return exc
        wrapped.__cause__ = exc
        return wrapped

    def _stage_pair(self, output, input, out_arg: str, in_arg: str, own_piece: bool = False):
        """Stage an (output, input) pair of one dtype; copy the input if it overlaps the output.

        Args:
            own_piece: an allgather's pair: an input that is exactly this rank's piece of the
                output (FSDP's in-place all-gather) is used where it lies, not copied, when
                the group is the core's (its allgather reads the input before writing
                anything else and never writes that piece with other bytes; a group
                spanning nodes copies it as before)."""
        out = staging.stage(output, out_arg, read=False, write=True)
        inp = staging.stage(input, in_arg, read=True)
        options.same_dtype([out, inp], [out_arg, in_arg])
        if inp.overlaps(out) and not (own_piece and type(self._comm) is _core.Communicator
                                      and out.nbytes == self._world_size * inp.nbytes
                                      and inp.ptr == out.ptr + self._rank * inp.nbytes):
            copy = staging.scratch(inp.host.numel(), inp.host.dtype)
            staging.copy_into(copy.host, inp.host.reshape(-1))
            inp = staging.stage(copy.host.view(inp.host.shape), in_arg)
        return out, inp

    def _stage_pairs(self, outputs, inputs) -> list:
        inputs = options.tensor_list(inputs, "inputs")
        outputs = options.tensor_list(outputs, "outputs", len(inputs))
        return [self._stage_pair(o, t, f"outputs[{i}]", f"inputs[{i}]")
                for i, (o, t) in enumerate(zip(outputs, inputs))]

    def _root_list(self, lists, arg: str, root: int, like: staging.HostBuffer, write: bool) -> list:
        """The root's list of ``world_size`` tensors shaped like ``like``; [] on other ranks."""
        lists = options.tensor_list(lists, arg)
        if self._rank != root:
            if any(not isinstance(item, (list, tuple)) or len(item) for item in lists):
                raise ValueError(f"{arg}: only the root (rank {root}) passes tensors here; "
                                 f"expected [] on rank {self._rank}")
            return []
        tensors = options.tensor_list(options.single(lists, arg), f"{arg}[0]", self._world_size)
        options.check_list(tensors, f"{arg}[0]", like, write)
        for i, t in enumerate(tensors):
            if t.numel() != like.tensor.numel():
                raise ValueError(f"{arg}[0][{i}]: expected {like.tensor.numel()} elements, got {t.numel()}")
        return tensors
