"""The ``Work`` object every flagos_shm collective returns."""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["CoalescedWork", "ShmWork"]


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


class ShmWork(dist.Work):
    """Handle of one collective.

    A synchronous call (``async_op=False``) returns a work that is already complete. An
    asynchronous one (``async_op=True``, and every collective DDP issues) returns at once
    while the collective runs on the group's progress thread; the work completes when the
    results are in the caller's tensors (device tensors: when their host-to-device copy
    has been enqueued on the stream that was current at the call). A failure of the
    transfer is stored here and re-raised by :meth:`wait` and carried by the future.

    Args:
        outputs: the caller's output tensors (the future's value).
        error: the exception the collective failed with, or ``None``.
        pending: ``True`` for a work completed later by :meth:`_complete`.
        abort: called (no arguments) when :meth:`wait` gives up (timeout or Ctrl-C), to
            abort the group so that the running collective stops on every rank.
        help: called (no arguments, blocking) by :meth:`wait` without a timeout to finish
            the work on the waiting thread if the progress thread has not started it yet.
    """

    # Defaults of a completed, successful work, kept on the class: the common, latency-
    # critical case sets only its outputs (and builds no Event or Lock).
    _error: Optional[BaseException] = None
    _abort: Optional[Callable[[], None]] = None
    _help: Optional[Callable[[], None]] = None
    _future: Optional[torch.futures.Future] = None  # made on demand (DDP asks for it)
    _done = _COMPLETED
    _lock = _NO_LOCK

    def __init__(self, outputs: list[torch.Tensor], error: Optional[BaseException] = None, *,
                 pending: bool = False, abort: Optional[Callable[[], None]] = None,
                 help: Optional[Callable[[], None]] = None):
        super().__init__()
        self._outputs = outputs
        if error is not None:
            self._error = error
        if pending:
            self._abort, self._help = abort, help
            self._done, self._lock = _Latch(), threading.Lock()

    def _complete(self, error: Optional[BaseException] = None) -> None:
        """Mark the work finished (with ``error`` if it failed) and complete its future."""
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()
            source = self._source
        if source is not None:
            source.set_result(None)

    # The future handed out is ``source.then(_outcome)``: completing ``source`` runs
    # ``_outcome``, which returns the outputs or raises the error, so the error is set on the
    # C++ future itself. (``Future.set_exception`` keeps the error in the Python wrapper
    # only: where torch hands the C++ future on, as the per-device route's work holder does,
    # the exception would arrive as the future's *value*.)
    _source: Optional[torch.futures.Future] = None

    def _outcome(self, _source: torch.futures.Future) -> list:
        if self._error is not None:
            raise self._error
        return self._outputs

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Block until the collective has finished; return ``True``.

        Args:
            timeout: give up after this long (``timedelta``); ``None`` waits for the
                collective, which itself ends within the group's timeout.

        Raises:
            the collective's error (``RuntimeError``, ``ValueError``, ...) if it failed;
            RuntimeError: ``timeout`` passed first (the group is then aborted, since its
                ranks no longer agree on what has completed);
            KeyboardInterrupt: Ctrl-C while waiting (the group is aborted as well).
        """
        if not self._done.is_set():
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
            if seconds is not None and seconds <= 0:
                seconds = None  # c10d's "unset" timeout
            try:
                if seconds is None and self._help is not None:
                    self._help()  # runs it here if still queued; bounded by the group's timeout
                finished = self._done.wait(seconds)
            except BaseException:
                self._give_up()
                raise
            if not finished:
                self._give_up()
                raise RuntimeError(f"flagos_shm: the collective did not complete within {seconds:.3f} s of "
                                   "Work.wait(); the process group was aborted")
        if self._error is not None:
            raise self._error
        return True

    def _give_up(self) -> None:
        if self._abort is not None:
            self._abort()

    def get_future(self) -> torch.futures.Future:
        """A future completed with the list of output tensors (or the error) when the work finishes."""
        with self._lock:
            if self._future is None:
                self._source = torch.futures.Future()
                self._future = self._source.then(self._outcome)
                settle = self._done.is_set()
            else:
                settle = False
            source, future = self._source, self._future
        if settle:
            source.set_result(None)
        return future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def result(self) -> list[torch.Tensor]:
        """The list of output tensors; waits, and raises the collective's error if it failed."""
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        """Block until the collective has finished (host memory holds the results)."""
        self._done.wait()


class CoalescedWork(dist.Work):
    """The work of a coalesced batch (``end_coalescing``): finished when every work of the
    batch has finished; :meth:`wait` raises the first error among them.

    Args:
        works: the batch's works, in issue order.
    """

    def __init__(self, works: list):
        super().__init__()
        self._works = list(works)

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

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def get_future(self) -> torch.futures.Future:
        """A future completed with the concatenated output lists of the batch's works."""
        futures = [w.get_future() for w in self._works]
        return torch.futures.collect_all(futures).then(
            lambda fut: [t for f in fut.value() for t in f.value()])

    def synchronize(self) -> None:
        for work in self._works:
            work.synchronize()
