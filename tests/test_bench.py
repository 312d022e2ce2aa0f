"""The benchmark (``python -m flagos_shm.bench``): its rules, its report and one real run.

The run is a child process (the benchmark's own launcher and 2 rank processes) on tiny sizes
with 3 timed iterations, about 10 s. Its JSON is checked against values recomputed here:
S per op and dtype, algbw = S / median, busbw = algbw x the nccl-tests factor, the ratio
column of the printed table. MPI is requested too: when mpi4py and mpirun are missing the
run must say why it skipped MPI; when they are present, MPI results must be there. The PNG
is checked when matplotlib is importable. Segments go to a private directory, checked empty
afterwards.
"""

import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from flagos_shm import bench
from flagos_shm.bench.common import DTYPES, busbw_factor, case_numel, iterations, summarize

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
HAS_MPI = importlib.util.find_spec("mpi4py") is not None and bool(shutil.which("mpirun") or shutil.which("mpiexec"))
OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall")
SIZES = (4, 1000, 4096)  # 1000 B: not a multiple of n x 4 bytes, so S is rounded
DT = ("float32", "bfloat16")
N = 2


# --------------------------------------------------------------------------- pure rules

@pytest.mark.parametrize("op,requested,n,esize,want", [
    ("allreduce", 4, 2, 4, (1, 4)),
    ("allreduce", 3, 2, 4, (1, 4)),          # at least one element
    ("allreduce", 1000, 4, 2, (500, 1000)),
    ("broadcast", 10, 3, 8, (1, 8)),
    ("allgather", 4, 2, 4, (1, 8)),          # one element per rank: S = n x 4
    ("allgather", 1000, 2, 4, (125, 1000)),
    ("reduce_scatter", 1000, 3, 4, (83, 996)),
    ("alltoall", 4096, 4, 2, (512, 4096)),
])
def test_case_numel(op, requested, n, esize, want):
    assert case_numel(op, requested, n, esize) == want


def test_best_of_rounds():
    """Each (backend, op, dtype, S) keeps its lowest median, its round and every round's
    median; baselines (no backend) are keyed by size alone."""
    from flagos_shm.bench.rounds import best_of

    def row(backend, size, median, tag):
        return {"backend": backend, "op": "allreduce", "dtype": "float32", "size_bytes": size,
                "time_us_median": median, "tag": tag}
    rounds = [[row("a", 4, 5.0, "a4r0"), row("b", 4, 3.0, "b4r0"), row("a", 8, 9.0, "a8r0")],
              [row("a", 4, 4.0, "a4r1"), row("b", 4, 7.0, "b4r1")],
              [row("a", 4, 4.5, "a4r2"), row("a", 8, 1.0, "a8r2")]]
    got = {(r["backend"], r["size_bytes"]): r for r in best_of(rounds)}
    assert {k: (r["tag"], r["round"], r["round_medians_us"]) for k, r in got.items()} == {
        ("a", 4): ("a4r1", 1, [5.0, 4.0, 4.5]), ("b", 4): ("b4r0", 0, [3.0, 7.0]),
        ("a", 8): ("a8r2", 2, [9.0, 1.0])}
    copies = best_of([[{"size_bytes": 4, "time_us_median": 2.0}], [{"size_bytes": 4, "time_us_median": 1.0}]])
    assert copies == [{"size_bytes": 4, "time_us_median": 1.0, "round": 1, "round_medians_us": [2.0, 1.0]}]


def test_rules():
    assert [busbw_factor(op, 4) for op in OPS] == [1.5, 0.75, 0.75, 1.0, 0.75]
    assert busbw_factor("allreduce", 1) == 0.0
    assert iterations(4) == (50, 500)
    assert iterations(64 << 20) == (1, 16)
    assert iterations(1 << 40) == (1, 10)
    assert iterations(1 << 20, iters=7) == (1, 7)
    assert iterations(1 << 20, iters=30, warmup=0) == (0, 30)
    stats = summarize([5000, 1000, 3000, 2000, 4000, 6000, 7000, 8000, 9000, 10000])
    assert stats == {"time_us_median": 5.5, "time_us_min": 1.0, "time_us_p90": 9.0}
    assert bench.parse_size("64KiB") == 65536 and bench.parse_size("16M") == 16 << 20
    for bad in ("0", "1X", "-4"):
        with pytest.raises(ValueError, match="--sizes"):
            bench.parse_size(bad)
    with pytest.raises(ValueError, match="op"):
        case_numel("gather", 4, 2, 4)


