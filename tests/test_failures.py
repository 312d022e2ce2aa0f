"""Failure behaviour (issue 5): dead and stopped peers, abort/shutdown, Ctrl-C, mismatched
calls, the /dev/shm budget, leaks, many groups.

The tests run in the session's rank pools (``conftest.worlds``). A rank that must die or
stop is a *victim* forked by pool rank 0 (:func:`faults.fork_rank`): it joins a
flagos_shm process group built directly on a ``FileStore`` (:func:`faults.shm_group`) together
with the pool's ranks, then kills or stops itself at a chosen point (before a collective,
while its peers wait for it, or in the middle of a multi-step collective: a 16 MiB message
through 4 KiB slots takes thousands of steps). Pool rank 0 reaps it, so the pool itself
survives and no process is left behind even when a test fails. Groups use a timeout of
:data:`TIMEOUT_S` seconds.

Each test asserts on values: the exception type and what its message names (collective,
group, missing ranks), the time it took (from the kill, written by the victim with the
machine-wide monotonic clock), output values, and what the segment directory and each
process's mappings hold afterwards.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import faults
from faults import error_info, fork_rank, prepare, reap, read_json, reported_step, shm_group, steps_of, write_json
from flagos_shm.backend import shm_part

#: Timeout of the groups built by these tests, seconds.
TIMEOUT_S = 3.0
#: Small chunk slot for multi-step collectives, bytes.
SMALL_SLOT = 4096

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _flagos_only(backend):
    if backend != "flagos_shm":
        pytest.skip("failure behaviour of the flagos_shm backend")


def _pool(worlds, size: int):
    """The session's pool of ``size`` ranks; health-checked after the test (a pool left
    unusable is replaced rather than handed to the next test)."""
    return worlds(size)


# ==== 1. dead or stopped peers ===================================================================

def _signal_self(sig: str, out_dir: str, grank: int) -> None:
    write_json(os.path.join(out_dir, f"signalled{grank}.json"), {"at": time.monotonic(), "pid": os.getpid()})
    os.kill(os.getpid(), signal.SIGKILL if sig == "KILL" else signal.SIGSTOP)


def _signal_when_done_up_to(out: torch.Tensor, i: int, target: float, sig: str, out_dir: str, grank: int) -> None:
    """Watch this rank's output while the collective (running in the main thread, GIL
    released) fills it chunk by chunk; signal ourselves once element ``i`` holds its
    result ``target``."""
    flat = out.reshape(-1)
    deadline = time.monotonic() + 30
    while flat[i].item() != target and time.monotonic() < deadline:
        time.sleep(0.0002)
    _signal_self(sig, out_dir, grank)


def _plan(case: dict, size: int, victim_granks: list) -> list:
    """The sequence of (kind, seed, root) every rank issues: a barrier, and for a mid-way
    kill a full run of the collective and another barrier, then the collective that meets
    the failure."""
    root = victim_granks[0] if case.get("root") == "victim" else 0
    ops = [("barrier", 0, 0)]
    if case["when"] == "inside":
        ops += [(case["kind"], 1, root), ("barrier", 0, 0)]
    return ops + [(case["kind"], 2, root)]


def _victim(store: str, grank: int, size: int, name: str, case: dict, out_dir: str, victim_granks: list) -> None:
    """A forked rank that joins the group and then dies or stops as ``case`` says. After a
    SIGSTOP it is continued (SIGCONT) by its parent once the survivors have given up, and
    reports what its next calls did."""
    pg = shm_group(store, grank, size, name, TIMEOUT_S, slot_bytes=case.get("slot"))
    ops = _plan(case, size, victim_granks)
    report = {}
    try:
        for i, (kind, seed, root) in enumerate(ops):
            last = i == len(ops) - 1
            if last and case["when"] == "before":
                _signal_self(case["sig"], out_dir, grank)
            elif last and case["when"] == "waiting":
                time.sleep(0.3)
                _signal_self(case["sig"], out_dir, grank)
            call, out, exp = prepare(pg, kind, case.get("numel", 0), seed, root)
            if last and case["when"] == "inside":
                # Signal in the middle: once the element a third of the way in is written
                # (the chunks go in order; for allgather, rank 0's block at a third).
                i = case["numel"] // 3
                while out.reshape(-1)[i] == exp.reshape(-1)[i]:  # one whose value will change
                    i += 1
                threading.Thread(target=_signal_when_done_up_to,
                                 args=(out, i, exp.reshape(-1)[i].item(), case["sig"], out_dir, grank),
                                 daemon=True).start()
            try:
                call()
            except Exception as exc:  # noqa: BLE001  reported (after SIGCONT)
                report["resumed_call"] = error_info(exc)
                break
            if last:
                report["resumed_call"] = {"type": None, "value_ok": out is None or torch.equal(out, exp)}
        try:  # whatever happened, the group must now refuse calls
            pg.barrier().wait()
            report["next_call"] = None
        except Exception as exc:  # noqa: BLE001
            report["next_call"] = error_info(exc)
    finally:
        write_json(os.path.join(out_dir, f"victim{grank}.json"), report)
        pg.shutdown()


def rank_peer_failure(tmp: str, case: dict, tag: str) -> dict:
    """Pool ranks (survivors) and ``case['victims']`` forked victims form one group; run the
    plan and report what the survivors' collective raised, when, and what a later call did."""
    pool_rank, pool_n = dist.get_rank(), dist.get_world_size()
    n_victims = case.get("victims", 1)
    size = pool_n + n_victims
    victim_granks = list(range(pool_n, size))
    store, name = os.path.join(tmp, "store"), f"failure-{tag}"
    pids = []
    if pool_rank == 0:
        pids = [fork_rank(_victim, store, g, size, name, case, tmp, victim_granks) for g in victim_granks]
    res: dict = {"victim_granks": victim_granks}
    maps_before = faults.segment_maps()
    pg = None
    try:
        pg = shm_group(store, pool_rank, size, name, TIMEOUT_S, slot_bytes=case.get("slot"))
        ops = _plan(case, size, victim_granks)
        first_step = 1
        for i, (kind, seed, root) in enumerate(ops):
            k = steps_of(kind, case.get("numel", 0), size, shm_part(pg)._comm.slot_bytes)
            call, out, exp = prepare(pg, kind, case.get("numel", 0), seed, root)
            t0 = time.monotonic()
            try:
                call()
            except Exception as exc:  # noqa: BLE001  the expected failure
                res.update(error=error_info(exc), raised_at=time.monotonic(), elapsed=time.monotonic() - t0,
                           op=i, first_step=first_step, last_step=first_step + k - 1)
                break
            if i < len(ops) - 1 and out is not None and not torch.equal(out, exp):
                res["wrong_before_failure"] = f"op {i} ({kind}) gave wrong values"
            first_step += k
        else:
            res.update(error=None, elapsed=time.monotonic() - t0)
        t1 = time.monotonic()
        try:
            pg.barrier().wait()
            res["later"] = None
        except Exception as exc:  # noqa: BLE001
            res["later"] = error_info(exc)
        res["later_s"] = time.monotonic() - t1
        dist.barrier()  # every survivor has given up before a stopped victim is continued
    finally:
        if pool_rank == 0:
            res["victim_exit"] = [reap(pid, 5.0, cont=case["sig"] == "STOP") for pid in pids]
        if pg is not None:
            pg.shutdown()
    if pool_rank == 0:
        res["victims"] = [read_json(os.path.join(tmp, f"victim{g}.json")) for g in victim_granks]
        res["signalled"] = [read_json(os.path.join(tmp, f"signalled{g}.json")) for g in victim_granks]
    res["maps"] = sorted(set(faults.segment_maps()) - set(maps_before))
    return res


