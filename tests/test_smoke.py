"""Smoke test: the "flagos_shm" backend end to end, with 2 real processes and with 1.

Each rank is a fresh ``python -c`` process (FileStore rendezvous, 60 s group timeout) that
runs all_reduce, all_gather_into_tensor and broadcast and reports its results as JSON; the
values are checked here against references computed directly. Segments go to a private
directory (``FLAGOS_SHM_DIR``) so that the check that nothing is left behind is not
disturbed by other tests running at the same time.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import flagos_shm

WORLD_SIZE = 2
TIMEOUT_S = 120
# The c10d backend torch holds for the group's CPU tensors: flagos_shm's C++ adapter, on every torch.
EXPECTED_TYPE = "ShmBackend"

WORKER = r"""
import json, sys
from datetime import timedelta
import torch, torch.distributed as dist
import flagos_shm

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
rank, world_size, store_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("flagos_shm", store=dist.FileStore(store_path, world_size), rank=rank,
                        world_size=world_size, timeout=timedelta(seconds=60))
group = dist.group.WORLD
part = flagos_shm.backend.shm_part(group)
report = {"backend": dist.get_backend(), "type": type(group._get_backend(torch.device("cpu"))).__name__,
          "path": part._comm.path}

t = torch.arange(6, dtype=torch.float32) * (rank + 1)
dist.all_reduce(t)
report["all_reduce"] = t.tolist()

out = torch.full((3 * world_size,), -1, dtype=torch.int64)
all_gather_single(out, torch.arange(3, dtype=torch.int64) + 10 * rank)
report["all_gather_into_tensor"] = out.tolist()

b = torch.arange(5, dtype=torch.float64) + 0.5 if rank == 1 else torch.zeros(5, dtype=torch.float64)
dist.broadcast(b, src=1)
report["broadcast"] = b.tolist()

dist.destroy_process_group()
print("REPORT " + json.dumps(report), flush=True)
"""


def _segment_dir():
    """A private directory on /dev/shm (the default segment location) when it exists."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return tempfile.mkdtemp(prefix="flagos_shm-smoke-", dir=base)


def _run_ranks(tmp_path, segment_dir):
    env = dict(os.environ, FLAGOS_SHM_DIR=segment_dir)
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(WORLD_SIZE), store], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(WORLD_SIZE)]
    reports = []
    try:
        for rank, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{stderr}"
            line = [x for x in stdout.splitlines() if x.startswith("REPORT ")]
            assert line, f"rank {rank} printed no report:\n{stdout}\n{stderr}"
            reports.append(json.loads(line[-1][len("REPORT "):]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return reports


def test_two_ranks_values_and_cleanup(tmp_path):
    segment_dir = _segment_dir()
    try:
        reports = _run_ranks(tmp_path, segment_dir)
        remaining = os.listdir(segment_dir)
    finally:
        for name in os.listdir(segment_dir):
            os.unlink(os.path.join(segment_dir, name))
        os.rmdir(segment_dir)

    scale = sum(range(1, WORLD_SIZE + 1))
    expected_all_reduce = torch.arange(6, dtype=torch.float32) * scale
    expected_gather = torch.cat([torch.arange(3, dtype=torch.int64) + 10 * r for r in range(WORLD_SIZE)])
    expected_broadcast = torch.arange(5, dtype=torch.float64) + 0.5
    paths = set()
    for rank, rep in enumerate(reports):
        assert rep["backend"] == "flagos_shm" and rep["type"] == EXPECTED_TYPE, rep
        assert torch.equal(torch.tensor(rep["all_reduce"], dtype=torch.float32), expected_all_reduce), (rank, rep)
        assert torch.equal(torch.tensor(rep["all_gather_into_tensor"]), expected_gather), (rank, rep)
        assert torch.equal(torch.tensor(rep["broadcast"], dtype=torch.float64), expected_broadcast), (rank, rep)
        paths.add(rep["path"])
    # One segment, created in FLAGOS_SHM_DIR, shared by both ranks, and gone afterwards.
    (path,) = paths
    assert os.path.dirname(path) == segment_dir and os.path.basename(path).startswith("flagos_shm-"), path
    assert not os.path.exists(path)
    assert remaining == []


def test_world_size_one_in_process(tmp_path, monkeypatch):
    import torch.distributed as dist


    segment_dir = str(tmp_path)
    monkeypatch.setenv("FLAGOS_SHM_DIR", segment_dir)
    dist.init_process_group("flagos_shm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__ == EXPECTED_TYPE
        assert flagos_shm.backend.shm_part(dist.group.WORLD) is not None
        t = torch.arange(4.0).reshape(2, 2).t()  # non-contiguous
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert torch.equal(t, torch.arange(4.0).reshape(2, 2).t())
        out = torch.zeros(3)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, torch.tensor([1.0, 2.0, 3.0]))
        assert torch.equal(out, torch.tensor([1.0, 2.0, 3.0]))
        with pytest.raises(TypeError, match="uint16"):
            dist.all_reduce(torch.zeros(2, dtype=torch.uint16))
    finally:
        dist.destroy_process_group()
    assert os.listdir(segment_dir) == []


LONELY_RANK = r"""
import signal
import sys
from datetime import timedelta
import torch.distributed as dist
import flagos_shm
# Python starts with SIGINT ignored when its parent ignores it (a job started in the
# background by a non-interactive shell, as some CI runners do); a terminal user's
# process has this handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
print("READY", flush=True)
dist.init_process_group("flagos_shm", store=dist.FileStore(sys.argv[1], 2), rank=0, world_size=2,
                        timeout=timedelta(seconds=120))
"""


def test_ctrl_c_interrupts_a_rank_waiting_for_its_peers_at_init(tmp_path):
    """Rank 0 of 2 waits for a peer that never comes; SIGINT must stop it promptly with
    KeyboardInterrupt (not after the 120 s timeout) and remove its segment file."""
    import signal
    import time

    segment_dir = _segment_dir()
    try:
        proc = subprocess.Popen([sys.executable, "-c", LONELY_RANK, str(tmp_path / "store")],
                                env=dict(os.environ, FLAGOS_SHM_DIR=segment_dir),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "READY"
            deadline = time.monotonic() + 60
            while not os.listdir(segment_dir):  # rank 0 has created its segment and waits
                assert time.monotonic() < deadline, "rank 0 never created its segment"
                time.sleep(0.05)
            sent = time.monotonic()
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert "KeyboardInterrupt" in err, err[-2000:]
        assert took < 10, f"took {took:.1f} s to react to SIGINT"
        assert os.listdir(segment_dir) == []
    finally:
        for name in os.listdir(segment_dir):
            os.unlink(os.path.join(segment_dir, name))
        os.rmdir(segment_dir)


def test_the_version_is_cargo_s_everywhere():
    """One version: Cargo.toml's, which the core compiles in (``_core.__version__``),
    ``flagos_shm.__version__`` re-exports and maturin writes into the installed
    distribution's metadata (pyproject.toml's ``dynamic = ["version"]``)."""
    import importlib.metadata
    import re

    from flagos_shm import _core

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "Cargo.toml")) as fh:
        cargo = re.search(r'^version = "([^"]+)"', fh.read(), flags=re.MULTILINE).group(1)
    assert flagos_shm.__version__ == _core.__version__ == cargo
    assert importlib.metadata.version("flagos_shm") == cargo