@pytest.mark.parametrize("argv,flag", [
    (["--sizes", "0"], "--sizes"), (["--ops", "allreduce,scan"], "--ops"),
    (["--dtypes", "float8"], "--dtypes"), (["--backends", "nccl"], "--backends"),
    (["--iters", "0"], "--iters"), (["--nproc", "0"], "--nproc"), (["--rounds", "0"], "--rounds"),
    (["--nodes", "3", "--nproc", "2"], "--nodes"), (["--nodes", "0"], "--nodes"),
    # an output that cannot be written stops the run before it starts, not after it
    (["--json", "/proc/flagos_shm_nowhere.json"], "--json"), (["--plot", "/"], "--plot"),
    (["--out-dir", "/proc/flagos_shm_nowhere"], "--out-dir"),
])
def test_bad_arguments_name_the_flag(argv, flag):
    with pytest.raises(SystemExit, match=re.escape(flag)):
        bench.main(argv)


def test_only_global_rank_0_and_the_launcher_probe_the_outputs(monkeypatch):
    """Rank 0 writes the reports; other ranks, which start at the same moment, leave the
    paths alone (two probes of one path raced: one unlinked the file under the other)."""
    argv = ["--json", "/proc/flagos_shm_nowhere.json"]
    monkeypatch.setenv("RANK", "1")
    assert bench.plan_from_args(bench.build_parser().parse_args(argv)).sizes
    for rank in ("0", None):
        if rank is None:
            monkeypatch.delenv("RANK")
        else:
            monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit, match="--json"):
            bench.plan_from_args(bench.build_parser().parse_args(argv))


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_output():
    plain = io.StringIO()
    p = bench.Progress(100.0, stream=plain)
    for i in range(100):
        p.advance(1.0, f"step {i}")
    p.close()
    lines = plain.getvalue().splitlines()
    assert 10 <= len(lines) <= 11 and lines[-1].startswith("progress: 100%"), lines
    assert "\r" not in plain.getvalue()  # readable in a log

    tty = _Tty()
    p = bench.Progress(4.0, stream=tty)
    for _ in range(4):
        p.advance(1.0, "x")
    p.close()
    out = tty.getvalue()
    assert out.count("\r") >= 4 and "100.0%" in out and "\n" not in out
    silent = io.StringIO()
    bench.Progress(1.0, enabled=False, stream=silent).advance(1.0, "x")
    assert silent.getvalue() == ""


