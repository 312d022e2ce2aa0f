"""What ``dist.all_reduce`` costs before any backend does anything: torch's per-call floor,
for a native (C++) backend and for a Python one, beside flagos_shm and Gloo.

Run: ``python benches/torch_floor.py [--rounds 30] [--calls 5000]`` (one process, world
size 1, a ``FileStore``; needs a C++ compiler for the native no-op backend, which is built
once per torch into ``$FLAGOS_SHM_CACHE_DIR`` or ``~/.cache/flagos_shm``).

Four groups in one process, each ``dist.all_reduce`` of one float32:

* ``native no-op``: ``benches/noop_backend.cpp``, a C++ ``c10d::Backend`` whose
  ``allreduce`` returns at once (a null work, so ``dist.*`` does not wait): the least any
  backend can cost through ``dist.all_reduce``;
* ``python no-op``: a Python backend whose ``allreduce`` returns ``None`` through torch's own
  route for one (torch >= 2.14: a ``c10d.Backend`` subclass through torch's trampoline; older
  torch: a ``dist.ProcessGroup`` subclass);
* ``adapter no-op``: flagos_shm's C++ c10d adapter over a Python group whose ``allreduce``
  returns ``None``: the floor of flagos_shm's own route, on every torch
  (``python -m flagos_shm.bench`` prints it as "no-op backend");
* ``flagos_shm`` and ``gloo`` at world size 1 (their own work is then a few checks).

The groups take turns, ``--calls`` calls each per round, so that a change of the machine's
speed hits them alike; each prints the fastest round's mean and the median round's mean, in
microseconds per call.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "noop_backend.cpp")
MODULE = "flagos_shm_noop_backend"


def _compile_command(output: str) -> list:
    """The C++ compiler's command line for ``SOURCE``: a Python extension against this torch
    (its headers, its libstdc++ ABI, its pybind11 ABI, so that the class can derive from
    torch's ``c10d.Backend``)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    cmd = os.environ.get("CXX", "c++").split()
    cmd += ["-shared", "-fPIC", "-std=c++20", "-O2", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    for name in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
        value = getattr(torch._C, f"_PYBIND11_{name}", None)
        if value is not None:
            cmd.append(f'-DPYBIND11_{name}="{value}"')
    cmd += [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}", SOURCE]
    for p in library_paths():
        cmd += [f"-L{p}", f"-Wl,-rpath,{p}"]
    return cmd + ["-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python", "-o", output]


def build() -> str:
    """Compile ``SOURCE`` unless a build for this source, command and torch is cached;
    return the module's path. Raises RuntimeError with the compiler's output on failure."""
    key = hashlib.sha256(open(SOURCE, "rb").read())
    key.update("\0".join(_compile_command("OUT")).encode())
    key.update(f"{torch.__version__}\0{sys.version}".encode())
    root = os.environ.get("FLAGOS_SHM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flagos_shm")
    directory = os.path.join(root, "bench", key.hexdigest()[:16])
    path = os.path.join(directory, MODULE + sysconfig.get_config_var("EXT_SUFFIX"))
    if not os.path.exists(path):
        os.makedirs(directory, exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"
        print("building the native no-op backend (a minute or two, once per torch) ...", file=sys.stderr)
        proc = subprocess.run(_compile_command(partial), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        os.replace(partial, path)
    return path


def _load(path: str):
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _python_noop():
    """A Python backend whose allreduce does nothing (see the module docstring)."""
    from torch._C import _distributed_c10d as c10d

    try:  # torch >= 2.14 can construct a Python subclass of c10d.Backend
        class _Probe(c10d.Backend):
            def getBackendName(self) -> str:
                return "probe"

        _Probe(0, 1)
        base = c10d.Backend
    except TypeError:
        base = dist.ProcessGroup

    class PythonNoop(base):
        def getBackendName(self) -> str:
            return "flagos_shm_bench_python_noop"

        def allreduce(self, tensors, opts=None):
            return None

    return PythonNoop


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="rounds, each group in turn (default 30)")
    parser.add_argument("--calls", type=int, default=5000, help="calls per group per round (default 5000)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        parser.error("--rounds and --calls must be positive")

    import flagos_shm  # noqa: F401  registers flagos_shm

    from flagos_shm.backend import native as adapter
    from flagos_shm.bench.overhead import NoopGroup

    native = _load(build())
    python_noop = _python_noop()
    keep = []  # torch holds the C++ side of a Python backend only

    def make_python(opts, pg_options=None):
        keep.append(python_noop(opts.group_rank, opts.group_size))
        return keep[-1]

    dist.Backend.register_backend("flagos_shm_bench_native_noop",
                                  lambda o, pg_options=None: native.NoopBackend(o.group_rank, o.group_size),
                                  extended_api=True, devices=["cpu"])
    dist.Backend.register_backend("flagos_shm_bench_python_noop", make_python, extended_api=True, devices=["cpu"])
    def make_adapter(opts, pg_options=None):
        return adapter().ShmBackend(NoopGroup(), opts.group_rank, opts.group_size)

    dist.Backend.register_backend("flagos_shm_bench_adapter_noop", make_adapter, extended_api=True, devices=["cpu"])
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            groups = {
                "native no-op": dist.new_group([0], backend="flagos_shm_bench_native_noop"),
                "python no-op": dist.new_group([0], backend="flagos_shm_bench_python_noop"),
                "adapter no-op": dist.new_group([0], backend="flagos_shm_bench_adapter_noop"),
                "flagos_shm": dist.new_group([0], backend="flagos_shm"),
                "gloo": dist.group.WORLD,
            }
            x = torch.ones(1)
            rounds = {name: [] for name in groups}
            for group in groups.values():  # warm-up
                for _ in range(min(args.calls, 1000)):
                    dist.all_reduce(x, group=group)
            for _ in range(args.rounds):
                for name, group in groups.items():
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        dist.all_reduce(x, group=group)
                    rounds[name].append((time.perf_counter() - t0) / args.calls * 1e6)
        finally:
            dist.destroy_process_group()
    print(f"dist.all_reduce of one float32, world size 1, torch {torch.__version__}, "
          f"{args.rounds} rounds x {args.calls} calls; us per call")
    print(f"{'backend':<14} {'fastest round':>14} {'median round':>13}")
    for name, times in rounds.items():
        times.sort()
        print(f"{name:<14} {times[0]:>14.2f} {times[len(times) // 2]:>13.2f}")


if __name__ == "__main__":
    main()
