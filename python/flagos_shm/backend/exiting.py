"""Keeping threads that leave a call with an error out of an interpreter about to finalize.

When a call fails, the C++ adapter (``csrc/c10d_adapter.cpp``, ``PythonCall``) asks
:func:`leaving_with_error` what the thread does next, with the GIL held, before it releases
the GIL and goes back through torch's C++ frames, where torch takes the GIL again to raise
the error. Once CPython 3.11-3.13 finalizes, that GIL request ends the thread with
``pthread_exit``, whose forced unwind through those frames aborts the process (SIGABRT:
"FATAL: exception not rethrown", or pybind11's "dec_ref() PyGILState_Check() failure").
It happened to a daemon thread whose call the exit itself ended: a ``recv`` left waiting
when the main thread returned (the point-to-point exit handler aborts transfers), 4 of 8
runs on the Intel Xeon VM (2026-12-06), or a collective ended by ``destroy_process_group``
just before the main thread returned. So:

* while the interpreter exits (the main thread has returned: ``threading``'s exit hooks have
  run) a daemon thread, or one not started by ``threading``, whose call fails parks for good
  (the interpreter abandons such threads) instead of going back, unless a non-daemon thread
  other than the main one still runs (the main thread waits for it, so the error can be
  raised as usual);
* otherwise the thread goes back, and :func:`wait_for_landings`, which ``flagos_shm``'s
  ``atexit`` handler calls, waits with the GIL released until every thread that went back
  this way is running Python again in the frame that made the call (or has moved on from
  it, or ended), so that it raises before the interpreter finalizes.

A call that fails while no interpreter exit is near costs one dictionary entry per thread.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (registers its exit hook before ours: see below)
import sys
import threading
import time
from typing import Dict, Tuple

from ..work import WAITING

__all__ = ["leaving_with_error", "wait_for_landings", "at_interpreter_exit"]

#: Set by ``threading``'s exit hook (:func:`_interpreter_exits`), which runs when the main
#: thread has returned, before the interpreter waits for non-daemon threads and runs the
#: ``atexit`` handlers.
_exiting = False

#: Run by :func:`_interpreter_exits` once ``_exiting`` is set (:func:`at_interpreter_exit`).
_exit_hooks = []

#: {thread ident: (id of the frame that made the call, its instruction offset then)}: the
#: threads that left a failed call for Python and may not have taken the GIL back yet.
_landings: Dict[int, Tuple[int, int]] = {}

#: How long :func:`wait_for_landings` waits at most, seconds: a thread that went back only
#: needs the GIL, which the waiting thread leaves free; the bound only guards against a
#: thread that keeps failing and going back.
LANDING_WAIT_S = 2.0


def _interpreter_exits() -> None:
    global _exiting
    _exiting = True
    for hook in _exit_hooks:
        hook()


# ``threading`` runs its exit hooks last registered first: ours before the thread pools'
# (imported above), which join their workers, so that the hooks can wake workers first.
if hasattr(threading, "_register_atexit"):  # CPython 3.9 on
    threading._register_atexit(_interpreter_exits)


def at_interpreter_exit(hook) -> None:
    """Runs ``hook()`` when the main thread has returned, before the interpreter waits for
    its non-daemon threads (``threading``'s exit hooks), once ``_exiting`` is set: a thread
    that ``hook`` wakes from a call with an error finds the interpreter exiting."""
    _exit_hooks.append(hook)


def _others_keep_the_interpreter(me: threading.Thread) -> bool:
    main = threading.main_thread()
    return any(not t.daemon and t is not main and t is not me and t.is_alive() for t in threading.enumerate())


def leaving_with_error() -> bool:
    """Called by the C++ adapter, with the GIL held, when a call is about to raise into torch.
    True when the calling thread must park until the process exits instead (module docs);
    otherwise records where the thread lands for :func:`wait_for_landings`. Never raises."""
    me = threading.current_thread()
    if me is threading.main_thread():
        return False
    if _exiting and (me.daemon or isinstance(me, threading._DummyThread)) and not _others_keep_the_interpreter(me):
        return True
    try:
        frame = sys._getframe(1)  # the Python frame that called into torch, if any
    except ValueError:  # called from a thread with no Python frame (a C++ caller)
        return False
    _landings[threading.get_ident()] = (id(frame), frame.f_lasti)
    return False


def _landed(ident: int, record: Tuple[int, int], frames) -> bool:
    frame = frames.get(ident)
    while frame is not None:
        if id(frame) == record[0]:
            return frame.f_lasti != record[1]
        frame = frame.f_back
    return True


def wait_for_landings(timeout_s: float = LANDING_WAIT_S) -> None:
    """Waits, releasing the GIL, until each thread that is leaving a call runs Python again:
    one recorded by :func:`leaving_with_error` until its calling frame has moved past the
    call or left its stack (or the thread ended), and one blocked in a work's ``wait()``
    whose work has completed (woken, an error perhaps, by this exit's own shutdown of the
    point-to-point transfers) until it has left that wait; at most ``timeout_s`` seconds."""
    end = time.monotonic() + timeout_s
    while True:
        frames = sys._current_frames()
        for ident, record in list(_landings.items()):
            if _landed(ident, record, frames):
                _landings.pop(ident, None)
        woken = any(work.is_completed() and ident in frames for ident, work in list(WAITING.items()))
        del frames
        if (not _landings and not woken) or time.monotonic() >= end:
            return
        time.sleep(0.0005)
