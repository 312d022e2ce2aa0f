"""The call queue of a :class:`~flagos_shm.backend.hierarchy.HierarchicalComm`: one call at a
time, in issue order, synchronous calls on the caller's thread, asynchronous ones on the
worker's own thread."""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

_log = logging.getLogger("flagos_shm")


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
