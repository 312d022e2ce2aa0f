"""Soak run of flagos_shm: random collectives on random groups, with random kills and
restarts of ranks. Not part of the pytest suite (not collected: the name has no test_
prefix); run it by hand or in a nightly job::

    python tests/support/soak.py --minutes 10 --nproc 4
    python tests/support/soak.py --seconds 30 --nproc 3 --seed 7 --json soak.json

A driver keeps ``--nproc`` worker processes (each a fresh interpreter with torch and
flagos_shm imported). Every *round* it draws 1-4 groups over random subsets of the workers
(slot size 4 KiB, 64 KiB or the default, so large messages take many steps) and a
schedule of 10-40 collectives (allreduce, allgather, broadcast, barrier, reduce_scatter,
alltoall; 1 to 300 000 float32 elements; inputs are small integers, so every result is
exact). Each worker builds the groups it belongs to (``flagos_shm.backend.adapter.process_group`` on a
``PrefixStore`` per group over one ``TCPStore`` that the driver serves, as torchrun does:
torch's ``FileStore`` is not kill-safe, see docs/failure-behaviour.md), runs the schedule's
collectives of its groups in schedule order
and checks every result against the sum/concatenation it computes itself. With
probability ``--kill-rate`` the driver SIGKILLs a random member at a random moment of the
round (during set-up or during a collective) and starts a replacement worker. A group
whose member died raises ``RuntimeError`` on its survivors; they skip that group's later
collectives and go on with their other groups.

At the end (after a last round without kills, which also sweeps segment files left by a
creator killed between creating and publishing its segment) it reports:

* operations run, and operations that failed with the error a kill explains
  (``RuntimeError`` in a round with a kill, in a group the victim belonged to);
* **wrong results** (a collective that returned without error and with wrong values);
* **unexpected errors** (any error in a round without a kill or in a group without the
  victim, or of another type);
* **hung workers** (a worker that did not answer within the round's deadline);
* **leaked segments** (files left in the soak's segment directory, and new
  ``flagos_shm-*`` entries in /dev/shm) and **leftover processes** (workers alive after
  the run).

The exit status is 0 only if the last five are all zero.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait

HERE = os.path.dirname(os.path.abspath(__file__))
GROUP_TIMEOUT_S = 2.0
SLOTS = [4096, 65536, None]  # None: the default slot size
NUMELS = [1, 7, 1000, 70_001, 300_000]
KINDS = ["allreduce", "allgather", "broadcast", "barrier", "reduce_scatter", "alltoall"]
START_TIMEOUT_S = 120.0


# ==== the worker ===================================================================================

def worker_main(fd: int) -> int:
    """Serve rounds sent by the driver over the socket ``fd`` until told to stop."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the driver
    except Exception:  # noqa: BLE001
        pass
    sys.path.insert(0, os.path.dirname(HERE))  # tests/, above the support package
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks for stacks of a hung worker
    import torch

    torch.set_num_threads(1)
    import flagos_shm  # noqa: F401
    from support import faults

    conn = Connection(fd)
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return 0
        if msg[0] == "stop":
            return 0
        try:
            report = run_round(faults, torch, **msg[1])
        except BaseException as exc:  # noqa: B902  reported, never fatal
            report = {"crash": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        conn.send_bytes(pickle.dumps(("done", report)))


def run_round(faults, torch, me: int, groups: list, schedule: list, timeout_s: float, shm_dir: str) -> dict:
    """One worker's part of a round: build its groups (in the round's group order), run the
    schedule's collectives on them in order, check each result; shut the groups down."""
    built: dict = {}
    broken: dict = {}  # group index -> the first error on it
    ops, wrong, errors = 0, [], []
    for gi, g in enumerate(groups):
        if me not in g["members"]:
            continue
        try:
            store = torch.distributed.PrefixStore(g["store"]["prefix"], torch.distributed.TCPStore(
                "127.0.0.1", g["store"]["port"], is_master=False, timeout=timedelta(seconds=timeout_s)))
            built[gi] = faults.shm_group(store, g["members"].index(me), len(g["members"]), g["name"],
                                         timeout_s, slot_bytes=g["slot"], shm_dir=shm_dir)
        except Exception as exc:  # noqa: BLE001
            broken[gi] = exc
            errors.append({"group": gi, "op": None, "type": type(exc).__name__, "message": str(exc)[:300]})
    try:
        for i, (gi, kind, numel, seed, root) in enumerate(schedule):
            if gi not in built or gi in broken:
                continue
            pg = built[gi]
            ops += 1
            try:
                call, out, expected = faults.prepare(pg, kind, numel, seed, root % pg.size())
                call()
            except Exception as exc:  # noqa: BLE001
                broken[gi] = exc
                errors.append({"group": gi, "op": i, "type": type(exc).__name__, "message": str(exc)[:300]})
                continue
            if out is not None and not torch.equal(out, expected):
                wrong.append({"group": gi, "op": i, "kind": kind, "numel": numel})
    finally:
        for pg in built.values():
            pg.shutdown()
    return {"ops": ops, "wrong": wrong, "errors": errors, "maps": len(faults.segment_maps())}


# ==== the driver ===================================================================================

class Worker:
    """One worker process and its connection."""

    def __init__(self, slot: int, env: dict, log_dir: str):
        parent, child = socket.socketpair()
        self.slot = slot
        self.log = open(os.path.join(log_dir, f"worker{slot}-{time.monotonic_ns()}.log"), "wb")
        try:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(child.fileno())],
                                         env=env, stdin=subprocess.DEVNULL, stdout=self.log,
                                         stderr=subprocess.STDOUT, pass_fds=(child.fileno(),),
                                         start_new_session=True)
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        self.ready = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()
        self.log.close()


