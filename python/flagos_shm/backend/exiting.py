"""Keeping threads that leave a call with an error out of an interpreter about to finalize.

When a call fails, the C++ adapter (``csrc/c10d_adapter.cpp``, ``PythonCall``) asks
:func:`leaving_with_error` what the thread does next, with the GIL held, before it releases
the GIL and goes back through torch's C++ frames, where torch takes the GIL again to raise
the error. Once CPython 3.11-3.13 finalizes, that GIL request ends the thread with
``pthread_exit``, whose forced unwind through those frames aborts the process (SIGABRT:
"FATAL: exception not rethrown", or pybind11's "dec_ref() PyGILState_Check() failure").
It happened to daemon threads whose call the exit itself ended, in 2-5 of 8 runs per case on
the Intel Xeon VM (2026-12-06, torch 2.15 and 2.10): a ``recv`` left waiting when the main
thread returned (``threading``'s exit hooks abort point-to-point transfers), or a collective
ended by ``destroy_process_group`` just before the main thread returned. So:

* until ``flagos_shm``'s ``atexit`` handler begins (:func:`exit_handler_begins`), a failing
  call goes back as usual, its calling frame noted, and that handler's
  :func:`wait_for_landings` waits, with the GIL released, until each such thread runs Python
  again (its frame moved past the call, or left its stack, or the thread ended), so that it
  raises before the interpreter finalizes (it waits as well for a thread back from the
  core that runs flagos_shm's Python code on its way to the check, and for one woken in a
  work's ``wait()``);
* once it has begun, a thread other than the main one whose call fails parks until the
  process exits instead of going back, and so does a daemon thread whose call succeeds
  (:func:`returning_at_exit`): every non-daemon thread has been joined by then, and the
  interpreter abandons the rest. A group's progress thread (in a completion callback that
  issued a call) goes back instead: the handler closes the busy groups, which joins their
  progress threads, so one parked there held the exit for good (a callback whose
  collective the exit aborted). (An ``atexit`` handler registered before ``import
  flagos_shm`` runs after flagos_shm's, and one that joins such a daemon thread waits for
  good; handlers registered later run before it, while the thread still raises.)
* a thread crossing torch's C++ frames without the GIL when the handler begins, on its way
  into a flagos_shm call (not yet at the adapter's check) or back from one that succeeded
  (past it), asks for the GIL within microseconds and would be ended the same way if the
  interpreter finalized first: the rarer exit abort left after the two cases above
  ("terminate called without an active exception" in 1 of about 40 runs of a daemon
  thread looping over allreduces, and in 8 of 10 with both windows widened to 20 ms, Intel
  Xeon VM, 2026-12-06). :func:`wait_for_landings` therefore also waits, at most
  :data:`CROSSING_WAIT_S`, until each thread whose topmost frame was torch.distributed's
  Python code, blocked in a C call, has run Python again (that frame moved on, or another
  frame is on top), parked, or entered the core. A thread that calls a process group's or
  a work's methods from its own code directly is not seen this way.

A failing call costs one dictionary entry per thread; a succeeding one, one relaxed atomic
load in the adapter (a Python call only once the handler has begun).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, Dict, List, Set, Tuple

import torch.distributed

from .. import _core
from ..work import WAITING

#: Where flagos_shm's Python files are: a frame running one of them is flagos_shm's code.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: Where torch.distributed's Python files are: the frames that call into c10d's C++.
_TORCH_DISTRIBUTED_DIR = os.path.dirname(os.path.abspath(torch.distributed.__file__)) + os.sep

__all__ = ["exit_handler_begins", "leaving_with_error", "returning_at_exit", "tell_when_exit_begins",
           "wait_for_landings"]

#: Whether ``flagos_shm``'s ``atexit`` handler has begun (:func:`exit_handler_begins`).
_exiting = False

#: What :func:`exit_handler_begins` calls besides setting :data:`_exiting`
#: (:func:`tell_when_exit_begins`): the C++ adapter's own flag, once it is loaded.
_told: List[Callable[[], None]] = []

#: {thread ident: (id of the frame that made the call, its instruction offset then)}: the
#: threads that left a failed call for Python and may not have taken the GIL back yet.
_landings: Dict[int, Tuple[int, int]] = {}

#: How long :func:`wait_for_landings` waits at most, seconds: a thread that went back only
#: needs the GIL, which the waiting thread leaves free; the bound guards against a thread
#: that keeps failing and going back, and ends the wait for threads that wait on a group's
#: lock in flagos_shm's code behind a call that never ends (the frames look the same).
LANDING_WAIT_S = 2.0

#: How long :func:`wait_for_landings` waits at most for threads crossing torch's frames
#: (module docs), seconds. Such a thread needs only the GIL, which the waiting thread leaves
#: free (it sleeps 0.5 ms at a time); the bound ends the wait for a thread blocked in another
#: torch.distributed call (a Gloo collective, a store), which looks the same from Python.
CROSSING_WAIT_S = 0.25

#: The threads parked for good by the adapter (:func:`returning_at_exit` or
#: :func:`leaving_with_error` said so): never waited for.
_parked: Set[int] = set()


def exit_handler_begins() -> None:
    """Called first by ``flagos_shm``'s ``atexit`` handler (GIL held): from now on a thread
    other than the main one whose call fails parks, and so does a daemon thread whose call
    succeeds (module docs)."""
    global _exiting
    _exiting = True
    for tell in _told:
        tell()


def tell_when_exit_begins(tell: Callable[[], None]) -> None:
    """Have :func:`exit_handler_begins` call ``tell()`` (no arguments; it must not raise);
    at once if it has begun already. The C++ adapter's loader
    (:func:`flagos_shm.backend.adapter.native`) registers the adapter's flag this way, so
    this module, below the adapter, does not import it."""
    _told.append(tell)
    if _exiting:
        tell()


def returning_at_exit() -> bool:
    """Called by the C++ adapter, with the GIL held, when a call succeeds after
    :func:`exit_handler_begins`: True (park until the process exits) for a daemon thread
    other than the main one. Such a thread (one calling collectives in a loop, say) would
    otherwise go back through torch's frames, where torch takes the GIL again, and if the
    interpreter finalizes meanwhile CPython ends it there and the process aborts (2-5 of 8
    runs of a daemon thread looping over 64 MiB allreduces while the main thread returned,
    Intel Xeon VM, 2026-12-06, both torches). Every non-daemon thread has been joined by
    the time the handler runs; one started later (by another ``atexit`` handler) goes back.
    Never raises."""
    thread = threading.current_thread()
    park = _exiting and thread is not threading.main_thread() and thread.daemon and not _core.on_progress_thread()
    if park:
        _parked.add(threading.get_ident())
    return park


def leaving_with_error() -> bool:
    """Called by the C++ adapter, with the GIL held, when a call is about to raise into torch.
    True when the calling thread must park until the process exits instead (module docs);
    otherwise records where the thread lands for :func:`wait_for_landings`. Never raises."""
    if threading.current_thread() is threading.main_thread():
        return False
    if _exiting and not _core.on_progress_thread():
        _parked.add(threading.get_ident())
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


def _runs_our_code(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            return True
        frame = frame.f_back
    return False


def _leaving(ident: int, top, blocked) -> bool:
    """Whether thread ``ident`` (its topmost frame ``top``) is on its way out of a call."""
    if ident in blocked:  # waiting in the core: no Python to run until its call ends
        return False
    work = WAITING.get(ident)
    if work is not None:  # in a work's wait(): leaving it once the work has completed
        return work.is_completed()
    if ident in _landings:  # noted, and not landed in this snapshot (pruned just before)
        return True
    # Back in Python between the core and the adapter's check (flagos_shm's own error
    # path), or elsewhere in flagos_shm's Python code.
    return _runs_our_code(top)


def _crossing(frames, blocked, me: int) -> Dict[int, Tuple[int, int]]:
    """{thread ident: (id of its topmost frame, that frame's instruction offset)} for the
    threads other than ``me`` whose topmost frame is torch.distributed's Python code and that
    are neither in the core (``blocked``) nor parked: those that may be crossing torch's C++
    frames into or out of a flagos_shm call (module docs)."""
    return {
        ident: (id(top), top.f_lasti)
        for ident, top in frames.items()
        if ident != me and ident not in blocked and ident not in _parked
        and top.f_code.co_filename.startswith(_TORCH_DISTRIBUTED_DIR)
    }


def wait_for_landings(timeout_s: float = LANDING_WAIT_S) -> None:
    """Waits, releasing the GIL, until no thread but the calling one is on its way out of a
    call: one recorded by :func:`leaving_with_error` until its calling frame has moved past
    the call or left its stack; one blocked in a work's ``wait()`` whose work has completed
    (woken, an error perhaps, by the exit's abort of point-to-point transfers) until it has
    left that wait; one running flagos_shm's Python code (back from the core, on its way to
    the adapter) until it has left it; one crossing torch's C++ frames (:func:`_crossing`, as
    seen when this is called) until it has run Python again, parked or entered the core, for
    at most :data:`CROSSING_WAIT_S` of the ``timeout_s``. Threads blocked in the core
    (``_core.threads_in_calls``) or in the wait of a work still running are not waited for.
    At most ``timeout_s`` seconds."""
    start = time.monotonic()
    end = start + timeout_s
    crossing_end = start + min(CROSSING_WAIT_S, timeout_s)
    me = threading.get_ident()
    crossing = None
    while True:
        blocked = set(_core.threads_in_calls())
        frames = sys._current_frames()
        for ident, record in list(_landings.items()):
            if _landed(ident, record, frames):
                _landings.pop(ident, None)
        if crossing is None:
            crossing = _crossing(frames, blocked, me)
        else:
            still = _crossing(frames, blocked, me)
            crossing = {ident: record for ident, record in crossing.items() if still.get(ident) == record}
        busy = any(_leaving(ident, top, blocked) for ident, top in frames.items() if ident != me)
        del frames
        now = time.monotonic()
        if (not busy and (not crossing or now >= crossing_end)) or now >= end:
            return
        time.sleep(0.0005)