LARGE = 4 << 20  # float32 elements: 16 MiB, 4096 chunks of 4 KiB
PEER_CASES = {
    # name: when (before: the victim dies right before the collective; waiting: it dies
    # 0.3 s after its peers entered it; inside: in the middle of a multi-step collective,
    # once a third of its output is written)
    "kill-allreduce-small-before": dict(kind="allreduce", numel=1000, when="before", sig="KILL"),
    "kill-allreduce-small-waiting": dict(kind="allreduce", numel=1000, when="waiting", sig="KILL"),
    "kill-allreduce-large-midway": dict(kind="allreduce", numel=LARGE, slot=SMALL_SLOT, when="inside", sig="KILL"),
    "kill-allgather-midway": dict(kind="allgather", numel=LARGE // 2, slot=SMALL_SLOT, when="inside", sig="KILL"),
    "kill-broadcast-midway": dict(kind="broadcast", numel=LARGE, slot=SMALL_SLOT, when="inside", sig="KILL"),
    "kill-broadcast-root-waiting": dict(kind="broadcast", numel=1000, when="waiting", sig="KILL", root="victim"),
    "kill-barrier-waiting": dict(kind="barrier", when="waiting", sig="KILL"),
    "kill-two-allreduce-waiting": dict(kind="allreduce", numel=1000, when="waiting", sig="KILL", victims=2),
    "stop-allreduce-large-midway": dict(kind="allreduce", numel=LARGE, slot=SMALL_SLOT, when="inside", sig="STOP"),
    "stop-barrier-waiting": dict(kind="barrier", when="waiting", sig="STOP"),
}


@pytest.mark.parametrize("name", list(PEER_CASES))
def test_dead_or_stopped_peer(worlds, tmp_path, name):
    """Every survivor raises RuntimeError naming the collective, the group and the missing
    rank(s): a killed peer within half the timeout of its death, a stopped one at the
    timeout; later calls on the group fail at once; the victim, if continued, is refused
    too; values computed before the failure are right; nothing stays mapped."""
    case = PEER_CASES[name]
    world = worlds(2)
    kinds = {"allreduce": "allreduce", "allgather": "allgather", "broadcast": "broadcast", "barrier": "barrier"}
    midway_seen = case["when"] != "inside"
    for attempt in range(3 if not midway_seen else 1):
        tmp = tmp_path / f"attempt{attempt}"
        tmp.mkdir()
        try:
            results = world.run(rank_peer_failure, str(tmp), case, f"{name}-{attempt}", timeout=60)
        finally:
            world.check_health()
        problems = []
        victims = results[0]["victim_granks"]
        signalled = [s["at"] for s in results[0]["signalled"] if s]
        if case["when"] == "inside" and (not signalled or any(res["error"] is None for res in results)):
            print(f"{name} attempt {attempt}: the victim was signalled after the collective; trying again")
            continue  # the collective outran the victim's watcher: not a test of anything
        assert signalled, f"{name}: the victim never signalled itself: {results[0]['victims']}"
        killed_at = min(signalled)
        for rank, res in enumerate(results):
            err = res["error"]
            if res.get("wrong_before_failure"):
                problems.append(f"rank {rank}: {res['wrong_before_failure']}")
            if err is None:
                problems.append(f"rank {rank}: the collective did not fail (the victim died after it?)")
                continue
            msg = err["message"]
            if err["type"] != "RuntimeError":
                problems.append(f"rank {rank}: raised {err['type']}, expected RuntimeError: {msg}")
            for needed in (kinds[case["kind"]], f"group 'failure-{name}-{attempt}'"):
                if needed not in msg:
                    problems.append(f"rank {rank}: message does not name {needed!r}: {msg}")
            # The missing ranks include the victims; a live peer that was itself behind
            # (e.g. a broadcast root still filling the next chunk) may be listed too.
            missing = re.search(r"ranks \[([0-9, ]*)\]", msg)
            listed = {int(x) for x in missing.group(1).split(",") if x.strip()} if missing else set()
            if not set(victims) <= listed:
                problems.append(f"rank {rank}: message does not name the missing ranks {victims}: {msg}")
            since_kill = res["raised_at"] - killed_at
            if case["sig"] == "KILL":
                if "exited" not in msg:
                    problems.append(f"rank {rank}: message does not say the peer exited: {msg}")
                if not since_kill < TIMEOUT_S / 2:
                    problems.append(f"rank {rank}: noticed the death after {since_kill:.2f} s (timeout {TIMEOUT_S} s)")
            else:
                if "within the timeout" not in msg and "aborted" not in msg:
                    problems.append(f"rank {rank}: message does not say it timed out: {msg}")
                if not TIMEOUT_S - 0.05 <= res["elapsed"] < TIMEOUT_S + 2.0:
                    problems.append(f"rank {rank}: raised after {res['elapsed']:.2f} s, expected the timeout "
                                    f"of {TIMEOUT_S} s")
            if res["later"] is None or res["later"]["type"] != "RuntimeError" or res["later_s"] > 0.5:
                problems.append(f"rank {rank}: a later call gave {res['later']} after {res['later_s']:.2f} s")
            if res["maps"]:
                problems.append(f"rank {rank}: segments still mapped after shutdown: {res['maps']}")
            step = reported_step(msg)
            if step and case["when"] == "inside" and res["first_step"] < step[1] <= res["last_step"]:
                midway_seen = True
        for v, rep in zip(victims, results[0]["victims"]):
            if case["sig"] == "STOP":
                # continued after the survivors gave up: its calls must be refused (or, if
                # it resumed after the last step, have completed with the right values)
                if rep is None or rep.get("next_call", {}) is None or rep["next_call"]["type"] != "RuntimeError":
                    problems.append(f"victim {v}: after SIGCONT its next call gave {rep}")
                rc = rep and rep.get("resumed_call")
                if rc and rc["type"] is None and not rc["value_ok"]:
                    problems.append(f"victim {v}: resumed and completed with wrong values")
            elif rep is not None:
                problems.append(f"victim {v}: survived SIGKILL? {rep}")
        print(f"{name} attempt {attempt}: " + "; ".join(
            f"rank {r}: {res['error'] and res['error']['type']} after {res['raised_at'] - killed_at:.3f} s "
            f"from the signal, step {reported_step(res['error']['message']) if res['error'] else None} "
            f"of [{res.get('first_step')}, {res.get('last_step')}]" for r, res in enumerate(results)
            if res.get("raised_at")))
        left = faults.segments_in(world.shm_dir)
        if left:
            problems.append(f"segment files left in {world.shm_dir}: {left}")
        assert not problems, f"{name} (attempt {attempt}):\n" + "\n".join(problems)
        if midway_seen:
            break
    assert midway_seen, f"{name}: in 3 attempts the victim never died in the middle of the collective"


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
            timer = threading.Timer(RELEASE_AFTER_S, action)
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
            res["elapsed"] = time.monotonic() - t0
            timer.join()
            if how == "sigint":
                signal.signal(signal.SIGINT, previous)
            res["untouched"] = torch.equal(t, torch.arange(8, dtype=torch.float32))
            t1 = time.monotonic()
            try:
                pg.barrier().wait()
                res["next"] = None
            except Exception as exc:  # noqa: BLE001
                res["next"] = error_info(exc)
            res["next_s"] = time.monotonic() - t1
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
    """A rank waiting for a peer that does not come is released within a fraction of a
    second (group timeout 20 s) by abort() or shutdown() from another thread (RuntimeError)
    or by Ctrl-C (KeyboardInterrupt); its tensor is untouched; the group is aborted for
    everyone: its next call, and the peer's call, raise RuntimeError at once."""
    world = worlds(2)
    try:
        r0, r1 = world.run(rank_release, str(tmp_path), how, how, timeout=60)
    finally:
        world.check_health()
    expected = "KeyboardInterrupt" if how == "sigint" else "RuntimeError"
    assert r0["error"] and r0["error"]["type"] == expected, r0
    assert RELEASE_AFTER_S - 0.05 < r0["elapsed"] < RELEASE_AFTER_S + 1.0, r0
    assert r0["untouched"], r0
    assert r0["next"] and r0["next"]["type"] == "RuntimeError" and r0["next_s"] < 0.5, r0
    reason = {"abort": "aborted", "shutdown": "shut down", "sigint": "interrupted"}[how]
    assert reason in r0["next"]["message"], r0
    assert r1["error"] and r1["error"]["type"] == "RuntimeError" and r1["elapsed"] < 0.5, r1
    assert "aborted by rank 0" in r1["error"]["message"] and "release-" in r1["error"]["message"], r1


# ==== 2. mismatched calls ===========================================================================

MISMATCH_BIG = 1 << 20  # float32 elements: 4 MiB, 8 chunks of the default 512 KiB slot


def _mismatch_call(case: str, odd: bool, rank: int, n: int):
    """The call of one rank in mismatch case ``case`` (``odd``: the rank that differs).
    Returns ``(call, tensors the call may write, the words that describe this rank's side)``."""
    f32 = torch.float32
    base = torch.arange(12, dtype=f32) + 10 * rank
    if case == "collective: all_reduce vs all_gather_into_tensor":
        if odd:
            out = torch.full((n * 12,), -1.0)
            return lambda: dist.all_gather_into_tensor(out, base.clone()), [out], ["allgather"]
        return lambda: dist.all_reduce(base), [base], ["allreduce"]
    if case == "collective: all_reduce vs barrier":
        if odd:
            return lambda: dist.barrier(), [], ["barrier"]
        return lambda: dist.all_reduce(base), [base], ["allreduce"]
    if case == "collective: broadcast vs reduce":
        if odd:
            return lambda: dist.reduce(base, dst=0), [base], ["reduce"]
        return lambda: dist.broadcast(base, src=0), [base], ["broadcast"]
    if case == "collective: reduce_scatter_tensor vs all_to_all_single":
        src = torch.arange(n * 4, dtype=f32) + rank
        if odd:
            out = torch.full((n * 4,), -1.0)
            return lambda: dist.all_to_all_single(out, src), [out], ["alltoall"]
        out = torch.full((4,), -1.0)
        return lambda: dist.reduce_scatter_tensor(out, src), [out], ["reduce_scatter"]
    if case == "dtype: int32 vs float32":
        t = base.to(torch.int32) if odd else base
        return lambda: dist.all_reduce(t), [t], ["int32" if odd else "float32"]
    if case == "size: 4 MiB (8 chunks) vs 48 bytes":
        t = torch.ones(MISMATCH_BIG) * rank if odd else base
        return lambda: dist.all_reduce(t), [t], [f"{t.numel()} elements"]
    if case == "reduce op: SUM vs MIN":
        op = dist.ReduceOp.MIN if odd else dist.ReduceOp.SUM
        return lambda: dist.all_reduce(base, op=op), [base], ["MIN" if odd else "SUM"]
    if case == "root: broadcast from 0 vs from 2":
        root = 2 if odd else 0
        return lambda: dist.broadcast(base, src=root), [base], [f"root {root}"]
    if case == "root: reduce to 0 vs to 1":
        root = 1 if odd else 0
        return lambda: dist.reduce(base, dst=root), [base], [f"root {root}"]
    raise ValueError(f"case: unknown {case!r}")


def rank_mismatch(case: str, odd_rank: int) -> dict:
    """Every rank issues its side of ``case`` at the same position of the group's sequence;
    report the error, whether the written-to tensors are untouched, and whether a correct
    all_reduce and a correct repeat of the collective on the same group work afterwards."""
    rank, n = dist.get_rank(), dist.get_world_size()
    call, written, mine = _mismatch_call(case, rank == odd_rank, rank, n)
    theirs = _mismatch_call(case, rank != odd_rank, rank, n)[2]
    before = [t.clone() for t in written]
    res: dict = {"mine": mine, "theirs": theirs}
    try:
        call()
        res["error"] = None
    except Exception as exc:  # noqa: BLE001
        res["error"] = error_info(exc)
    res["untouched"] = all(torch.equal(a, b) for a, b in zip(written, before))
    t = torch.arange(5, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    res["after_ok"] = torch.equal(t, torch.arange(5, dtype=torch.float32) * (n * (n + 1) // 2))
    # the same collective, now agreed by every rank
    same, written, _ = _mismatch_call(case, False, rank, n)
    same()
    if "all_reduce" in case or case.startswith(("dtype", "size", "reduce op")):
        res["repeat_ok"] = torch.equal(written[0], sum(torch.arange(12, dtype=torch.float32) + 10 * r
                                                       for r in range(n)))
    else:
        res["repeat_ok"] = None  # checked by the collective tests; here it must just not raise
    return res


MISMATCH_CASES = ["collective: all_reduce vs all_gather_into_tensor", "collective: all_reduce vs barrier",
                  "collective: broadcast vs reduce", "collective: reduce_scatter_tensor vs all_to_all_single",
                  "dtype: int32 vs float32", "size: 4 MiB (8 chunks) vs 48 bytes", "reduce op: SUM vs MIN",
                  "root: broadcast from 0 vs from 2", "root: reduce to 0 vs to 1"]


@pytest.mark.parametrize("case", MISMATCH_CASES)
def test_mismatched_calls(worlds, case):
    """Ranks that issue different collectives, dtypes, sizes, reduce ops or roots at the same
    position raise ValueError on every rank, describing their own call and the other
    side's; no output is written; the group stays usable (the next collectives are right)."""
    world = worlds(3)
    odd = 1
    try:
        results = world.run(rank_mismatch, case, odd, timeout=60)
    finally:
        world.check_health()
    problems = []
    for rank, res in enumerate(results):
        err = res["error"]
        if err is None or err["type"] != "ValueError":
            problems.append(f"rank {rank}: expected ValueError, got {err}")
            continue
        msg = err["message"]
        other = 0 if rank == odd else odd
        for word in res["mine"] + res["theirs"] + [f"rank {rank} called", f"rank {other} called"]:
            if word not in msg:
                problems.append(f"rank {rank}: message lacks {word!r}: {msg}")
        if not res["untouched"]:
            problems.append(f"rank {rank}: an output was written")
        if not res["after_ok"] or res["repeat_ok"] is False:
            problems.append(f"rank {rank}: the group gave wrong results afterwards: {res}")
    print(f"{case}: rank 0 says: {results[0]['error'] and results[0]['error']['message']}")
    assert not problems, f"{case}:\n" + "\n".join(problems)


# ==== 3. the /dev/shm budget ========================================================================

TMPFS_BYTES = 1 << 20


@pytest.fixture
def small_tmpfs():
    """A 1 MiB tmpfs mounted on a fresh directory (needs root / CAP_SYS_ADMIN; skipped
    otherwise), unmounted and removed afterwards whatever happens."""
    import subprocess
    import tempfile

    path = tempfile.mkdtemp(prefix="flagos_shm_tmpfs_")
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", path],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        os.rmdir(path)
        pytest.skip(f"cannot mount a small tmpfs here ({exc}); covered only by "
                    "test_segment_larger_than_the_filesystem_fails_at_creation")
    if proc.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a small tmpfs here (mount: {proc.stderr.strip()}); covered only by "
                    "test_segment_larger_than_the_filesystem_fails_at_creation")
    try:
        yield path
    finally:
        if subprocess.run(["umount", path], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
        os.rmdir(path)


def rank_group_in(tmp: str, shm_dir: str, slot_bytes: int, tag: str) -> dict:
    """Try to create a group of the pool's ranks with its segment in ``shm_dir``; report
    the error, or (if it fits) fill the rest of the file system and run collectives that
    touch every page of the segment."""
    rank, n = dist.get_rank(), dist.get_world_size()
    res: dict = {}
    try:
        pg = shm_group(os.path.join(tmp, "store"), rank, n, f"budget-{tag}", TIMEOUT_S, slot_bytes=slot_bytes,
                       shm_dir=shm_dir)
    except Exception as exc:  # noqa: BLE001
        res["error"] = error_info(exc)
        return res
    res["error"] = None
    try:
        res["segment_bytes"] = shm_part(pg)._comm.segment_bytes
        dist.barrier()
        if rank == 0:  # fill the file system: a page the segment had not reserved would now SIGBUS
            filler = os.path.join(shm_dir, "filler")
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                while True:
                    os.write(fd, b"\1" * 4096)
            except OSError:
                pass
            finally:
                os.close(fd)
            st = os.statvfs(shm_dir)
            res["free_after_fill"] = st.f_bavail * st.f_frsize
        dist.barrier()
        numel = 10 * slot_bytes // 4 + 3  # 10 chunks: both slots of every rank, written and read
        inputs = [faults.rank_input(numel, 7, r) for r in range(n)]
        t = inputs[rank].clone()
        pg.allreduce([t]).wait()
        out = torch.empty(n * numel)
        pg._allgather_base(out, inputs[rank]).wait()
        res["values_ok"] = torch.equal(t, torch.stack(inputs).sum(0)) and torch.equal(out, torch.cat(inputs))
        dist.barrier()
        if rank == 0:
            os.unlink(filler)
    finally:
        pg.shutdown()
    return res


def test_segment_that_does_not_fit_fails_at_creation(worlds, tmp_path, small_tmpfs):
    """A 2-rank group with 512 KiB slots needs 2 MiB + 4 KiB; in a 1 MiB tmpfs its creation
    fails at once: group rank 0 raises OSError naming the path, the bytes needed and the
    bytes free; the other rank RuntimeError quoting it; nothing is left in the directory."""
    from flagos_shm import _core

    world = worlds(2)
    slot = 512 * 1024
    try:
        r0, r1 = world.run(rank_group_in, str(tmp_path), small_tmpfs, slot, "too-big", timeout=60)
    finally:
        world.check_health()
    needed = _core.segment_bytes(2, slot)
    assert r0["error"] and r0["error"]["type"] == "OSError", r0
    assert r1["error"] and r1["error"]["type"] == "RuntimeError", r1
    for res in (r0, r1):
        msg = res["error"]["message"]
        for word in (os.path.join(small_tmpfs, faults.SEGMENT_PREFIX), f"{needed} bytes",
                     f"{TMPFS_BYTES} bytes free in {small_tmpfs}"):
            assert word in msg, (word, msg)
    assert "group rank 0 could not create" in r1["error"]["message"], r1
    assert os.listdir(small_tmpfs) == []


def test_full_tmpfs_after_creation_does_not_sigbus(worlds, tmp_path, small_tmpfs):
    """A group whose segment fits (2 ranks x 2 slots of 128 KiB + 4 KiB) reserves all its
    pages at creation: with the tmpfs then filled to the last byte by another file, 10-chunk
    collectives touching every slot page still give the right values (no SIGBUS)."""
    world = worlds(2)
    try:
        results = world.run(rank_group_in, str(tmp_path), small_tmpfs, 128 * 1024, "fits", timeout=60)
    finally:
        world.check_health()
    for rank, res in enumerate(results):
        assert res["error"] is None and res["values_ok"], (rank, res)
    assert results[0]["free_after_fill"] == 0, results[0]
    assert os.listdir(small_tmpfs) == []


def test_segment_larger_than_the_filesystem_fails_at_creation(tmp_path):
    """Without mounting anything: a group whose segment exceeds the whole of /dev/shm (1 GiB
    slots, enough ranks) fails on group rank 0 as soon as the peers have published their
    identities (here: copies of rank 0's, so that they are on its node), before any peer
    attaches, with OSError naming the path, the bytes needed and the bytes free; no file is
    left."""
    import json

    from flagos_shm import ShmGroup, _core
    from flagos_shm.backend import rendezvous

    shm = "/dev/shm"
    if not os.path.isdir(shm):
        pytest.skip("no /dev/shm")
    st = os.statvfs(shm)
    slot = 1 << 30
    n = st.f_blocks * st.f_frsize // (2 * slot) + 2
    if n > 4096:
        pytest.skip(f"/dev/shm is too large ({st.f_blocks * st.f_frsize} bytes) for one segment to exceed it")
    needed = _core.segment_bytes(n, slot)
    before = faults.segments_in(shm)
    with faults.env_override(FLAGOS_SHM_DIR=shm, FLAGOS_SHM_SLOT_BYTES=slot):
        with pytest.raises(OSError) as info:
            store = dist.HashStore()
            store.add("flagos_shm/rendezvous", n - 1)  # the other ranks have joined incarnation 0
            for r in range(1, n):
                store.set(f"flagos_shm/0/pid/{r}", json.dumps(rendezvous.identity()))
            ShmGroup(store, 0, n, timeout=5)
    msg = str(info.value)
    assert f"{shm}/{faults.SEGMENT_PREFIX}" in msg and f"{needed} bytes" in msg and "bytes free in /dev/shm" in msg, msg
    assert set(faults.segments_in(shm)) <= set(before)


# ==== 4. nothing leaked ==============================================================================

INIT_TIMEOUT_S = 1.5


@pytest.fixture
def private_shm_dir():
    """A fresh, empty segment directory under /dev/shm (removed afterwards; the test
    checks what it holds)."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix=f"flagos_shm_failures_{os.getpid()}_", dir="/dev/shm" if os.path.isdir("/dev/shm")
                            else None)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _init_victim(store: str, grank: int, size: int, shm_dir: str, point: str, out_dir: str) -> None:
    """A rank killed during set-up: ``created`` (group rank 0, after publishing its process
    id and creating the segment file, before publishing the file's path), ``published``
    (group rank 0, after publishing the path, before attaching), ``rendezvous`` (another
    rank, after reading the path and the process ids, before attaching)."""
    from flagos_shm import _core
    from flagos_shm.backend import rendezvous

    st = dist.FileStore(store, size)
    st.set_timeout(timedelta_s(INIT_TIMEOUT_S))
    with faults.env_override(FLAGOS_SHM_DIR=shm_dir):
        if point == "created":
            rendezvous.publish_pid(st, grank, size)
            _core.create_segment(shm_dir, size, int(_core.DEFAULT_SLOT_BYTES))
        else:
            rendezvous.rendezvous(st, grank, size, INIT_TIMEOUT_S)
    _signal_self("KILL", out_dir, grank)


def timedelta_s(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def rank_killed_during_init(tmp: str, shm_dir: str, point: str) -> dict:
    """The pool's ranks and one victim (forked by pool rank 0) set up a group; the victim is
    killed during set-up. Report what the survivors raised, what the directory held then,
    and after a later group (of the pool's ranks) was created in the same directory."""
    pool_rank, pool_n = dist.get_rank(), dist.get_world_size()
    size = pool_n + 1
    victim = 0 if point in ("created", "published") else pool_n
    granks = [r for r in range(size) if r != victim]
    store = os.path.join(tmp, "store")
    maps_before = faults.segment_maps()
    pid = fork_rank(_init_victim, store, victim, size, shm_dir, point, tmp) if pool_rank == 0 else None
    res: dict = {}
    try:
        t0 = time.monotonic()
        try:
            pg = shm_group(store, granks[pool_rank], size, f"init-{point}", INIT_TIMEOUT_S, shm_dir=shm_dir)
            pg.shutdown()
            res["error"] = None
        except Exception as exc:  # noqa: BLE001
            res["error"] = error_info(exc)
        res["elapsed"] = time.monotonic() - t0
    finally:
        if pid is not None:
            res["victim_exit"] = reap(pid, 5.0)
    dist.barrier()
    res["left_after_failure"] = faults.segments_in(shm_dir)
    dist.barrier()
    # the next group created in the directory sweeps segments whose creator is gone
    pg = shm_group(os.path.join(tmp, "store2"), pool_rank, pool_n, f"init-{point}-next", TIMEOUT_S, shm_dir=shm_dir)
    t = torch.ones(3)
    pg.allreduce([t]).wait()
    res["next_ok"] = torch.equal(t, torch.full((3,), float(pool_n)))
    pg.shutdown()
    dist.barrier()
    res["left_after_next"] = faults.segments_in(shm_dir)
    res["maps"] = sorted(set(faults.segment_maps()) - set(maps_before))
    return res


@pytest.mark.parametrize("point", ["rendezvous", "published", "created"])
def test_rank_killed_during_set_up(worlds, tmp_path, private_shm_dir, point):
    """A rank SIGKILLed while a group is being set up (after it published its process id):
    the others raise RuntimeError naming it well before the timeout (INIT_TIMEOUT_S); the
    segment file is removed by them, except when the creator dies between creating and
    publishing it, in which case the next group created in that directory removes it.
    Nothing stays mapped."""
    world = worlds(2)
    try:
        results = world.run(rank_killed_during_init, str(tmp_path), private_shm_dir, point, timeout=60)
    finally:
        world.check_health()
    for rank, res in enumerate(results):
        err = res["error"]
        print(f"{point}: rank {rank} after {res['elapsed']:.2f} s: {err}")
        assert err is not None and err["type"] == "RuntimeError", (rank, res)
        # noticed through the victim's process id, not at the timeout
        assert res["elapsed"] < INIT_TIMEOUT_S / 2, (rank, res)
        victim = 0 if point in ("created", "published") else 2
        assert f"init-{point}" in err["message"], (rank, res)
        if point != "created":  # the survivors attached and waited for the victim
            # The rank that saw the victim exit names it; the others quote the missing rank
            # and the rank that gave up.
            assert (f"rank {victim} (pid" in err["message"] and "exited before attaching" in err["message"]) or \
                f"ranks [{victim}] did not attach" in err["message"], (rank, res)
            assert res["left_after_failure"] == [], (rank, res)
        else:  # the only window that leaves a file behind, until the next group sweeps it
            assert "waiting for group rank 0's segment path" in err["message"] and \
                "group rank 0 (pid" in err["message"] and "exited" in err["message"], (rank, res)
            assert len(res["left_after_failure"]) == 1, (rank, res)
        assert res["next_ok"] and res["left_after_next"] == [] and res["maps"] == [], (rank, res)
    assert os.listdir(private_shm_dir) == []


def test_creator_killed_while_creating_leaves_nothing_unsweepable(private_shm_dir):
    """A process creating segments in a loop, SIGKILLed at random moments (0-3 ms in, 30
    times): the directory never holds a file the next creation cannot identify and sweep
    (segments are built unnamed and named only once complete); after one more creation
    and its removal, the directory is empty."""
    import random
    import signal
    import subprocess
    import sys

    from flagos_shm import _core

    code = ("import sys\nfrom flagos_shm import _core\n"
            "while True:\n    _core.create_segment(sys.argv[1], 4, 1 << 20)\n")
    rng = random.Random(5)
    for _ in range(30):
        proc = subprocess.Popen([sys.executable, "-c", code, private_shm_dir])
        try:
            deadline = time.monotonic() + 30
            while not os.listdir(private_shm_dir):  # imported and creating
                assert proc.poll() is None and time.monotonic() < deadline, "the creator did not start"
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.003))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    path = _core.create_segment(private_shm_dir, 2, 4096)  # sweeps every dead creator's file
    assert os.listdir(private_shm_dir) == [os.path.basename(path)], os.listdir(private_shm_dir)
    os.remove(path)


CYCLES = 200


def rank_cycles(shm_dir: str, cycles: int) -> dict:
    """``cycles`` times: ``dist.new_group`` (flagos_shm, both ranks, segment in ``shm_dir``),
    an all_reduce checked against its value, every 10th cycle also a mismatched call
    (ValueError) and every 25th an abort (RuntimeError afterwards), then
    ``destroy_process_group``. Report the growth of RSS, open fds and segment mappings over
    the cycles (measured after 20 warm-up cycles) and what ``shm_dir`` holds."""
    rank, n = dist.get_rank(), dist.get_world_size()
    wrong, raised = 0, {"ValueError": 0, "RuntimeError": 0}

    def one(i: int) -> None:
        nonlocal wrong
        g = dist.new_group(list(range(n)), backend="flagos_shm")
        try:
            t = torch.full((5,), float(rank + i))
            dist.all_reduce(t, group=g)
            wrong += not torch.equal(t, torch.full((5,), float(sum(r + i for r in range(n)))))
            if i % 10 == 0:
                try:
                    dist.all_reduce(torch.ones(4 + rank), group=g)  # sizes differ: ValueError
                except ValueError:
                    raised["ValueError"] += 1
            if i % 25 == 0:
                g.abort()
                try:
                    dist.all_reduce(t, group=g)
                except RuntimeError:
                    raised["RuntimeError"] += 1
        finally:
            dist.destroy_process_group(g)

    with faults.env_override(FLAGOS_SHM_DIR=shm_dir):
        for i in range(20):
            one(i)
        dist.barrier()
        wrong, raised = 0, {"ValueError": 0, "RuntimeError": 0}
        before = faults.rss_bytes(), faults.open_fds(), faults.segment_maps()
        t0 = time.monotonic()
        for i in range(cycles):
            one(i)
        elapsed = time.monotonic() - t0
        dist.barrier()
    rss, fds, maps = faults.rss_bytes(), faults.open_fds(), faults.segment_maps()
    return {"wrong": wrong, "raised": raised, "rss_growth": rss - before[0], "fd_growth": fds - before[1],
            "maps_before": before[2], "maps_after": maps, "left": faults.segments_in(shm_dir), "elapsed": elapsed}


def test_create_use_destroy_cycles_leave_nothing(worlds, private_shm_dir):
    """200 cycles of new_group / all_reduce (/ mismatch / abort) / destroy_process_group at
    world size 2: right values, the expected errors, nothing left in the directory, no new
    mapping or fd, RSS growth under 4 MiB."""
    world = worlds(2)
    try:
        results = world.run(rank_cycles, private_shm_dir, CYCLES, timeout=90)
    finally:
        world.check_health()
    for rank, res in enumerate(results):
        print(f"rank {rank}: {CYCLES} cycles in {res['elapsed']:.2f} s, RSS growth {res['rss_growth']} bytes, "
              f"fd growth {res['fd_growth']}, errors {res['raised']}")
        assert res["wrong"] == 0, res
        assert res["raised"] == {"ValueError": CYCLES // 10, "RuntimeError": CYCLES // 25}, res
        assert res["left"] == [] and res["maps_after"] == res["maps_before"] and res["fd_growth"] <= 0, res
        assert res["rss_growth"] < 4 << 20, res
    assert os.listdir(private_shm_dir) == []


# ==== 5. many groups ===================================================================================

#: 32 groups on 4 ranks: a 2 x 2 data-parallel x tensor-parallel grid whose groups are each
#: created 6 times (24 groups), plus 8 other subsets.
TP, DP = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
GROUP_RANKS = (TP + DP) * 6 + [[0, 1, 2], [1, 2, 3], [0, 3], [0, 1, 2, 3]] * 2
SCHEDULE_OPS = 240


def _reference(kind: str, members: list, numel: int, seed: int, me: int, root: int):
    """Expected result on global rank ``me`` of ``kind`` over ``members`` (global ranks,
    sorted) with inputs ``faults.rank_input(numel, seed, global rank)``."""
    ins = [faults.rank_input(numel, seed, r) for r in members]
    if kind == "all_reduce":
        return torch.stack(ins).sum(0)
    if kind == "all_gather_into_tensor":
        return torch.cat(ins)
    if kind == "broadcast":
        return faults.rank_input(numel, seed, root)
    if kind == "reduce_scatter_tensor":
        big = [faults.rank_input(len(members) * numel, seed, r) for r in members]
        i = members.index(me)
        return torch.stack(big).sum(0)[i * numel:(i + 1) * numel]
    raise ValueError(kind)


def _issue(kind: str, group, members: list, numel: int, seed: int, me: int, root: int, async_op: bool = False):
    """Issue ``kind`` on ``group``; return ``(work or None, result tensor)``."""
    if kind == "all_reduce":
        t = faults.rank_input(numel, seed, me)
        return dist.all_reduce(t, group=group, async_op=async_op), t
    if kind == "all_gather_into_tensor":
        out = torch.full((len(members) * numel,), -1.0)
        return dist.all_gather_into_tensor(out, faults.rank_input(numel, seed, me), group=group,
                                           async_op=async_op), out
    if kind == "broadcast":
        t = faults.rank_input(numel, seed, me)
        return dist.broadcast(t, src=root, group=group, async_op=async_op), t
    if kind == "reduce_scatter_tensor":
        out = torch.full((numel,), -1.0)
        return dist.reduce_scatter_tensor(out, faults.rank_input(len(members) * numel, seed, me), group=group,
                                          async_op=async_op), out
    raise ValueError(kind)


KINDS = ["all_reduce", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor"]


def rank_many_groups(seed: int) -> dict:
    """Create the 32 groups of GROUP_RANKS; run a shuffled schedule of SCHEDULE_OPS
    collectives over them (each rank runs, in schedule order, those of its groups: the
    same global order on every rank, so no deadlock); then two threads per rank issuing
    async_op=True collectives (4 in flight before waiting) on a TP and a DP group; then
    abort one group and mismatch another and check that the rest are unaffected."""
    import random

    me, n = dist.get_rank(), dist.get_world_size()
    assert n == 4
    backend = dist.get_backend()
    failures: list = []
    checked = 0
    maps_before = faults.segment_maps()
    t0 = time.monotonic()
    groups = [dist.new_group(ranks, backend=backend) for ranks in GROUP_RANKS]
    mine = [i for i, ranks in enumerate(GROUP_RANKS) if me in ranks]
    try:
        rng = random.Random(seed)
        for step in range(SCHEDULE_OPS):
            gi = rng.randrange(len(groups))
            kind = rng.choice(KINDS)
            numel = rng.choice([1, 7, 1000, 70_001])
            members = GROUP_RANKS[gi]
            root = rng.choice(members)
            if gi not in mine:
                continue
            _, got = _issue(kind, groups[gi], members, numel, step, me, root)
            checked += 1
            if not torch.equal(got, _reference(kind, members, numel, step, me, root)):
                failures.append(f"schedule op {step}: {kind} on group {gi} {members} numel={numel}: wrong values")
        dist.barrier()

        # two threads, each with its own group (a TP group and a DP group), async ops
        tp = next(i for i in mine if GROUP_RANKS[i] in TP)
        dp = next(i for i in mine if GROUP_RANKS[i] in DP)
        counts = [0, 0]

        def worker(idx: int, gi: int) -> None:
            members = GROUP_RANKS[gi]
            for it in range(6):
                pending = []
                for j in range(4):  # four in flight before the first wait
                    kind = KINDS[(it + j) % len(KINDS)]
                    seed_ = 10_000 * (idx + 1) + 10 * it + j
                    work, got = _issue(kind, groups[gi], members, 5000, seed_, me, members[j % 2], async_op=True)
                    pending.append((work, got, kind, seed_, members[j % 2]))
                for work, got, kind, seed_, root in pending:
                    work.wait()
                    counts[idx] += 1
                    if not torch.equal(got, _reference(kind, members, 5000, seed_, me, root)):
                        failures.append(f"thread {idx} group {gi} {members} {kind} seed {seed_}: wrong values")

        threads = [threading.Thread(target=worker, args=(i, gi)) for i, gi in enumerate((tp, dp))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        checked += sum(counts)
        if counts != [24, 24]:
            failures.append(f"async threads completed {counts} operations, expected [24, 24]")
        dist.barrier()

        # private state: abort the first TP group everywhere it exists (rank 0 of it
        # aborts, its peer learns it), mismatch in the first DP group; the others are fine
        aborted, mismatched = 0, 2
        if me in GROUP_RANKS[aborted]:
            if me == GROUP_RANKS[aborted][0]:
                groups[aborted].abort()
            dist.barrier(group=groups[12])  # a fresh copy of the same TP group: both ranks past the abort
            try:
                dist.all_reduce(torch.ones(3), group=groups[aborted])
                failures.append("all_reduce on the aborted group did not raise")
            except RuntimeError as exc:
                checked += 1
                if "aborted" not in str(exc):
                    failures.append(f"aborted group raised {exc}")
        if me in GROUP_RANKS[mismatched]:
            try:
                dist.all_reduce(torch.ones(3 + me), group=groups[mismatched])
                failures.append("mismatched all_reduce did not raise")
            except ValueError:
                checked += 1
        dist.barrier()
        for gi in mine:
            if gi == aborted:
                continue
            members = GROUP_RANKS[gi]
            _, got = _issue("all_reduce", groups[gi], members, 33, 777 + gi, me, members[0])
            checked += 1
            if not torch.equal(got, _reference("all_reduce", members, 33, 777 + gi, me, members[0])):
                failures.append(f"group {gi} {members} after the abort/mismatch elsewhere: wrong values")
    finally:
        dist.barrier()
        for g in groups:
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)
    dist.barrier()
    return {"checked": checked, "failures": failures, "elapsed": time.monotonic() - t0,
            "maps": sorted(set(faults.segment_maps()) - set(maps_before)),
            "left": faults.segments_in(os.environ["FLAGOS_SHM_DIR"])}


def test_many_overlapping_groups(worlds):
    """32 overlapping groups on 4 ranks (2 x 2 DP x TP grid created 6 times + 8 other
    subsets) in a shuffled interleaving, async ops from two threads on different groups,
    and an abort and a mismatch confined to their own groups: all values right; every
    segment is gone after destroy_process_group."""
    world = worlds(4)
    try:
        results = world.run(rank_many_groups, 5, timeout=120)
    finally:
        world.check_health()
    for rank, res in enumerate(results):
        print(f"rank {rank}: {res['checked']} checks in {res['elapsed']:.2f} s")
        assert res["failures"] == [] and res["checked"] > 100, (rank, res)
        assert res["maps"] == [] and res["left"] == [], (rank, res)


# ==== 8. the soak run, briefly ============================================================================

def test_soak_runs_briefly(tmp_path):
    """``tests/soak.py`` (run for minutes by hand or nightly) works: a 10 s run with 3
    workers, kills in most rounds and at least one kill whatever the machine's speed, ends
    with operations and kills done, and no wrong result, unexpected error, hang, leaked
    segment or leftover process. (The time used to start before the workers were ready: on
    a loaded machine their start took the whole 10 s, and no round killed anything.)"""
    import json
    import subprocess
    import sys

    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "soak.py"), "--seconds", "10",
                           "--nproc", "3", "--kill-rate", "0.7", "--min-kills", "1", "--seed", "11",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stats = json.loads(out.read_text())["stats"]
    assert stats["operations"] > 0 and stats["kills"] > 0, stats
    for key in ("wrong_results", "unexpected_errors", "hung_workers", "crashes", "segments_leaked",
                "dev_shm_entries_leaked", "leftover_processes"):
        assert stats[key] == 0, (key, stats)
