"""Dead and stopped peers (issue 5): a rank that is SIGKILLed or SIGSTOPped before, while its
peers wait in, or in the middle of a multi-step collective.

The tests run in the session's rank pools (``conftest.worlds``). A rank that must die or
stop is a *victim* forked by pool rank 0 (:func:`support.faults.fork_rank`): it joins a
flagos_shm process group built directly on a ``FileStore`` (:func:`support.faults.shm_group`)
together with the pool's ranks, then kills or stops itself at a chosen point (before a
collective, while its peers wait for it, or in the middle of a multi-step collective: a
16 MiB message through 4 KiB slots takes thousands of steps). Pool rank 0 reaps it, so the
pool itself survives and no process is left behind even when a test fails. Groups use a
timeout of :data:`support.faults.TIMEOUT_S` seconds.

Each test asserts on values: the exception type and what its message names (collective,
group, missing ranks), the time it took (from the kill, written by the victim with the
machine-wide monotonic clock), output values, and what the segment directory and each
process's mappings hold afterwards. (The other failure tests that were ``test_failures.py``:
``test_release_waiting.py``, ``test_mismatched_calls.py``, ``test_shm_budget.py``,
``test_no_leaks.py``, ``test_many_groups.py``, ``test_soak.py``.)
"""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

from support import faults
from support.faults import (TIMEOUT_S, error_info, fork_rank, prepare, read_json, reap, reported_step, shm_group,
                            signal_self, steps_of, timed_outcome, write_json)
from flagos_shm.backend import shm_part

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("flagos_only")]


# ==== 1. dead or stopped peers ===================================================================

def _signal_when_done_up_to(out: torch.Tensor, i: int, target: float, sig: str, out_dir: str, grank: int) -> None:
    """Watch this rank's output while the collective (running in the main thread, GIL
    released) fills it chunk by chunk; signal ourselves once element ``i`` holds its
    result ``target``."""
    flat = out.reshape(-1)
    deadline = time.monotonic() + 30
    while flat[i].item() != target and time.monotonic() < deadline:
        time.sleep(0.0002)
    signal_self(sig, out_dir, grank)


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
                signal_self(case["sig"], out_dir, grank)
            elif last and case["when"] == "waiting":
                time.sleep(0.3)
                signal_self(case["sig"], out_dir, grank)
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
        res["later"], res["later_s"] = timed_outcome(lambda: pg.barrier().wait())
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


#: Small chunk slot for multi-step collectives, bytes.
SMALL_SLOT = 4096
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
