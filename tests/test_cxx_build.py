"""Building C++ against the installed torch (flagos_shm._cxx, issue 24 "Bad input and failure"):
a missing compiler or header, a compile that fails (a torch whose C++ API changed), a compiler
killed half-way, and several processes building one piece at once each end in a clear error
or a good cached library, never a corrupt cache.

A stand-in compiler (a shell script given as ``CXX``) writes the output file the command names,
so these tests take no real compile time; what it is asked to do is logged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from flagos_shm import _cxx

SOURCE = "int flagos_shm_cxx_build_probe() { return 42; }\n"


def _fake_compiler(tmp_path, sleep_s: float = 0.0, fail: bool = False) -> str:
    """A ``CXX`` that logs each call to ``calls.log``, sleeps, then writes the ``-o`` file
    (or fails like a compiler meeting an unknown name)."""
    script = tmp_path / "fake-cxx"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$$" >> "{tmp_path}/calls.log"
        sleep {sleep_s}
        out=""
        while [ $# -gt 0 ]; do
            if [ "$1" = "-o" ]; then out="$2"; fi
            shift
        done
        if [ "{int(fail)}" = "1" ]; then
            echo "probe.cpp:1:1: error: 'c10d::Backend' has no member named 'newVirtual'" >&2
            exit 1
        fi
        printf 'library' > "$out"
        """))
    script.chmod(0o755)
    return str(script)


@pytest.fixture
def source(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAGOS_SHM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "probe.cpp"
    path.write_text(SOURCE)
    return str(path)


def _calls(tmp_path) -> int:
    log = tmp_path / "calls.log"
    return len(log.read_text().split()) if log.exists() else 0


def test_a_build_is_cached_and_reused(tmp_path, monkeypatch, source):
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path))
    first = _cxx.build(source, "probe", what="the probe", python_module=False)
    second = _cxx.build(source, "probe", what="the probe", python_module=False)
    assert first == second and open(first).read() == "library"
    assert first.startswith(str(tmp_path / "cache" / "probe"))
    assert _calls(tmp_path) == 1


def test_a_changed_source_is_built_again(tmp_path, monkeypatch, source):
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path))
    first = _cxx.build(source, "probe", what="the probe", python_module=False)
    with open(source, "a") as f:
        f.write("// changed\n")
    second = _cxx.build(source, "probe", what="the probe", python_module=False)
    assert first != second and _calls(tmp_path) == 2


def test_no_compiler_is_a_clear_error(tmp_path, monkeypatch, source):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(_cxx.BuildError, match="no C\\+\\+ compiler.*no-such-c\\+\\+.*set CXX"):
        _cxx.build(source, "probe", what="the probe", python_module=False)
    assert not any(name.endswith(".so") for _, _, files in os.walk(tmp_path / "cache") for name in files)


def test_a_cache_directory_that_cannot_be_made_is_named_with_its_setting(tmp_path, monkeypatch, source):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("FLAGOS_SHM_CACHE_DIR", str(tmp_path / "a-file" / "cache"))  # below a file
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path))
    with pytest.raises(_cxx.BuildError, match="a-file/cache.*FLAGOS_SHM_CACHE_DIR"):
        _cxx.build(source, "probe", what="the probe", python_module=False)
    assert _calls(tmp_path) == 0


def test_missing_torch_headers_are_named(tmp_path, monkeypatch, source):
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path))
    monkeypatch.setattr(_cxx, "include_paths", lambda: [str(tmp_path / "include")])
    with pytest.raises(_cxx.BuildError, match="torch/csrc/distributed/c10d/Backend.hpp.*without its headers"):
        _cxx.build(source, "probe", what="the probe", python_module=False,
                   headers=("torch/csrc/distributed/c10d/Backend.hpp",))
    assert _calls(tmp_path) == 0


