"""abort(), shutdown() and Ctrl-C release a rank waiting in a collective (issue 5): the call
raises at once, the rank's next call says why, and the peer that joins later raises naming
the rank that aborted. Groups built on a ``FileStore`` in the session's pools
(:func:`support.faults.shm_group`).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from support.faults import error_info, shm_group, timed_outcome

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("flagos_only")]


# ---- abort(), shutdown() and Ctrl-C release a waiting rank --------------------------------------

RELEASE_TIMEOUT_S = 20.0  # the group's timeout: the release must come long before it
RELEASE_AFTER_S = 0.3


def rank_release(tmp: str, how: str, tag: str) -> dict:
    """Rank 0 enters an allreduce that rank 1 does not join (yet); after 0.3 s another thread
    of rank 0 calls ``pg.abort()`` / ``pg.shutdown()`` or sends SIGINT to the process.
    Report what rank 0's call raised and when, what its next call did, and what rank 1's
    allreduce (issued once rank 0 was released) raised and how long it took."""
    rank = dist.get_rank()
    pg = shm_group(os.path.join(tmp, "store"), rank, 2, f"release-{tag}", RELEASE_TIMEOUT_S)
    res: dict = {}
    try:
        pg.barrier().wait()
        t = torch.arange(8, dtype=torch.float32)
        if rank == 0:
            if how == "sigint":
                # Python leaves SIGINT ignored when it started ignored (a job started in the
                # background by a non-interactive shell, as some CI runners do): the test
                # is about our wait noticing Python's handler, so install it.
                previous = signal.signal(signal.SIGINT, signal.default_int_handler)
            action = {"abort": pg.abort, "shutdown": pg.shutdown,
                      "sigint": lambda: os.kill(os.getpid(), signal.SIGINT)}[how]
            fired: list = []  # when the timer thread acted: it may run late on a loaded machine

            def act():
                fired.append(time.monotonic())
                action()
            timer = threading.Timer(RELEASE_AFTER_S, act)
            timer.start()
            t0 = time.monotonic()
            try:
                # synchronous, as dist.all_reduce(t) issues it: runs on this thread
                opts = dist.AllreduceOptions()
                opts.asyncOp = False
                work = pg.allreduce([t], opts)
                if work is not None:
                    work.wait()
                res["error"] = None
            except BaseException as exc:  # noqa: B902  KeyboardInterrupt is the expected one
                res["error"] = error_info(exc)
            released = time.monotonic()
            res["elapsed"] = released - t0
            timer.join()
            res["after_action"] = released - fired[0] if fired else None
            if how == "sigint":
                signal.signal(signal.SIGINT, previous)
            res["untouched"] = torch.equal(t, torch.arange(8, dtype=torch.float32))
            res["next"], res["next_s"] = timed_outcome(lambda: pg.barrier().wait())
        dist.barrier()  # the pool's group: rank 1 goes on once rank 0 was released
        if rank == 1:
            t0 = time.monotonic()
            try:
                pg.allreduce([t]).wait()
                res["error"] = None
            except Exception as exc:  # noqa: BLE001
                res["error"] = error_info(exc)
            res["elapsed"] = time.monotonic() - t0
    finally:
        pg.shutdown()
    return res


@pytest.mark.parametrize("how", ["abort", "shutdown", "sigint"])
def test_abort_shutdown_and_ctrl_c_release_a_waiting_rank(worlds, tmp_path, how):
    """A rank waiting for a peer that does not come is released within a second of abort()
    or shutdown() from another thread (RuntimeError) or of Ctrl-C (KeyboardInterrupt), the
    group timeout being 20 s; its tensor is untouched; the group is aborted for everyone:
    its next call, and the peer's call, raise RuntimeError at once (within 2 s: a bound a
    loaded 2-core machine cannot stretch to, that a wait for the timeout would break)."""
    world = worlds(2)
    try:
        r0, r1 = world.run(rank_release, str(tmp_path), how, how, timeout=60)
    finally:
        world.check_health()
    expected = "KeyboardInterrupt" if how == "sigint" else "RuntimeError"
    assert r0["error"] and r0["error"]["type"] == expected, r0
    # Released after the action and within a second of it (the group's timeout is 20 s);
    # counted from the action, not from 0.3 s, as a loaded machine may run the timer late.
    assert RELEASE_AFTER_S - 0.05 < r0["elapsed"] and 0 <= r0["after_action"] < 1.0, r0
    assert r0["untouched"], r0
    assert r0["next"] and r0["next"]["type"] == "RuntimeError" and r0["next_s"] < 2.0, r0
    reason = {"abort": "aborted", "shutdown": "shut down", "sigint": "interrupted"}[how]
    assert reason in r0["next"]["message"], r0
    assert r1["error"] and r1["error"]["type"] == "RuntimeError" and r1["elapsed"] < 2.0, r1
    assert "aborted by rank 0" in r1["error"]["message"] and "release-" in r1["error"]["message"], r1