# --------------------------------------------------------------------------- a real run

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One benchmark run at world size 2: (json document, stdout, stderr, png path)."""
    tmp = tmp_path_factory.mktemp("bench")
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    segments = tempfile.mkdtemp(prefix="flagos_shm_bench_test_", dir=base)
    json_path, png_path = tmp / "out" / "bench.json", tmp / "out" / "bench.png"
    cmd = [sys.executable, "-m", "flagos_shm.bench", "--nproc", str(N),
           "--sizes", ",".join(map(str, SIZES)), "--dtypes", ",".join(DT),
           "--backends", "flagos_shm,gloo,mpi", "--iters", "3", "--warmup", "1",
           "--timeout", "60", "--job-timeout", "150", "--out-dir", str(tmp / "out")]
    env = dict(os.environ, FLAGOS_SHM_DIR=segments, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=170)
        left = os.listdir(segments)
    finally:
        shutil.rmtree(segments, ignore_errors=True)
    assert proc.returncode == 0, f"status {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert left == [], f"segment files left behind: {left}"
    with open(json_path) as fh:
        doc = json.load(fh)
    return doc, proc.stdout, proc.stderr, png_path


@pytest.mark.timeout(200)
def test_json_schema_and_values(run):
    doc, stdout, stderr, _ = run
    assert doc["schema"] == "flagos_shm.bench/2"
    for key in ("cpu_model", "cpu_count", "torch", "flagos_shm", "python"):
        assert doc["machine"][key], key
    assert "flagos_shm.bench" in doc["command"] and "--out-dir" in doc["command"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["date_utc"])
    cfg = doc["config"]
    assert cfg["world_size"] == N and cfg["ops"] == list(OPS) and cfg["dtypes"] == list(DT)

    torch_rows = [r for r in doc["results"] if r["backend"] != "mpi"]
    keys = {(r["backend"], r["op"], r["dtype"], r["size_bytes"]) for r in torch_rows}
    want = {(b, op, dt, case_numel(op, s, N, DTYPES[dt])[1])
            for b in ("flagos_shm", "gloo") for op in OPS for dt in DT for s in SIZES}
    assert keys == want and len(torch_rows) == len(want)
    rounds = cfg["rounds"]
    assert rounds == 2  # the default: flagos_shm and Gloo, then Open MPI, twice
    for r in doc["results"] + doc["copy_baseline"] + doc["xcopy_baseline"]:
        assert len(r["round_medians_us"]) == rounds, r  # every round measured every figure
        assert r["time_us_median"] == min(r["round_medians_us"]) == r["round_medians_us"][r["round"]], r
    for r in doc["results"]:
        assert 0 < r["time_us_min"] <= r["time_us_median"] <= r["time_us_p90"], r
        assert r["iters"] == 3 and r["warmup"] == 1
        numel, size = case_numel(r["op"], r["size_bytes"], N, DTYPES[r["dtype"]])
        assert (numel, size) == (r["numel_per_rank"], r["size_bytes"])
        algbw = r["size_bytes"] / (r["time_us_median"] * 1e-6) / 1e9
        assert r["algbw_GBps"] == pytest.approx(algbw, rel=1e-9)
        factor = {"allreduce": 2 * (N - 1) / N, "broadcast": 1.0}.get(r["op"], (N - 1) / N)
        assert r["busbw_factor"] == factor
        assert r["busbw_GBps"] == pytest.approx(algbw * factor, rel=1e-9)
    ratios = {(q["backend"], q["op"], q["dtype"], q["size_bytes"]): q["time_ratio_vs_flagos_shm"]
              for q in doc["ratios"]}
    med = {(r["backend"], r["op"], r["dtype"], r["size_bytes"]): r["time_us_median"] for r in doc["results"]}
    for (b, op, dt, s), ratio in ratios.items():
        assert ratio == pytest.approx(med[(b, op, dt, s)] / med[("flagos_shm", op, dt, s)])
    assert ("gloo", "allreduce", "float32", 4) in ratios

    copy_sizes = {c["size_bytes"] for c in doc["copy_baseline"]}
    assert copy_sizes == {k[3] for k in want}
    assert all(c["time_us_median"] > 0 and c["GBps"] > 0 for c in doc["copy_baseline"])
    calls = doc["overhead"]["calls"]
    noop = ["dist.all_reduce, no-op backend"]
    assert [c["call"] for c in calls] == ["dist.all_reduce", "flagos_shm .allreduce()", "Communicator.allreduce",
                                          "dist.all_reduce(async_op=True).wait()", *noop]
    assert all(c["time_us_median"] > 0 for c in calls)
    if noop:
        assert doc["overhead"]["torch_floor_us_median"] == calls[-1]["time_us_median"]
        assert "torch's floor (dist.all_reduce on a Python backend that does nothing)" in stdout
    parts = doc["overhead"]["breakdown_us_median"]
    assert sum(parts.values()) == pytest.approx(calls[0]["time_us_median"])

    if HAS_MPI:
        assert doc["mpi"]["status"] == "ran", doc["mpi"]
        mpi = {(r["op"], r["dtype"]) for r in doc["results"] if r["backend"] == "mpi"}
        assert mpi == {(op, "float32") for op in OPS}  # bfloat16 has no MPI datatype
        assert any(s["backend"] == "mpi" and s["dtype"] == "bfloat16" for s in doc["skipped"])
        pages = "huge pages" if doc["mpi"]["hugepages"] else "4 KiB pages"
        assert {r["device"] for r in doc["results"] if r["backend"] == "mpi"} == {f"cpu (numpy, {pages})"}
    else:
        assert doc["mpi"]["status"] == "skipped" and doc["mpi"]["reason"]
        assert "note: MPI skipped: " in stdout
    assert "progress: 100%" in stderr  # not a terminal: plain progress lines


@pytest.mark.timeout(200)
def test_printed_tables(run):
    doc, stdout, _, _ = run
    for op in OPS:
        for dt in DT:
            assert re.search(rf"^{op}  {dt}  world size {N} ", stdout, re.M), (op, dt)
    assert "gloo/flagos_shm" in stdout and "single-thread copy" in stdout
    assert "Communicator.allreduce" in stdout
    # The allreduce float32 4 B row carries the ratio of the JSON medians.
    med = {(r["backend"], r["op"], r["dtype"], r["size_bytes"]): r["time_us_median"] for r in doc["results"]}
    ratio = med[("gloo", "allreduce", "float32", 4)] / med[("flagos_shm", "allreduce", "float32", 4)]
    table = stdout.split("allreduce  float32")[1].split("\n\n")[0]
    row = next(line for line in table.splitlines() if line.strip().startswith("4 B"))
    assert bench._fmt_ratio(ratio) in row.split("|")[-1 if not HAS_MPI else -2], row


@pytest.mark.timeout(200)
def test_plot_written(run):
    doc, stdout, _, png = run
    if not HAS_MATPLOTLIB:
        assert "plot: skipped: matplotlib is not installed" in stdout
        assert doc["plot"]["written"] is False
        pytest.skip("matplotlib is not installed (pip install 'flagos_shm[bench]')")
    assert doc["plot"]["written"] is True
    with open(png, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 10_000


@pytest.mark.timeout(200)
def test_cross_process_copy_and_multiples(run):
    """The limit: the cross-process copy of every S, each op's time in multiples of it and
    of the local copy (the same medians divided), and the group's plan."""
    doc, stdout, _, _ = run
    cross = {c["size_bytes"]: c["time_us_median"] for c in doc["xcopy_baseline"]}
    local = {c["size_bytes"]: c["time_us_median"] for c in doc["copy_baseline"]}
    assert set(cross) == set(local) == {r["size_bytes"] for r in doc["results"]}
    assert all(v > 0 for v in cross.values())
    by_key = {(r["backend"], r["op"], r["dtype"], r["size_bytes"]): r["time_us_median"] for r in doc["results"]}
    assert len(doc["multiples"]) == len(doc["results"])
    for m in doc["multiples"]:
        t = by_key[(m["backend"], m["op"], m["dtype"], m["size_bytes"])]
        assert m["x_cross_copy"] == pytest.approx(t / cross[m["size_bytes"]])
        assert m["x_local_copy"] == pytest.approx(t / local[m["size_bytes"]])
    assert doc["plan"]["source"] == "fallback" and doc["plan"]["plan"]["one_shot_max_bytes"] == 256 << 10
    assert "cross-process copy" in stdout and "flagos_shm plan (fallback)" in stdout


