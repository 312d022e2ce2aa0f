"""Run a selection of the conformance suite for one configuration; one JSON line per test.

    python tests/conformance/run.py --backend flagos_shm --world-size 2 --out results.jsonl \
        [--timeout 120] [--match REGEX] [TEST_NAME ...]

The configuration (backend, world size) is fixed per process because the suite reads it when it is imported. Each test
runs in ``--world-size`` spawned ranks, killed after ``--timeout`` seconds. Segments go to a
private directory under /dev/shm (``FLAGOS_SHM_DIR``); what a killed rank leaves there is
removed after its test and reported as ``leaked`` in that test's line. Each line:
``{"test", "outcome" (pass/fail/skip), "seconds", "reason", "leaked"}``.
Exit status 0 unless a test failed.

The runner removes the two directories it makes (segments, the suite's ``TEMP_DIR``) when
it ends, also when stopped by SIGTERM or SIGHUP (``timeout``, ``kill``, a closed terminal):
they end the run as Ctrl-C does. Against SIGKILL only the caller can help: it passes its
own directories (``--seg-dir``, ``--temp-dir``), which the runner then leaves to it, and
removes them whatever happened (``tests/test_conformance.py``). The first line printed
names the directories.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="flagos_shm")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--timeout", type=int, default=120, help="seconds per test before its ranks are killed")
    p.add_argument("--match", default="", help="run only tests whose name matches this regular expression")
    p.add_argument("--start", choices=("forkserver", "spawn"), default="forkserver",
                   help="how ranks start: forked from a preloaded server (default) or spawned as upstream does")
    p.add_argument("--out", required=True, help="JSON-lines file (appended)")
    p.add_argument("--seg-dir", help="directory for the segments (FLAGOS_SHM_DIR), made and removed by the "
                                     "caller (default: a fresh one under /dev/shm, removed at the end)")
    p.add_argument("--temp-dir", help="the suite's TEMP_DIR, made and removed by the caller (default: a fresh "
                                      "one, removed at the end)")
    p.add_argument("tests", nargs="*", help="test names (default: all)")
    return p.parse_args(argv)


class _Recorder(unittest.TestResult):
    """Writes each test's outcome as it finishes (a killed run keeps what it had)."""

    def __init__(self, out, seg_dir):
        super().__init__()
        self.out, self.seg_dir, self.failed = out, seg_dir, 0
        self._start = 0.0

    def startTest(self, test):
        super().startTest(test)
        self._start = time.monotonic()

    def _write(self, test, outcome, reason=""):
        left = sorted(os.listdir(self.seg_dir))
        for name in left:
            path = os.path.join(self.seg_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        line = {"test": test.id().split(".")[-1], "outcome": outcome,
                "seconds": round(time.monotonic() - self._start, 1), "reason": reason[-4000:], "leaked": left}
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()
        print(f"{outcome:4} {line['seconds']:6.1f}s {line['test']}", flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._write(test, "pass")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._write(test, "skip", str(reason))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._write(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self.failed += 1
        self._write(test, "fail", "unexpected success")

    def _fail(self, test, err):
        self.failed += 1
        self._write(test, "fail", "".join(traceback.format_exception(*err)))

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._fail(test, err)

    def addError(self, test, err):
        super().addError(test, err)
        self._fail(test, err)


def _interrupt(signum, frame):
    """SIGTERM and SIGHUP end the run as Ctrl-C does (``KeyboardInterrupt``, which unittest
    passes on where it records any other exception as the test's error), so that ``main``'s
    ``finally`` removes the directories."""
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def main(argv=None) -> int:
    args = _parse(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    made = []  # the directories this run makes; it removes them when it ends

    def fresh(given, **where):
        if given:
            return given
        made.append(tempfile.mkdtemp(prefix="flagos_conf-", **where))
        return made[-1]

    try:
        seg_dir, temp_dir = fresh(args.seg_dir, dir="/dev/shm"), fresh(args.temp_dir)
        print(f"conformance: segments in {seg_dir}, TEMP_DIR {temp_dir}", flush=True)
        os.environ.update(BACKEND=args.backend, WORLD_SIZE=str(args.world_size), TEMP_DIR=temp_dir,
                          FLAGOS_SHM_DIR=seg_dir, DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(args.timeout))
        sys.path.insert(0, os.path.dirname(HERE))  # tests/: spawned ranks import conformance.suite
        from conformance import suite

        # The suite raises two of its tests' limits above any per-test budget; cap them.
        from torch.testing._internal import common_distributed
        for name in list(common_distributed.TIMEOUT_OVERRIDE):
            common_distributed.TIMEOUT_OVERRIDE[name] = min(common_distributed.TIMEOUT_OVERRIDE[name],
                                                            args.timeout)
        cls = suite.TestDistBackendWithForkserver if args.start == "forkserver" else suite.TestDistBackendWithSpawn
        names = args.tests or sorted(n for n in dir(cls) if n.startswith("test"))
        if args.match:
            names = [n for n in names if re.search(args.match, n)]
        tests = unittest.TestSuite(cls(n) for n in names)
        with open(args.out, "a", encoding="utf-8") as out:
            result = _Recorder(out, seg_dir)
            tests.run(result)
        return 1 if result.failed else 0
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
