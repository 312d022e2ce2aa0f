"""The stale-segment sweep decides liveness by the creator's lock on the file, which every
process sharing the file system sees alike, not by ``kill(pid, 0)`` on the pid recorded in
the header (in another PID namespace that pid may name nobody while the creator is alive).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

pytestmark = pytest.mark.timeout(120)

CREATOR = (
    "import sys\n"
    "from flagos_shm import _core\n"
    "print(_core.create_segment(sys.argv[1], 2, 4096), flush=True)\n"
    "sys.stdin.read()\n"  # stay alive (holding the segment's lock) until stdin closes
)
CREATOR_PID_OFFSET = 36  # magic 8, version 4, world_size 4, slot_bytes 8, total 8, uid 4


@pytest.fixture
def shm_dir():
    path = tempfile.mkdtemp(prefix=f"flagos_shm_sweep_{os.getpid()}_",
                            dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_sweep_keeps_a_live_creators_segment_whatever_its_recorded_pid(shm_dir):
    from flagos_shm import _core

    creator = subprocess.Popen([sys.executable, "-c", CREATOR, shm_dir], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        path = creator.stdout.readline().strip()
        assert path and os.path.exists(path), path
        # As seen from another PID namespace: the recorded pid names a process that is gone.
        with open(path, "r+b") as f:
            f.seek(CREATOR_PID_OFFSET)
            f.write(_dead_pid().to_bytes(4, sys.byteorder))
        mine = _core.create_segment(shm_dir, 2, 4096)  # sweeps the directory first
        os.remove(mine)
        assert os.path.exists(path), "the sweep removed a live creator's segment"
        # Now the creator really exits: the kernel drops its lock, the next sweep removes it.
        creator.send_signal(signal.SIGKILL)
        creator.wait(timeout=30)
        t0 = time.monotonic()
        mine = _core.create_segment(shm_dir, 2, 4096)
        sweep_s = time.monotonic() - t0
        os.remove(mine)
        assert not os.path.exists(path), "the sweep kept the segment of a creator that exited"
        print(f"segment of an exited creator removed by the next creation ({sweep_s * 1e3:.2f} ms, sweep included)")
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.wait(timeout=30)
        creator.stdout.close()
        creator.stdin.close()
