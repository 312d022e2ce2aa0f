"""A representative subset of PyTorch's own conformance suite (``distributed_test``) on
flagos_shm, world size 2: every collective family, point-to-point, sparse allreduce,
monitored_barrier, subgroups, object collectives and DDP.

The whole CPU selection (both backends, world sizes 2 and 3, both c10d routes) is
``tests/conformance/run_all.sh``; its counts are in ``docs/conformance.md``. The subset runs
in a child process (``tests/conformance/run.py``: each test's ranks are killed after
``PER_TEST_S``, the child itself after ``TOTAL_S``), and each listed test must pass, not
skip: a gate that stops applying to flagos_shm shows up here. The child's directories
(segments under /dev/shm, the suite's ``TEMP_DIR``) are made here and removed here, whatever
became of the child; a timed-out child is killed with its whole session (its ranks).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "conformance", "run.py")
PER_TEST_S = 60
TOTAL_S = 280

SUBSET = [
    # set-up, groups
    "test_get_rank", "test_get_rank_size_group", "test_destroy_group",
    # collectives (the suite runs all-to-all and reduce-scatter on CUDA or MPI only)
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_coalesced_sum",
    "test_all_reduce_complex_unsupported_ops", "test_broadcast", "test_reduce_sum", "test_all_gather",
    "test_all_gather_coalesced_simple", "test_gather", "test_scatter", "test_barrier_full_group",
    "test_barrier_timeout_full_group",
    # point-to-point
    "test_send_recv_with_tag", "test_send_recv_any_source", "test_isend", "test_irecv",
    "test_batch_isend_irecv_gloo",
    # gloo-gated features
    "test_sparse_all_reduce_sum", "test_monitored_barrier_gloo", "test_monitored_barrier_gloo_rank_0_timeout",
    # objects, DDP
    "test_all_gather_object_subgroup", "test_scatter_object_list", "test_DistributedDataParallelCPU",
    "test_accumulate_gradients_no_sync",
]

pytestmark = pytest.mark.timeout(TOTAL_S + 30)


def _selection() -> list:
    return SUBSET


@pytest.fixture(scope="module")
def subset_results(tmp_path_factory, backend):
    if backend != "flagos_shm":
        pytest.skip("the conformance subset runs flagos_shm (run_all.sh runs gloo beside it)")
    pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest")
    out = tmp_path_factory.mktemp("conformance") / "results.jsonl"
    seg_dir = tempfile.mkdtemp(prefix="flagos_conf-", dir="/dev/shm")
    temp_dir = tempfile.mkdtemp(prefix="flagos_conf-")
    cmd = [sys.executable, RUNNER, "--backend", "flagos_shm", "--world-size", "2", "--timeout", str(PER_TEST_S),
           "--out", str(out), "--seg-dir", seg_dir, "--temp-dir", temp_dir, *_selection()]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=TOTAL_S)
        finally:
            if proc.poll() is None:  # timed out (or this process is being stopped)
                os.killpg(proc.pid, signal.SIGKILL)  # the runner's session: it and its ranks
                proc.communicate()
    finally:
        shutil.rmtree(seg_dir, ignore_errors=True)
        shutil.rmtree(temp_dir, ignore_errors=True)
    proc = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    results = {}
    if out.exists():
        for line in out.read_text().splitlines():
            rec = json.loads(line)
            results[rec["test"]] = rec
    return proc, results


@pytest.mark.parametrize("name", SUBSET)
def test_suite_subset(subset_results, name):
    proc, results = subset_results
    assert name in results, f"{name} did not run:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rec = results[name]
    assert rec["outcome"] == "pass", f"{name}: {rec['outcome']}\n{rec['reason']}"
    assert not rec["leaked"], f"{name} left segments behind: {rec['leaked']}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_runner_stopped_by_a_signal_removes_its_directories(tmp_path, sig):
    """``run.py`` on its own (as ``run_all.sh`` starts it, under ``timeout``) makes a segment
    directory under /dev/shm and a ``TEMP_DIR``; stopped by SIGTERM or SIGHUP while it imports
    the suite, it must remove both (a killed run once left ``/dev/shm/flagos_conf-*``)."""
    pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest")
    proc = subprocess.Popen([sys.executable, RUNNER, "--out", str(tmp_path / "out.jsonl"), "test_get_rank"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        first = proc.stdout.readline()  # printed once both directories exist
        dirs = first.removeprefix("conformance: segments in ").strip().split(", TEMP_DIR ")
        assert len(dirs) == 2 and all(os.path.isdir(d) for d in dirs), first
        proc.send_signal(sig)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    left = [d for d in dirs if os.path.exists(d)]
    for d in left:
        shutil.rmtree(d, ignore_errors=True)
    assert not left, f"run.py stopped by {sig.name} left {left}"
    assert proc.returncode != 0, "run.py stopped by a signal must not report success"
