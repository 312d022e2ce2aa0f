"""What a thread leaving a failed call does near the interpreter's exit
(``flagos_shm.backend.exiting``): park once flagos_shm's exit handler has begun; before, go
back, noted, and that handler waits until the thread runs Python again.
The end-to-end case (a daemon thread's ``recv`` ended by the exit) is in
``test_shutdown_queued.py``."""

from __future__ import annotations

import os
import sys
import threading

import pytest

import flagos_shm  # noqa: F401
from flagos_shm import work as work_module
from flagos_shm.backend import exiting

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def exit_handler_begun(monkeypatch):
    monkeypatch.setattr(exiting, "_exiting", False)
    exiting.exit_handler_begins()
    assert exiting._exiting is True


def _answer_on_thread(daemon: bool) -> dict:
    out = {}
    t = threading.Thread(target=lambda: out.update(park=exiting.leaving_with_error(), ident=threading.get_ident()),
                         daemon=daemon)
    t.start()
    t.join(30)
    exiting._landings.pop(out["ident"], None)
    return out


@pytest.mark.parametrize("daemon", [True, False])
def test_once_the_exit_handler_has_begun_a_failing_thread_parks(exit_handler_begun, daemon):
    assert _answer_on_thread(daemon)["park"] is True


def test_the_main_thread_never_parks(exit_handler_begun):
    assert exiting.leaving_with_error() is False


def _returning_on_thread(daemon: bool) -> bool:
    out = {}
    t = threading.Thread(target=lambda: out.update(park=exiting.returning_at_exit()), daemon=daemon)
    t.start()
    t.join(30)
    return out["park"]


def test_once_the_exit_handler_has_begun_only_a_daemon_thread_parks_after_a_call_that_succeeds(
        exit_handler_begun):
    # A non-daemon thread still running then was started by an atexit handler, which may join it.
    assert _returning_on_thread(daemon=True) is True
    assert _returning_on_thread(daemon=False) is False
    assert exiting.returning_at_exit() is False  # the main thread


def test_before_the_exit_handler_no_thread_parks_after_a_call_that_succeeds(monkeypatch):
    monkeypatch.setattr(exiting, "_exiting", False)
    assert _returning_on_thread(daemon=True) is False


def test_before_the_exit_handler_a_thread_goes_back_and_its_landing_is_recorded(monkeypatch):
    monkeypatch.setattr(exiting, "_exiting", False)
    out = {}

    def call() -> None:
        out["park"] = exiting.leaving_with_error()
        out["record"] = exiting._landings.get(threading.get_ident())
        out["frame"] = sys._getframe()

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(30)
    assert out["park"] is False
    assert out["record"][0] == id(out["frame"]), out
    exiting._landings.pop(t.ident, None)


def _frame_of(ident: int, name: str):
    frame = sys._current_frames()[ident]
    while frame is not None and frame.f_code.co_name != name:
        frame = frame.f_back
    assert frame is not None, name
    return frame


def test_the_exit_waits_until_a_recorded_thread_has_moved_past_its_call():
    """A thread noted while inside a call (here a wait that a timer ends) counts as landed only
    once its frame has moved past the call: wait_for_landings returns after the timer."""
    entered, go = threading.Event(), threading.Event()
    passed = []

    def blocked_in_a_call() -> None:
        entered.set()
        go.wait()
        passed.append(True)

    t = threading.Thread(target=blocked_in_a_call, daemon=True)
    t.start()
    entered.wait(30)
    frame = _frame_of(t.ident, "blocked_in_a_call")
    exiting._landings[t.ident] = (id(frame), frame.f_lasti)
    del frame
    timer = threading.Timer(0.3, go.set)
    timer.start()
    try:
        exiting.wait_for_landings(timeout_s=30)
        assert go.is_set()
        assert t.ident not in exiting._landings
    finally:
        go.set()
        timer.cancel()
        t.join(30)


def test_the_exit_does_not_wait_for_a_thread_that_ended():
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join(30)
    exiting._landings[t.ident] = (0, 0)
    exiting.wait_for_landings(timeout_s=30)
    assert t.ident not in exiting._landings


def test_the_exit_waits_for_a_thread_woken_in_a_works_wait_to_leave_it():
    """A thread blocked in ShmWork.wait whose work completes with an error (what the exit's
    abort of point-to-point transfers does) is waited for until it has left the wait; a
    thread whose work has not completed is not."""
    pending = work_module.ShmWork([], pending=True)
    never = work_module.ShmWork([], pending=True)
    raised = []

    def waits(w) -> None:
        try:
            w.wait()
        except RuntimeError as e:
            raised.append(str(e))

    woken = threading.Thread(target=waits, args=(pending,), daemon=True)
    stuck = threading.Thread(target=waits, args=(never,), daemon=True)
    woken.start()
    stuck.start()
    while len(work_module.WAITING) < 2 or woken.ident not in work_module.WAITING:
        threading.Event().wait(0.001)
    try:
        pending._complete(RuntimeError("aborted at exit"))
        exiting.wait_for_landings(timeout_s=30)
        assert woken.ident not in work_module.WAITING
        assert stuck.ident in work_module.WAITING
    finally:
        never._complete(RuntimeError("test over"))
        woken.join(30)
        stuck.join(30)
    assert raised.count("aborted at exit") == 1 and raised.count("test over") == 1, raised


def test_the_exit_waits_for_a_thread_running_flagos_shm_code_to_leave_it(monkeypatch):
    """A thread back from the core on its way to the adapter runs flagos_shm's Python code
    and is not recorded anywhere yet: the exit waits until it has left that code. (Here the
    tests' directory stands for the package's, and the thread's code is a wait a timer ends.)"""
    monkeypatch.setattr(exiting, "_PACKAGE_DIR", os.path.dirname(os.path.abspath(__file__)) + os.sep)
    entered, go = threading.Event(), threading.Event()

    def in_our_code() -> None:
        entered.set()
        go.wait()

    t = threading.Thread(target=in_our_code, daemon=True)
    t.start()
    entered.wait(30)
    timer = threading.Timer(0.3, go.set)
    timer.start()
    try:
        exiting.wait_for_landings(timeout_s=30)
        assert go.is_set()
    finally:
        go.set()
        timer.cancel()
        t.join(30)
