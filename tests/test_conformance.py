"""A representative subset of PyTorch's own conformance suite (``distributed_test``) on
flagos_shm, world size 2: every collective family, point-to-point, sparse allreduce,
monitored_barrier, subgroups, object collectives and DDP.

The whole CPU selection (both backends, world sizes 2 and 3, both c10d routes) is
``tests/conformance/run_all.sh``; its counts are in ``docs/conformance.md``. The subset runs
in a child process (``tests/conformance/run.py``: each test's ranks are killed after
``PER_TEST_S``, the child itself after ``TOTAL_S``), and each listed test must pass, not
skip: a gate that stops applying to flagos_shm shows up here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
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
    cmd = [sys.executable, os.path.join(HERE, "conformance", "run.py"), "--backend", "flagos_shm",
           "--world-size", "2", "--timeout", str(PER_TEST_S), "--out", str(out), *_selection()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TOTAL_S, start_new_session=True)
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