def test_torchs_paths_are_those_cpp_extension_gives():
    """flagos_shm finds torch's headers and libraries without importing
    torch.utils.cpp_extension (_cxx.include_paths says why); the installed torch's
    cpp_extension gives the same directories for a CPU build."""
    import torch.utils.cpp_extension as cpp

    assert _cxx.include_paths() == [os.path.abspath(p) for p in cpp.include_paths()]
    assert _cxx.library_paths() == [os.path.abspath(p) for p in cpp.library_paths()]
    assert all(os.path.isdir(p) for p in _cxx.include_paths() + _cxx.library_paths())


# A process group made and destroyed inside a function, with the collector off: torch's Gloo
# keeps its worker threads until its group is freed. Prints the thread counts and whether
# torch.utils.cpp_extension was imported.
PINNED_FRAMES_PY = """
import gc, json, os, sys
gc.disable()
import torch, torch.distributed as dist
import flagos_shm
torch.set_num_threads(1)
torch.ones(4).add_(1)
def tasks():
    return len(os.listdir("/proc/self/task"))
def run(path):
    dist.init_process_group("gloo", init_method="file://" + path, rank=0, world_size=1)
    group = dist.new_group([0], backend="flagos_shm")
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    dist.barrier()
    dist.destroy_process_group()
before = tasks()
run(sys.argv[1])
print(json.dumps({"before": before, "after": tasks(), "cpp_extension": "torch.utils.cpp_extension" in sys.modules}))
"""


@pytest.mark.timeout(600)
def test_making_the_first_group_pins_none_of_the_callers_frames(tmp_path):
    """The first flagos_shm group of a process builds (or finds) the adapter without
    importing torch.utils.cpp_extension: on torch 2.10 that import (setuptools,
    pkg_resources) left exceptions in reference cycles that held every frame of the caller's
    stack, so a Gloo group made and destroyed in a function kept its worker threads after
    the function returned (4 threads against 1), until a full collection; at interpreter
    exit such a thread aborted the process now and then (``flagos_shm._cxx.include_paths``)."""
    script = tmp_path / "pinned.py"
    script.write_text(PINNED_FRAMES_PY)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=540, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"before": seen["before"], "after": seen["before"], "cpp_extension": False}, seen


def test_a_failed_compile_names_the_torch_and_leaves_nothing(tmp_path, monkeypatch, source):
    import torch

    monkeypatch.setenv("CXX", _fake_compiler(tmp_path, fail=True))
    with pytest.raises(_cxx.BuildError) as info:
        _cxx.build(source, "probe", what="the probe", python_module=False)
    message = str(info.value)
    assert f"torch {torch.__version__}" in message and "2.10 to 2.15" in message, message
    assert "has no member named 'newVirtual'" in message, message
    files = [name for _, _, names in os.walk(tmp_path / "cache") for name in names]
    assert not [name for name in files if name.endswith(".so") or name.endswith(".tmp")], files


BUILDER = """
import sys
from flagos_shm import _cxx
print(_cxx.build(sys.argv[1], "probe", what="the probe", python_module=False), flush=True)
"""


def _builder(source: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILDER, source], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.timeout(120)
def test_two_processes_building_at_once_compile_once(tmp_path, monkeypatch, source):
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path, sleep_s=1.0))
    procs = [_builder(source) for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1 and open(paths.pop()).read() == "library", outs
    assert _calls(tmp_path) == 1  # the second waited for the first one's build


@pytest.mark.timeout(120)
def test_a_build_killed_half_way_leaves_no_library_and_the_next_one_builds(tmp_path, monkeypatch, source):
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path, sleep_s=30.0))
    proc = _builder(source)
    deadline = time.monotonic() + 30
    while _calls(tmp_path) == 0:  # the compiler has started
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the builder and the compiler it runs
    proc.wait(timeout=30)
    libraries = [name for _, _, names in os.walk(tmp_path / "cache") for name in names if name.endswith(".so")]
    assert libraries == [], libraries  # nothing under the cached name
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path))
    path = _cxx.build(source, "probe", what="the probe", python_module=False)
    assert open(path).read() == "library"
    leftovers = [name for name in os.listdir(os.path.dirname(path)) if name.endswith(".tmp")]
    assert leftovers == [], leftovers
