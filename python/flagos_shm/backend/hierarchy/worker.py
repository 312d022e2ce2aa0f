"""The call queue of a :class:`~flagos_shm.backend.hierarchy.HierarchicalComm`: one call at a
time, in issue order, synchronous calls on the caller's thread, asynchronous ones on the
worker's own thread.

Calls issued from completion callbacks (``done``, which completes a work and so runs the
callbacks attached to its future: torch's PowerSGD DDP hook issues allreduces there) follow
the rule of the single-node core (``rust/progress.rs``): they run at once, on the callback's
thread, and take their place right after the calls issued before the work's future was taken
(:meth:`_Worker.anchor`), ahead of those issued after it, and after the calls of callbacks
whose futures were taken earlier at the same point, so that every rank runs them in the same
order whichever thread got there first. (Only the worker's thread runs queued calls, so no
other thread can start a later one while a callback runs.)
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional

from ... import _core

_log = logging.getLogger("flagos_shm")

_SHUT_DOWN = "the process group has been shut down"


class _Worker:
    """Runs the group's calls one at a time in issue order: queued ones (``submit``, for
    asynchronous calls) on its own thread, synchronous ones (``run``) on the caller's thread
    once every earlier call has finished, its callback included. A call issued from one of
    the worker's callbacks runs on that thread before :meth:`submit` or :meth:`run` returns,
    at the place the module docs give."""

    def __init__(self, name: str):
        self._cv = threading.Condition()
        #: Calls not started yet, in the order they will run: [ticket, fn, done, anchor, key]:
        #: ``anchor`` (set by :meth:`anchor`) is (the ticket its callbacks' calls go after,
        #: anchors set before it); ``key`` the latter of the callback that issued the call.
        self._jobs: collections.deque = collections.deque()
        self._issued = self._anchors = 0
        #: The last call submitted other than from one of the worker's callbacks.
        self._last_plain = 0
        #: Tickets queued, running, or whose ``done`` has not returned.
        self._unfinished: set = set()
        #: Anchors of the claimed calls whose ``done`` has not returned: {ticket: anchor}.
        self._open: dict = {}
        #: ``done`` put off until the callback of another call returned: {ticket: [that
        #: call's ticket, done, error, whether ``done(error, early=True)`` has run]}, in
        #: running order.
        self._parked: dict = {}
        self._busy = self._stop = False
        #: Per thread: the tickets whose ``done`` runs on it, innermost last.
        self._local = threading.local()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ---- issuing ----------------------------------------------------------------------------

    def submit(self, fn: Callable[[], None], done: Callable) -> int:
        """Queue ``fn``; ``done(error or None)`` runs once it has run. Returns its ticket.
        Issued from one of this worker's callbacks, it has run, ``done`` included, on return.

        Raises:
            RuntimeError: the worker was closed.
        """
        origin = self._own()
        with self._cv:
            if self._stop:
                raise RuntimeError(_SHUT_DOWN)
            self._issued += 1
            ticket = self._issued
            anchor = self._open.get(origin) if origin is not None else None
            if origin is None:
                self._last_plain = ticket
            self._jobs.insert(self._position(anchor), [ticket, fn, done, None, None if anchor is None else anchor[1]])
            self._unfinished.add(ticket)
            self._cv.notify_all()
        if origin is not None:
            self._help(ticket)  # the worker thread is this one, in the callback
        return ticket

    def run(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on this thread once every call before it has finished; from one of
        this worker's callbacks, at the place the module docs give (queued, then run here).

        Raises:
            RuntimeError: the worker was closed; otherwise whatever ``fn`` raises.
        """
        if self._own() is not None:
            # Queued and run here at once, so that it holds its place while the calls before
            # it run: a callback nested in those places its own calls after this one.
            errors: list = []
            self.submit(fn, errors.append)
            if not errors:  # closed while the calls before it ran
                raise RuntimeError(_SHUT_DOWN)
            if errors[0] is not None:
                raise errors[0]
            return
        with self._cv:
            while self._busy or self._jobs or self._unfinished:
                if self._stop:
                    break
                self._cv.wait(0.05)
            if self._stop:
                raise RuntimeError(_SHUT_DOWN)
            self._busy = True
        try:
            fn()
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def anchor(self, ticket: int) -> None:
        """The future of call ``ticket`` has been taken: calls its ``done`` issues go after
        the last call issued now other than from a callback (after the call itself if that
        is later, or if the future is taken in a callback), after those of callbacks anchored
        before (``Progress::anchor`` in the core)."""
        in_callback = self._own() is not None
        with self._cv:
            anchor = (ticket if in_callback else max(self._last_plain, ticket), self._anchors)
            job = next((job for job in self._jobs if job[0] == ticket), None)
            if job is not None:
                job[3] = anchor
            elif ticket in self._open:
                self._open[ticket] = anchor
            else:
                return
            self._anchors += 1

    def wait(self, ticket: int, timeout_s: Optional[float] = None) -> None:
        """Return once call ``ticket`` has finished (``done`` returned) or the worker was
        closed; from one of the worker's callbacks, run the calls up to it on this thread.
        With ``timeout_s`` (a wait with a timeout), return at once unless in one of the
        worker's callbacks (no other thread may run the call there), and there give up
        after ``timeout_s`` seconds while the call runs elsewhere (the caller says so)."""
        if self._own() is not None:
            self._help(ticket, None if timeout_s is None else time.monotonic() + timeout_s)
            return
        if timeout_s is not None:
            return
        with self._cv:
            while ticket in self._unfinished and not (self._stop and not self._jobs and not self._busy):
                self._cv.wait(0.05)

    # ---- running ----------------------------------------------------------------------------

    def _own(self) -> Optional[int]:
        """The ticket of this worker's innermost ``done`` running on this thread, or None."""
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else None

    def _position(self, anchor: Optional[tuple]) -> int:
        """Where a call issued now goes: from a callback with ``anchor`` (its call's anchor),
        right after the anchor (the front once it has started), after the calls queued there
        by callbacks anchored before it; otherwise (no callback, or no anchor) at the back."""
        if anchor is None:
            return len(self._jobs)
        after, n = anchor
        at = next((i + 1 for i, job in enumerate(self._jobs) if job[0] == after), 0)
        while at < len(self._jobs) and self._jobs[at][4] is not None and self._jobs[at][4] < n:
            at += 1
        return at

    def _claim(self) -> list:
        """Take the front call (condition held, nothing running)."""
        job = self._jobs.popleft()
        self._busy = True
        self._open[job[0]] = job[3]
        return job

    def _help(self, ticket: int, deadline: Optional[float] = None) -> None:
        """Run queued calls on this thread (one of the worker's callbacks) until ``ticket``
        has finished. If its ``done`` is parked until this callback returns, only its
        results part runs now, ``done(error, early=True)``, and ``done`` stays parked, so
        that the callbacks attached to its future still run after this one, as NCCL runs
        them (``Progress::submit_with_results`` in the core)."""
        stack = getattr(self._local, "stack", [])
        while True:
            results = whole = None
            with self._cv:
                while True:
                    if ticket not in self._unfinished or ticket in stack or self._stop:
                        return  # (a callback waiting for its own call would wait for itself)
                    entry = self._parked.get(ticket)
                    if entry is not None:
                        if entry[3]:
                            return  # its results are in
                        if not _core.accepts_early(entry[1]):  # run whole, as the core does
                            _, done, error, _ = self._parked.pop(ticket)
                            whole = (done, error)
                            break
                        entry[3] = True
                        results, entry[2] = (entry[1], entry[2]), None
                        break
                    if not self._busy and any(job[0] == ticket for job in self._jobs):
                        job = self._claim()
                        break
                    if deadline is not None and time.monotonic() >= deadline:
                        return
                    self._cv.wait(0.05)
            if whole is not None:
                self._callback(ticket, *whole)
            elif results is not None:
                done, error = results
                try:
                    done(error, early=True)
                except Exception:  # noqa: BLE001
                    _log.exception("flagos_shm: completing a work failed")
            else:
                self._execute(job)

    def _execute(self, job: list) -> None:
        """Run a claimed call, then (nothing held) its ``done``: at once, or, for a call
        anchored after the callback this thread is in, parked until that one has returned
        (NCCL would run it after: it was attached later; ``Shared::execute`` in the core)."""
        ticket, fn, done = job[:3]
        error = None
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001  handed to the work
            error = exc
        under = self._own()
        with self._cv:
            self._busy = False
            self._cv.notify_all()
            mine, theirs = self._open.get(ticket), None if under is None else self._open.get(under)
            if mine is not None and theirs is not None and theirs[1] < mine[1]:
                self._parked[ticket] = [under, done, error, False]
                return
        self._callback(ticket, done, error)

    def _callback(self, ticket: int, done: Callable, error) -> None:
        """Run call ``ticket``'s ``done`` on this thread, then those parked until it returned."""
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(ticket)
        try:
            done(error)
        except Exception:  # noqa: BLE001
            _log.exception("flagos_shm: completing a work failed")
        finally:
            stack.pop()
            with self._cv:
                self._open.pop(ticket, None)
                self._unfinished.discard(ticket)
                self._cv.notify_all()
        while True:
            with self._cv:
                later = next((t for t, entry in self._parked.items() if entry[0] == ticket), None)
                if later is None:
                    return
                _, done, error, _ = self._parked.pop(later)
            self._callback(later, done, error)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._busy or not self._jobs:
                    if self._stop and not self._jobs:
                        return
                    self._cv.wait()
                job = self._claim()
            self._execute(job)

    # ---- closing ----------------------------------------------------------------------------

    def close(self) -> list:
        """Stop taking calls; return the queued ones that never started (their ``done``)."""
        with self._cv:
            self._stop = True
            left = [job[2] for job in self._jobs]
            self._unfinished.difference_update(job[0] for job in self._jobs)
            self._jobs.clear()
            self._cv.notify_all()
        return left

    def join(self) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join()