class Driver:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.tmp = tempfile.mkdtemp(prefix="flagos_shm_soak_")
        import torch.distributed as dist  # the driver serves the workers' store, as torchrun's agent does

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.shm_dir = tempfile.mkdtemp(prefix="flagos_shm_soak_", dir=base)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", FLAGOS_SHM_DIR=self.shm_dir)
        self.workers: list = []
        self.all_pids: list = []
        self.stats = {"rounds": 0, "rounds_with_kill": 0, "kills": 0, "restarts": 0, "groups": 0,
                      "operations": 0, "expected_errors": 0, "expected_errors_at_set_up": 0, "wrong_results": 0,
                      "unexpected_errors": 0,
                      "hung_workers": 0, "crashes": 0, "segments_left_after_a_round": 0,
                      "segments_leaked": 0, "dev_shm_entries_leaked": 0, "leftover_processes": 0}
        self.examples: dict = {"wrong": [], "unexpected": [], "expected": []}
        self.round_s = 1.0

    # ---- workers ----------------------------------------------------------------------------

    def start(self, slot: int) -> Worker:
        w = Worker(slot, self.env, self.tmp)
        self.all_pids.append(w.pid)
        return w

    def dump_stacks(self, w: Worker, r: int) -> str:
        """Python stacks (faulthandler, SIGUSR1) and native ones (gdb, when installed) of a
        hung worker, with its log, into a file kept after the run; returns its path."""
        path = os.path.join(tempfile.gettempdir(), f"flagos_shm_soak_hang_r{r}_w{w.slot}_{w.pid}.txt")
        with contextlib.suppress(OSError):
            os.kill(w.pid, signal.SIGUSR1)
        time.sleep(1.0)
        with open(path, "w") as out:
            if shutil.which("gdb"):
                with contextlib.suppress(Exception):
                    out.write(subprocess.run(["gdb", "-p", str(w.pid), "-batch", "-ex", "thread apply all bt"],
                                             capture_output=True, text=True, timeout=120).stdout)
            w.log.flush()
            with contextlib.suppress(OSError), open(w.log.name, errors="replace") as log:
                out.write("\n==== worker log ====\n" + log.read()[-200_000:])
        return path

    def wait_ready(self, workers: list) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for w in workers:
            if w.ready:
                continue
            if not w.conn.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"worker {w.slot} (pid {w.pid}) did not start within {START_TIMEOUT_S} s")
            try:
                tag, _ = pickle.loads(w.conn.recv_bytes())
            except (EOFError, OSError):
                # It died before saying it was ready (not a kill of ours: those come later).
                raise RuntimeError(f"worker {w.slot} (pid {w.pid}) exited while starting "
                                   f"(exit status {w.proc.poll()}; see {w.log.name})") from None
            if tag != "ready":
                raise RuntimeError(f"worker {w.slot} (pid {w.pid}) sent {tag!r} instead of 'ready'")
            w.ready = True

    # ---- one round ------------------------------------------------------------------------

    def poll_ready(self) -> list:
        """Slots whose worker is ready (a replacement joins once it has started)."""
        for w in self.workers:
            if not w.ready and w.conn.poll(0):
                tag, _ = pickle.loads(w.conn.recv_bytes())
                assert tag == "ready", tag
                w.ready = True
        return [w.slot for w in self.workers if w.ready]

    def draw_round(self, r: int, ready: list) -> tuple:
        n = self.args.nproc
        groups = []
        for gi in range(self.rng.randint(1, 4)):
            size = self.rng.randint(1, len(ready))
            members = sorted(self.rng.sample(ready, size))
            groups.append({"members": members, "slot": self.rng.choice(SLOTS), "name": f"soak-r{r}-g{gi}",
                           "store": {"port": self.store.port, "prefix": f"soak-r{r}-g{gi}"}})
        schedule = []
        for i in range(self.rng.randint(10, 40)):
            gi = self.rng.randrange(len(groups))
            schedule.append((gi, self.rng.choice(KINDS), self.rng.choice(NUMELS), r * 1000 + i,
                             self.rng.randrange(n)))
        return groups, schedule

    def run_round(self, r: int, allow_kill: bool) -> None:
        ready = self.poll_ready()
        if not ready:  # every worker is restarting
            self.wait_ready(self.workers)
            ready = self.poll_ready()
        groups, schedule = self.draw_round(r, ready)
        self.stats["rounds"] += 1
        self.stats["groups"] += len(groups)
        victim, delay = None, None
        in_groups = sorted({m for g in groups for m in g["members"]})
        if allow_kill and self.rng.random() < self.args.kill_rate:
            victim = self.rng.choice(in_groups)
            delay = self.rng.uniform(0.0, self.round_s)
            self.stats["rounds_with_kill"] += 1
        t0 = time.monotonic()
        participants = [self.workers[slot] for slot in in_groups]
        for w in participants:
            w.conn.send_bytes(pickle.dumps(("round", {"me": w.slot, "groups": groups, "schedule": schedule,
                                                      "timeout_s": GROUP_TIMEOUT_S, "shm_dir": self.shm_dir})))
        if victim is not None:
            time.sleep(delay)
            self.workers[victim].kill()
            self.stats["kills"] += 1
            self.workers[victim] = self.start(victim)  # joins later rounds once it has started
            self.stats["restarts"] += 1
        # every group may time out once (set-up and one collective), plus the work itself
        deadline = t0 + (len(groups) + 2) * (GROUP_TIMEOUT_S + 1.0) + 30.0
        pending = {w.conn: w for w in participants if w.slot != victim}
        reports = {}
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for w in pending.values():
                    self.stats["hung_workers"] += 1
                    dump = self.dump_stacks(w, r)
                    self.examples["unexpected"].append(f"round {r}: worker {w.slot} hung (stacks: {dump})")
                    w.kill()
                    self.workers[w.slot] = self.start(w.slot)
                break
            for conn in ready:
                w = pending.pop(conn)
                try:
                    tag, rep = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self.stats["crashes"] += 1
                    self.examples["unexpected"].append(f"round {r}: worker {w.slot} died")
                    w.kill()
                    self.workers[w.slot] = self.start(w.slot)
                    continue
                reports[w.slot] = rep
        self.round_s = 0.7 * self.round_s + 0.3 * (time.monotonic() - t0)
        victim_groups = {gi for gi, g in enumerate(groups) if victim in g["members"]} if victim is not None else set()
        for slot, rep in reports.items():
            if "crash" in rep:
                self.stats["crashes"] += 1
                self.examples["unexpected"].append(f"round {r}: worker {slot}: {rep['crash'][:500]}")
                continue
            self.stats["operations"] += rep["ops"]
            self.stats["wrong_results"] += len(rep["wrong"])
            self.examples["wrong"] += [f"round {r} worker {slot}: {x}" for x in rep["wrong"]]
            for e in rep["errors"]:
                expected = e["group"] in victim_groups and e["type"] in ("RuntimeError", "DistStoreError")
                if expected:
                    self.stats["expected_errors"] += 1
                    self.stats["expected_errors_at_set_up"] += e["op"] is None
                    if len(self.examples["expected"]) < 5:
                        self.examples["expected"].append(f"round {r} worker {slot}: {e['type']}: {e['message']}")
                else:
                    self.stats["unexpected_errors"] += 1
                    self.examples["unexpected"].append(f"round {r} worker {slot} (victim {victim}): {e}")
            if rep["maps"]:
                self.stats["unexpected_errors"] += 1
                self.examples["unexpected"].append(f"round {r} worker {slot}: {rep['maps']} segments still mapped")
        left = glob.glob(os.path.join(self.shm_dir, "flagos_shm-*"))
        self.stats["segments_left_after_a_round"] += len(left)

    # ---- the whole run ----------------------------------------------------------------------

    def run(self) -> dict:
        dev_shm_before = set(glob.glob("/dev/shm/flagos_shm-*"))
        started = time.monotonic()
        try:
            self.workers = [self.start(s) for s in range(self.args.nproc)]
            self.wait_ready(self.workers)
            # The time counts from when the workers are ready (starting them takes seconds on a
            # loaded machine); --min-kills rounds with a kill happen whatever the time.
            end = time.monotonic() + self.args.seconds
            r = 0
            while time.monotonic() < end or self.stats["kills"] < self.args.min_kills:
                self.run_round(r, allow_kill=True)
                r += 1
                if self.args.verbose and r % 20 == 0:
                    print(f"[{time.monotonic() - started:6.0f} s] round {r}: {self.summary_line()}", flush=True)
            self.wait_ready(self.workers)
            self.run_round(r, allow_kill=False)  # a clean round: also sweeps stale segment files
        finally:
            for w in self.workers:
                try:
                    w.conn.send_bytes(pickle.dumps(("stop",)))
                except OSError:
                    pass
            for w in self.workers:
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                w.kill()
            time.sleep(0.2)
            self.stats["leftover_processes"] = sum(1 for pid in self.all_pids if _alive(pid))
            left = glob.glob(os.path.join(self.shm_dir, "*"))
            self.stats["segments_leaked"] = len(left)
            new = set(glob.glob("/dev/shm/flagos_shm-*")) - dev_shm_before
            new = {p for p in new if not os.path.isdir(p)}  # other jobs' private directories are not ours
            self.stats["dev_shm_entries_leaked"] = len(new)
            shutil.rmtree(self.shm_dir, ignore_errors=True)
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.stats["seconds"] = round(time.monotonic() - started, 1)
        return self.stats

    def summary_line(self) -> str:
        s = self.stats
        return (f"{s['operations']} ops, {s['kills']} kills, {s['expected_errors']} expected errors, "
                f"{s['wrong_results']} wrong, {s['unexpected_errors']} unexpected, {s['hung_workers']} hung")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


