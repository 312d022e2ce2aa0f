"""The work of every flagos_shm call, as the group's Python side sees it (the c10d adapter
wraps it in the ``c10d::Work`` torch returns)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch

__all__ = ["CoalescedWork", "ShmWork"]

_log = logging.getLogger("flagos_shm")


class _Completed:
    """Stands for a set ``threading.Event`` (shared by every completed work)."""

    @staticmethod
    def is_set() -> bool:
        return True

    @staticmethod
    def wait(timeout=None) -> bool:
        return True

    def set(self) -> None:
        pass


_COMPLETED = _Completed()


class _Latch:
    """A one-shot event: ``set`` once, ``wait`` any number of times, from any thread.

    What ``threading.Event`` offers a work, at a fraction of its cost: an Event builds a
    Condition and two locks (4.1 us per work on the AMD EPYC VM, more than the rest of an
    asynchronous 4-byte allreduce's Python), a latch one lock, taken at creation and
    released by :meth:`set`. A waiter takes it (blocking, with a timeout, interruptible by
    signals as ``Lock.acquire`` is) and hands it straight back to the next waiter.
    ``set`` must be called at most once (``ShmWork._complete`` guards it)."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        self._lock.release()

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self._lock.release()
            return True
        return self._set
_NO_LOCK = contextlib.nullcontext()


#: {thread ident: the work} for each thread blocked in :meth:`ShmWork.wait` now: once the
#: work completes, the interpreter's exit waits for the thread to leave the wait and raise
#: (:func:`flagos_shm.backend.exiting.wait_for_landings`).
WAITING: dict = {}


class ShmWork:
    """Handle of one flagos_shm call, as the Python side of the group sees it.

    torch never sees this object: the c10d adapter (``csrc/c10d_adapter.cpp``) wraps it in
    a C++ ``c10d::Work`` that :meth:`_on_complete` tells when the call finishes, so that the
    work ``dist.*`` returns answers ``is_completed()``, ``is_success()``, ``exception()`` and
    ``get_future()`` from C++, and forwards ``wait()`` (and ``_source_rank()``) here.

    A synchronous call that ran inline is complete when made. An asynchronous one
    (``async_op=True``, and every collective DDP issues) is returned at once while the call
    runs on the group's progress thread; it completes when the results are in the caller's
    tensors (device tensors: when their host-to-device copy has been enqueued on the stream
    that was current at the call). A failure is stored here and re-raised by :meth:`wait`.

    Args:
        outputs: the caller's output tensors.
        error: the exception the call failed with, or ``None``.
        pending: ``True`` for a work completed later by :meth:`_complete`.
        abort: called (no arguments) when :meth:`wait` gives up (timeout or Ctrl-C), to
            abort the group so that the running collective stops on every rank.
        help: called (blocking) by :meth:`wait` to finish the work on the waiting thread if
            the progress thread has not started it yet: with no arguments without a
            timeout; with the timeout in seconds otherwise, when it returns at once unless
            the waiting thread is in one of the group's completion callbacks, where no
            other thread may run the work (it then gives up after that long).
        anchor: called (no arguments) by :meth:`_future_taken`: tells the group that
            callbacks may be attached to the work's future (``Progress::anchor`` in the core).
    """

    # Defaults of a completed, successful work, kept on the class: the common, latency-
    # critical case sets only its outputs (and builds no latch or lock).
    _error: Optional[BaseException] = None
    _abort: Optional[Callable[[], None]] = None
    _help: Optional[Callable[[], None]] = None
    _anchor: Optional[Callable[[], None]] = None
    _done = _COMPLETED
    _lock = _NO_LOCK
    #: Functions to call with the error (or None) when the work completes; None once it has.
    _callbacks: Optional[list] = None
    #: The thread running this work's completion callbacks (:meth:`completing_here`).
    _completer: int = 0

    def __init__(self, outputs: list[torch.Tensor], error: Optional[BaseException] = None, *,
                 pending: bool = False, abort: Optional[Callable[[], None]] = None,
                 help: Optional[Callable[[], None]] = None, anchor: Optional[Callable[[], None]] = None):
        self._outputs = outputs
        if error is not None:
            self._error = error
        if pending:
            self._abort, self._help, self._anchor = abort, help, anchor
            self._done, self._lock = _Latch(), threading.Lock()
            self._callbacks = []

    def _on_complete(self, fn: Callable, *args) -> None:
        """Call ``fn(*args, error)`` (``error`` None on success) once the work has completed:
        at once if it has, else from :meth:`_complete`, before :meth:`wait` returns. (The
        c10d adapter passes one function for all its works and the work's handle as
        ``args``: making a function per work cost it several us a call.)"""
        with self._lock:
            callbacks = self._callbacks
            if callbacks is not None:
                callbacks.append((fn, args))
                return
        fn(*args, self._error)

    def _future_taken(self) -> None:
        """Called by the c10d adapter when the work's future is first taken, while the
        work is pending: callbacks attached to the future (``then``) may issue collectives
        when it completes, and the group places those calls right after the calls issued
        up to now, on every rank alike, as NCCL does (its futures complete at enqueue, so a
        callback runs as it is attached). Without this, whether a later call went first
        depended on which thread got there first (torch's PowerSGD hook on several DDP
        buckets: ranks disagreed)."""
        if self._anchor is not None and not self._done.is_set():
            try:
                self._anchor()
            except Exception:  # noqa: BLE001  a group closed or not this process's: nothing to order
                pass

    def _complete(self, error: Optional[BaseException] = None, *, early: bool = False) -> None:
        """Mark the work finished (with ``error`` if it failed) and tell its callbacks.

        Args:
            error: the call's error, or ``None``.
            early: complete only for :meth:`wait` (and :meth:`is_completed`): the callbacks
                (the c10d work's, and so its future's) run at a later ``_complete()``,
                whose ``error`` is then ignored. The group does this for a work waited for
                from a callback of a work whose future was taken before this one's: NCCL
                runs this work's future callbacks after that callback has returned, so the
                calls they issue go after that callback's (``Progress::submit_with_results``
                in the core).
        """
        with self._lock:
            callbacks = self._callbacks
            if callbacks is None:  # completed already (or being completed by another thread)
                return
            if self._done.is_set():  # completed early: the callbacks' turn
                error = self._error
            else:
                self._error = error
                if early:
                    self._done.set()
                    return
            self._callbacks = None
            self._completer = threading.get_ident()
        for fn, args in callbacks:
            try:
                fn(*args, error)
            except Exception:  # noqa: BLE001  a callback's failure must not keep the work open
                _log.exception("flagos_shm: a work completion callback failed")
        if not self._done.is_set():
            self._done.set()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Block until the call has finished; return ``True``.

        Args:
            timeout: give up after this long (``timedelta`` or seconds); ``None`` (or <= 0)
                waits for the call, which itself ends within the group's timeout.

        Raises:
            the call's error (``RuntimeError``, ``ValueError``, ...) if it failed;
            RuntimeError: ``timeout`` passed first (the group is then aborted, since its
                ranks no longer agree on what has completed);
            KeyboardInterrupt: Ctrl-C while waiting (the group is aborted as well).
        """
        if not self._done.is_set():
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
            if seconds is not None and seconds <= 0:
                seconds = None  # c10d's "unset" timeout
            ident = threading.get_ident()
            outer = WAITING.get(ident)
            WAITING[ident] = self
            try:
                left = seconds
                if self._help is not None:
                    if seconds is None:
                        self._help()  # runs it here if still queued; bounded by the group's timeout
                    else:
                        deadline = time.monotonic() + seconds
                        self._help(seconds)  # in one of the group's callbacks only
                        left = max(deadline - time.monotonic(), 0.0)
                finished = self._done.wait(left)
            except BaseException:
                self._give_up()
                raise
            finally:
                if outer is None:
                    del WAITING[ident]
                else:
                    WAITING[ident] = outer
            if not finished:
                self._give_up()
                raise RuntimeError(f"flagos_shm: the collective did not complete within {seconds:.3f} s of "
                                   "Work.wait(); the process group was aborted")
        if self._error is not None:
            raise self._error
        return True

    def completing_here(self) -> bool:
        """Whether the calling thread is running this work's completion callbacks (e.g. a
        ``get_future().then`` callback): its results are in, and waiting for the work
        there would wait for the caller itself."""
        return self._completer == threading.get_ident() and not self._done.is_set()

    def _give_up(self) -> None:
        if self._abort is not None:
            self._abort()

    def _source_rank(self) -> int:
        raise RuntimeError("flagos_shm: only a receive from any source has a source rank")

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error


class CoalescedWork:
    """The work of a coalesced batch (``end_coalescing``): finished when every work of the
    batch has finished; :meth:`wait` raises the first error among them.

    Args:
        works: the batch's works (:class:`ShmWork`), in issue order.
    """

    def __init__(self, works: list):
        self._works = list(works)

    def _on_complete(self, fn: Callable, *args) -> None:
        """Call ``fn(*args, first error or None)`` once every work of the batch has completed."""
        works = self._works
        if not works:
            fn(*args, None)
            return
        left = [len(works)]
        errors: list = [None] * len(works)
        lock = threading.Lock()

        def one(i: int, error) -> None:
            with lock:
                errors[i] = error
                left[0] -= 1
                last = left[0] == 0
            if last:
                fn(*args, next((e for e in errors if e is not None), None))

        for i, work in enumerate(works):
            work._on_complete(lambda error, i=i: one(i, error))

    def _future_taken(self) -> None:
        """The batch's future is settled by its last work's completion: that one anchors
        (:meth:`ShmWork._future_taken`)."""
        if self._works:
            self._works[-1]._future_taken()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Wait for every work of the batch (each with ``timeout``); raises the first error."""
        first = None
        for work in self._works:
            try:
                work.wait(timeout)
            except Exception as exc:  # noqa: BLE001  every work is waited for, the first error raised
                first = first or exc
        if first is not None:
            raise first
        return True

    def _source_rank(self) -> int:
        raise RuntimeError("flagos_shm: only a receive from any source has a source rank")

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def exception(self) -> Optional[BaseException]:
        """The first error among the batch's works (issue order), or None."""
        return next((e for e in (w.exception() for w in self._works) if e is not None), None)
