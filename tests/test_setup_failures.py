"""Set-up failures that used to wait the whole group timeout (issue 11, item 4).

(a) A rank that has published its process id and dies before attaching: every rank must
    notice at once (the process ids are all known before anyone attaches).
(b) A rank that cannot open its node's segment (another /dev/shm): every rank raises at once
    an error naming that rank and the likely cause (it publishes the cause in the store).
(c) Ranks of one node in different PID namespaces: detected at set-up, named on every rank.
(d) A rank that exits before calling ``new_group``: the others' ``new_group`` raises at once,
    naming it (its process id is known from the default group), instead of at the timeout.
(e) A malformed setting on one rank only: that rank raises ``ValueError`` naming it and
    every other rank raises at once too, naming the rank and the setting; likewise a group
    timeout of zero or less.

Each test uses a group timeout of :data:`GROUP_TIMEOUT_S` and asserts detection well under
it (:data:`DETECT_S`), timed from the moment every rank has started (``support.spawn.start_together``),
so that a peer's slow start-up on a loaded machine does not count; the measured times are
printed (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from flagos_shm.backend.rendezvous import LEAVE_WAIT_S
from support.namespaces import needs_unshare, private_shm_namespace
from support.spawn import spawn, start_together

GROUP_TIMEOUT_S = 60.0
DETECT_S = 10.0
DEADLINE_S = 120.0


def setup_rank(rank: int, world_size: int, tmp: str, mode: str) -> dict:
    """Create a group of ``world_size`` ranks; report the error (if any) and when it came.

    ``mode="die-before-attach"``: rank 1 joins 1 s late (after rank 0 has created the
    segment) and exits just before attaching. ``mode="slow-reader"``: rank 1 reads the
    probes' verdicts from the store 1 s late, after rank 0, which holds the store, has
    raised."""
    import flagos_shm
    from flagos_shm import _core
    from flagos_shm.backend import rendezvous

    start_together(tmp, rank, world_size, DEADLINE_S)
    if mode == "slow-reader" and rank == 1:
        get_all = rendezvous._get_all

        def slow(store, keys):
            if any("/probe/" in k for k in keys):
                time.sleep(1.0)
            return get_all(store, keys)
        rendezvous._get_all = slow

    if mode == "die-before-attach" and rank == 1:
        time.sleep(1.0)

        def die(*args, **kwargs):
            with open(os.path.join(tmp, "died"), "w") as f:
                json.dump(time.time(), f)
            os._exit(3)
        _core.Communicator = die
    res = {"error": None, "pid": os.getpid()}
    t0 = time.monotonic()
    try:
        dist.init_process_group("flagos_shm", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        x = flagos_shm.backend.shm_part(dist.group.WORLD)
        res["comm"] = type(x._comm).__name__
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
    res["elapsed"] = time.monotonic() - t0
    died = os.path.join(tmp, "died")
    if res["error"] is not None and os.path.exists(died):
        with open(died) as f:
            res["latency"] = time.time() - json.load(f)  # from the victim's exit to this rank's error
    return res


def test_rank_dying_after_publishing_its_pid_is_noticed_at_once(tmp_path):
    results = spawn(setup_rank, 2, args=("die-before-attach",), timeout=DEADLINE_S, may_die=(1,))
    assert results[1] is None
    res = results[0]
    print(f"(a) rank 0 raised {res.get('latency', -1):.3f} s after rank 1 exited ({res['elapsed']:.2f} s after "
          f"it started setting up): {res['error']}")
    assert res["error"] is not None and "exited" in res["error"], res
    assert "rank 1" in res["error"], res
    assert res["elapsed"] < DETECT_S and res["latency"] < DETECT_S, res


def exit_before_new_group(rank: int, world_size: int, tmp: str) -> dict:
    """Every rank joins the default group; the last one then exits (its process ends
    normally, as the spawn harness's child does), the others call ``new_group`` over every
    rank with a timeout of :data:`GROUP_TIMEOUT_S` and report its error and how long it took."""
    import flagos_shm  # noqa: F401
    import torch

    dist.init_process_group("flagos_shm", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == world_size - 1:
        return {"sum": t.tolist()}
    res = {"sum": t.tolist(), "error": None}
    t0 = time.monotonic()
    try:
        dist.new_group(list(range(world_size)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    except RuntimeError as exc:
        res["error"] = str(exc)
    res["elapsed"] = time.monotonic() - t0
    dist.destroy_process_group()
    return res


def abort_and_rebuild(rank: int, world_size: int, tmp: str) -> dict:
    """Processes 0 and 1 form world 1 and process 1 exits; process 0 aborts the world
    (``_abort_process_group``, an in-process restart) and keeps a reference to its old
    group; then process 0 and process 2, which arrives late, form world 2. The old group
    knows a dead process as rank 1 and must not speak for world 2's rank 1."""
    import flagos_shm
    import torch
    from torch.distributed.distributed_c10d import _abort_process_group

    def world(name: str, r: int):
        dist.init_process_group("flagos_shm", store=dist.FileStore(os.path.join(tmp, name), 2), rank=r, world_size=2,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        t = torch.ones(2)
        dist.all_reduce(t)
        return t.tolist()

    aborted = os.path.join(tmp, "aborted")
    if rank == 1:
        with open(os.path.join(tmp, "pid1"), "w") as f:
            f.write(str(os.getpid()))
        return {"w1": world("w1", 1)}  # then this process exits
    if rank == 2:
        while not os.path.exists(aborted):
            time.sleep(0.01)
        time.sleep(1.0)  # after rank 0 has begun waiting for world 2's rank 1
        return {"w2": world("w2", 1)}
    res = {"w1": world("w1", 0)}
    old = dist.group.WORLD  # noqa: F841  held, as a model or a device mesh would hold it
    pid_file = os.path.join(tmp, "pid1")
    while not os.path.exists(pid_file):
        time.sleep(0.01)
    pid = int(open(pid_file).read())
    while not flagos_shm._core.process_exited(pid):
        time.sleep(0.01)
    _abort_process_group()
    open(aborted, "w").close()
    res["w2"] = world("w2", 0)
    dist.destroy_process_group()
    return res


def test_a_group_torch_let_go_of_does_not_speak_for_a_new_world():
    results = spawn(abort_and_rebuild, 3, timeout=DEADLINE_S)
    assert results[0] == {"w1": [2.0, 2.0], "w2": [2.0, 2.0]}, results
    assert results[1] == {"w1": [2.0, 2.0]} and results[2] == {"w2": [2.0, 2.0]}, results


def test_rank_that_exits_before_new_group_is_noticed_at_once():
    results = spawn(exit_before_new_group, 3, timeout=DEADLINE_S)
    assert [r["sum"] for r in results] == [[3.0] * 4] * 3
    for res in results[:2]:
        print(f"(d) new_group raised after {res['elapsed']:.2f} s: {res['error']}")
        # Before, the set-up waited for rank 2's process id until the timeout and said
        # "not there within the group's timeout".
        assert res["error"] is not None and "group rank 2" in res["error"] and "exited" in res["error"], res
        # Nor do the others then wait for rank 2 to say it is done with the store: before,
        # leave_together did not know its process and waited its whole bound (at least
        # LEAVE_WAIT_S, 2 s, on every run); now the set-up fails within milliseconds.
        assert res["elapsed"] < LEAVE_WAIT_S, res


def init_and_report(rank: int, world_size: int, tmp: str) -> dict:
    """``init_process_group`` with a timeout of :data:`GROUP_TIMEOUT_S`; the error it raised
    (None if none) and how long it took."""
    import flagos_shm  # noqa: F401

    res = {"error": None}
    t0 = time.monotonic()
    try:
        dist.init_process_group("flagos_shm", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
    res["elapsed"] = time.monotonic() - t0
    return res


@pytest.mark.parametrize("name,value", [
    ("FLAGOS_SHM_PINNED_POOL_BYTES", "abc"),  # read when the c10d adapter is loaded, before the rendezvous
    ("FLAGOS_SHM_P2P_SLOTS", "x"),  # otherwise read when a pair first talks
    ("FLAGOS_SHM_SLOT_BYTES", "12"),  # otherwise read by the segment's creator (rank 0) only
])
def test_malformed_setting_on_one_rank_fails_every_rank_at_once(name, value):
    """Before, the rank with the setting raised alone (or, for the slot size, ignored it)
    and the others waited until the group's timeout."""
    results = spawn(init_and_report, 2, rank_env={1: {name: value}}, timeout=DEADLINE_S)
    bad, other = results[1], results[0]
    print(f"(e) {name}={value!r} on rank 1: rank 0 raised after {other['elapsed']:.2f} s: {other['error']}")
    assert bad["error"] is not None and bad["error"].startswith("ValueError") and name in bad["error"], bad
    assert other["error"] is not None and "group rank 1" in other["error"] and name in other["error"], other
    assert other["elapsed"] < GROUP_TIMEOUT_S / 2, other


def new_group_and_report(rank: int, world_size: int, tmp: str, timeouts: list) -> dict:
    """``new_group`` with a timeout of ``timeouts[rank]`` seconds (on a default group whose
    timeout, also the store's, is :data:`GROUP_TIMEOUT_S`): the error it raised and how
    long it took."""
    import flagos_shm  # noqa: F401

    dist.init_process_group("flagos_shm", rank=rank, world_size=world_size, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    res = {"error": None}
    t0 = time.monotonic()
    try:
        dist.new_group(backend="flagos_shm", timeout=timedelta(seconds=timeouts[rank]))
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
    res["elapsed"] = time.monotonic() - t0
    dist.destroy_process_group()
    return res


@pytest.mark.parametrize("timeouts", [[0, 0], [-5, -5], [GROUP_TIMEOUT_S, 0]])
def test_non_positive_group_timeout_is_refused_on_every_rank(timeouts):
    """A group timeout of zero or less used to become the 30-minute default silently (Gloo
    fails every call at once with 0 and refuses a negative one)."""
    results = spawn(new_group_and_report, 2, args=(timeouts,), timeout=DEADLINE_S)
    for rank, res in enumerate(results):
        if timeouts[rank] <= 0:
            assert res["error"] is not None and res["error"].startswith("ValueError: timeout"), res
        else:  # the peer that gave up is named, at once
            assert res["error"] is not None and "group rank 1" in res["error"] and "timeout" in res["error"], res
            assert res["elapsed"] < GROUP_TIMEOUT_S / 2, res


@needs_unshare
@pytest.mark.parametrize("mode", ["plain", "slow-reader"])
def test_rank_that_cannot_open_the_segment_fails_every_rank_at_once(mode):
    """Rank 1 has another /dev/shm but FLAGOS_SHM_NODE_ID says it is on rank 0's node.

    Rank 0 holds the store (``TCPStore``); a rank that raised used to leave at once and
    take the store along, so that rank 1, still reading why, once raised ``DistNetworkError:
    Broken pipe`` instead (``slow-reader`` makes that reader late every time)."""
    with private_shm_namespace() as (prefix, leftovers):
        results = spawn(setup_rank, 2, args=(mode,), timeout=DEADLINE_S, wrap={1: prefix},
                        env={"FLAGOS_SHM_NODE_ID": "same-node"})
        assert leftovers() == []
    for rank, res in enumerate(results):
        print(f"(b) rank {rank} raised after {res['elapsed']:.2f} s: {res['error']}")
        assert res["error"] is not None, (rank, res)
        assert res["elapsed"] < DETECT_S, (rank, res)
        msg = res["error"]
        assert "group rank 1" in msg and "cannot open" in msg and "FileNotFoundError" in msg, msg
        assert "/dev/shm" in msg and "mount namespace" in msg, msg


@needs_unshare
def test_ranks_in_different_pid_namespaces_are_detected_at_set_up():
    results = spawn(setup_rank, 2, args=("plain",), timeout=DEADLINE_S,
                    wrap={1: ["unshare", "-p", "-f", "--mount-proc"]})
    for rank, res in enumerate(results):
        print(f"(c) rank {rank} raised after {res['elapsed']:.2f} s: {res['error']}")
        assert res["error"] is not None, (rank, res)
        assert res["elapsed"] < DETECT_S, (rank, res)
        msg = res["error"]
        assert "PID namespace" in msg and "group rank 1" in msg and "group rank 0" in msg, msg
    assert results[1]["pid"] == 1  # it really ran in its own PID namespace


if __name__ == "__main__":
    pytest.main([__file__, "-s", "-q"])