FAIL_KEYS = ("wrong_results", "unexpected_errors", "hung_workers", "crashes", "segments_leaked",
             "dev_shm_entries_leaked", "leftover_processes")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=None, help="how long to run (default 10 minutes)")
    p.add_argument("--seconds", type=float, default=None, help="how long to run, in seconds (overrides --minutes)")
    p.add_argument("--nproc", type=int, default=4, help="number of worker processes (ranks), 1-8 (default 4)")
    p.add_argument("--kill-rate", type=float, default=0.5, help="probability that a round kills a rank (default 0.5)")
    p.add_argument("--min-kills", type=int, default=0,
                   help="go on past the time until this many rounds have killed a rank (default 0)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: time-based, printed)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--verbose", action="store_true", help="print progress every 20 rounds")
    args = p.parse_args(argv)
    if args.seconds is None:
        args.seconds = 60.0 * (10.0 if args.minutes is None else args.minutes)
    if not 1 <= args.nproc <= 8:
        p.error("--nproc: expected 1..8")
    if not 0.0 <= args.kill_rate <= 1.0:
        p.error("--kill-rate: expected a probability in [0, 1]")
    if args.min_kills < 0 or (args.min_kills and args.kill_rate == 0):
        p.error("--min-kills: expected >= 0, and a --kill-rate above 0 for any kill to happen")
    if args.seed is None:
        args.seed = int(time.time()) % 100_000
    print(f"soak: {args.seconds:.0f} s, {args.nproc} workers, kill rate {args.kill_rate}, seed {args.seed}", flush=True)
    driver = Driver(args)
    stats = driver.run()
    print(f"rounds {stats['rounds']} ({stats['rounds_with_kill']} with a kill), groups {stats['groups']}, "
          f"kills {stats['kills']}, restarts {stats['restarts']}, {stats['seconds']} s")
    print(f"operations run:            {stats['operations']}")
    print(f"errors raised as expected: {stats['expected_errors']} "
          f"({stats['expected_errors_at_set_up']} while setting up a group)")
    for line in driver.examples["expected"][:3]:
        print(f"    e.g. {line}")
    for key in FAIL_KEYS:
        print(f"{key.replace('_', ' ') + ':':27s}{stats[key]}")
    print(f"segment files left by a kill during set-up and swept by the next round: "
          f"{stats['segments_left_after_a_round']}")
    for line in (driver.examples["wrong"] + driver.examples["unexpected"])[:20]:
        print(f"  ! {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "stats": stats, "examples": driver.examples}, f, indent=1)
    ok = all(stats[k] == 0 for k in FAIL_KEYS)
    print("soak: OK" if ok else "soak: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--worker":
        sys.exit(worker_main(int(sys.argv[2])))
    sys.exit(main())