@pytest.mark.timeout(200)
def test_cross_process_copy_with_ranks_that_do_not_take_part(tmp_path):
    """At world size 3, rank 2 maps nothing but takes the same barriers (it used to hang)."""
    out = tmp_path / "b.json"
    cmd = [sys.executable, "-m", "flagos_shm.bench", "--nproc", "3", "--sizes", "4,4096", "--ops", "allreduce",
           "--backends", "flagos_shm", "--iters", "2", "--warmup", "1", "--timeout", "60", "--job-timeout", "150",
           "--no-progress", "--json", str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    with open(out) as fh:
        doc = json.load(fh)
    assert [c["size_bytes"] for c in doc["xcopy_baseline"]] == [4, 4096]


@pytest.mark.timeout(200)
def test_device_run_reports_what_staging_costs(tmp_path):
    """``--device flagos`` (the emulator): flagos_shm is measured on flagos and on CPU tensors,
    the device copies alone beside them, and the staging table's excess is staged - cpu -
    copies for each op and size; the plot and the tables name both."""
    out = tmp_path / "b.json"
    cmd = [sys.executable, "-m", "flagos_shm.bench", "--nproc", "2", "--sizes", "4,64K", "--ops",
           "allreduce,allgather", "--backends", "flagos_shm", "--device", "flagos", "--iters", "5", "--warmup", "1",
           "--rounds", "1", "--timeout", "60", "--job-timeout", "150", "--no-progress", "--json", str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", FLAGOS_SHM_EMULATE_DEVICES="4"),
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    with open(out) as fh:
        doc = json.load(fh)
    devices = {(r["backend"], r["device"]) for r in doc["results"]}
    assert devices == {("flagos_shm", "flagos"), ("flagos_shm@cpu", "cpu")}, devices
    assert "flagos_shm@cpu" in doc["config"]["backends"]
    copies = {c["size_bytes"]: c["time_us_median"] for c in doc["device_copy_baseline"]}
    assert set(copies) >= {4, 65536} and all(v > 0 for v in copies.values()), copies
    med = {(r["backend"], r["op"], r["size_bytes"]): r["time_us_median"] for r in doc["results"]}
    rows = {(r["op"], r["size_bytes"]): r for r in doc["staging"]}
    # allgather's smallest S is one element per rank: 8 B at world size 2
    assert set(rows) == {("allreduce", 4), ("allreduce", 65536), ("allgather", 8), ("allgather", 65536)}, rows
    for (op, s), r in rows.items():
        assert r["staged_us"] == med[("flagos_shm", op, s)] and r["cpu_us"] == med[("flagos_shm@cpu", op, s)]
        assert r["excess_us"] == pytest.approx(r["staged_us"] - r["cpu_us"] - copies[s])
    assert "staging: flagos_shm on flagos tensors" in proc.stdout


def _anon_huge_kib(ptr: int, nbytes: int) -> int:
    """AnonHugePages (KiB) of the mappings that overlap ``[ptr, ptr + nbytes)``, read with a
    regex (the reference for :func:`flagos_shm.bench.machine.torch_cpu_hugepages`'s parser)."""
    with open("/proc/self/smaps") as fh:
        text = fh.read()
    total = 0
    for m in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) .*?$(.*?)(?=^[0-9a-f]+-[0-9a-f]+ |\Z)", text, re.M | re.S):
        if int(m.group(1), 16) < ptr + nbytes and ptr < int(m.group(2), 16):
            total += int(re.search(r"^AnonHugePages:\s+(\d+) kB", m.group(3), re.M).group(1))
    return total


_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


@pytest.mark.skipif(not os.path.exists(_THP), reason="no transparent huge pages on this kernel")
def test_mpi_buffers_get_the_pages_torch_tensors_get():
    """The MPI comparison's numpy buffers sit on the kind of pages torch's tensors get. Under
    the kernel's ``madvise`` policy torch (without THP_MEM_ALLOC_ENABLE) gets none, and
    numpy, which advises huge pages by default, must then get none either."""
    import numpy as np
    import torch

    from flagos_shm.bench import mpi_rank
    from flagos_shm.bench.machine import HUGEPAGE_PROBE_BYTES, torch_cpu_hugepages

    with open(_THP) as fh:
        policy = re.search(r"\[(\w+)\]", fh.read()).group(1)
    probe = torch.ones(HUGEPAGE_PROBE_BYTES, dtype=torch.uint8)
    torch_huge = _anon_huge_kib(probe.data_ptr(), probe.numel()) > 0
    if policy == "never":
        assert not torch_huge
    assert torch_cpu_hugepages() == torch_huge or policy == "always"  # "always": may vary per fault
    if policy != "madvise" or os.environ.get("THP_MEM_ALLOC_ENABLE"):
        pytest.skip(f"THP policy {policy!r}: the 4 KiB case needs 'madvise' and no THP_MEM_ALLOC_ENABLE")
    assert not torch_cpu_hugepages()
    try:
        mpi_rank._match_torch_pages(False)
        arr = np.ones(8 << 20, np.uint8)
        assert _anon_huge_kib(arr.ctypes.data, arr.nbytes) == 0
    finally:
        mpi_rank._match_torch_pages(True)  # numpy's default again, for other tests
