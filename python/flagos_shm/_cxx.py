"""Building a C++ source against the installed torch on first use, cached (the c10d adapter,
the emulated device).

torch's C++ ABI is not stable between versions, so flagos_shm cannot ship these pieces
compiled: each is compiled here, once per source, torch build, compiler command and Python,
with the system C++ compiler (``$CXX``, default ``c++``) run directly on one file (no ninja,
no setuptools), and cached under ``$FLAGOS_SHM_CACHE_DIR`` (default ``$XDG_CACHE_HOME/flagos_shm``
or ``~/.cache/flagos_shm``) in a directory named after that key. As DeepSpeed builds its CPU
ops and as torch's ``cpp_extension.load`` does, but without its dependencies.

Concurrency and failure: processes building the same key (the ranks of a job) take a file lock
in that directory; one compiles into a temporary name and renames it into place, the others
wait for the lock and find the result. A compiler killed half-way leaves only its temporary
file (never the cached name), which the next build replaces. A missing compiler, missing torch
or Python headers, or a failed compile raise :class:`BuildError` naming what is missing, with
the compiler's output.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time

import torch

from . import config

__all__ = ["BuildError", "build", "cache_root"]

#: How long a compile may run before it is abandoned (seconds; 2 busy cores take about 40 s).
COMPILE_TIMEOUT_S = 900


class BuildError(RuntimeError):
    """A C++ piece of flagos_shm could not be built against the installed torch."""


def cache_root() -> str:
    """Where builds are cached: :func:`flagos_shm.config.cache_dir` (``$FLAGOS_SHM_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/flagos_shm``, else ``~/.cache/flagos_shm``), read now."""
    return config.cache_dir()


def _torch_version() -> str:
    return torch.__version__


def _torch_dir() -> str:
    """The directory of the installed torch package (``include/`` and ``lib/`` lie in it)."""
    return os.path.dirname(os.path.abspath(torch.__file__))


def include_paths() -> list:
    """The directories of torch's C++ headers for a CPU build: what
    ``torch.utils.cpp_extension.include_paths()`` returns (``tests/test_cxx_build.py``
    checks that they agree), without importing that module. Importing it imports setuptools
    (and, with older setuptools, ``pkg_resources``, whose parser leaves exceptions in
    reference cycles): done inside the first group's set-up, that garbage kept every frame
    of the caller's stack alive, with its locals (the caller's process groups, a Gloo group's
    worker threads among them), until the next full collection, often the interpreter's
    last, where such a thread aborted the process (``flagos_shm._launch.worker_teardown``)."""
    include = os.path.join(_torch_dir(), "include")
    return [include, os.path.join(include, "torch", "csrc", "api", "include")]


def library_paths() -> list:
    """The directory of torch's libraries: ``torch.utils.cpp_extension.library_paths()`` for
    a CPU build, without importing that module (:func:`include_paths`)."""
    return [os.path.join(_torch_dir(), "lib")]


def _check_headers(what: str, headers: tuple, python_module: bool) -> None:
    """Raise :class:`BuildError` naming the first header the build needs that is missing."""
    for header in headers:
        if not any(os.path.exists(os.path.join(root, header)) for root in include_paths()):
            raise BuildError(
                f"{what}: building against torch {_torch_version()} needs its C++ header {header}, which "
                f"is missing under {include_paths()[0]}: this torch was installed without its headers; "
                "install a torch wheel from PyPI (they ship include/)")
    if python_module:
        include = sysconfig.get_paths()["include"]
        if not os.path.exists(os.path.join(include, "Python.h")):
            raise BuildError(f"{what}: building needs Python's C headers (Python.h), missing in {include}; "
                             f"install them (Debian/Ubuntu: python{sys.version_info[0]}.{sys.version_info[1]}-dev)")


def _command(source: str, output: str, python_module: bool, optimize: str) -> list:
    cmd = os.environ.get("CXX", "c++").split()
    cmd += ["-shared", "-fPIC", "-std=c++20", optimize, "-w"]
    # torch's libstdc++ ABI (a mismatch fails to load); pybind11 >= 3 keys its shared
    # internals on the compiler and ABI itself, older torch exported the values to use.
    cmd.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    for name in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
        value = getattr(torch._C, f"_PYBIND11_{name}", None)
        if value is not None:
            cmd.append(f'-DPYBIND11_{name}="{value}"')
    cmd += [f"-I{p}" for p in include_paths()]
    if python_module:
        cmd.append(f"-I{sysconfig.get_paths()['include']}")
    cmd.append(source)
    for p in library_paths():
        cmd += [f"-L{p}", f"-Wl,-rpath,{p}"]
    cmd += ["-lc10", "-ltorch_cpu"]
    if python_module:
        cmd += ["-ltorch", "-ltorch_python"]
    return cmd + ["-o", output]


def build(source: str, name: str, *, what: str, python_module: bool, headers: tuple = (),
          optimize: str = "-O2", depends: tuple = ()) -> str:
    """Compile ``source`` unless a cached build matches; return the library's path.

    Args:
        source: the C++ file (one translation unit).
        name: the library's base name (for a Python module: the name in its
            ``PYBIND11_MODULE``); the cache directory is ``<cache_root()>/<name>/<key>``.
        what: names the piece in errors ("flagos_shm's c10d adapter").
        python_module: build a Python extension module (Python and torch_python linked in)
            rather than a plain library loaded with ``torch.ops.load_library``.
        headers: torch headers the source includes (paths under ``torch/include``), checked
            first so that a torch without headers gives a clear error.
        optimize: the optimisation flag.
        depends: other files the source includes (their contents are part of the cache key).

    Returns:
        the path of the shared library (``<name><EXT_SUFFIX>`` for a Python module,
        ``<name>.so`` otherwise).

    Raises:
        BuildError: no C++ compiler, missing torch or Python headers, the build directory
            cannot be created under the cache directory (the message names it and
            ``FLAGOS_SHM_CACHE_DIR``), or the compile failed (the message has the command
            and the compiler's last output, and names the torch version).
        OSError: the build directory cannot be written.
    """
    with open(source, "rb") as f:
        text = f.read()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") if python_module else ".so"
    key = hashlib.sha256(text)
    for path in depends:
        with open(path, "rb") as f:
            key.update(f.read())
    key.update("\0".join(_command("SRC", "OUT", python_module, optimize)).encode())
    git = getattr(torch.version, "git_version", "")
    key.update(f"\0{_torch_version()}\0{git}\0{sys.version}\0{int(torch._C._GLIBCXX_USE_CXX11_ABI)}".encode())
    tag = f"torch{_torch_version().replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}"
    directory = os.path.join(cache_root(), name, f"{tag}-{key.hexdigest()[:16]}")
    library = os.path.join(directory, name + suffix)
    if os.path.exists(library):
        return library
    _check_headers(what, headers, python_module)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"{what}: cannot create its build directory {directory!r} under the cache directory "
                         f"{cache_root()!r} (${config.ENV_CACHE_DIR}, else $XDG_CACHE_HOME/flagos_shm or "
                         f"~/.cache/flagos_shm): {exc}") from exc
    with open(os.path.join(directory, "build.lock"), "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # a second rank waits here for the first one's build
        if os.path.exists(library):  # built by another process meanwhile
            return library
        for stale in glob.glob(f"{library}.*.tmp"):  # left by a build that was killed
            _unlink(stale)
        partial = f"{library}.{os.getpid()}.tmp"
        cmd = _command(source, partial, python_module, optimize)
        if shutil.which(cmd[0]) is None:
            raise BuildError(f"{what}: no C++ compiler: {cmd[0]!r} is not on PATH (set CXX, or install g++); "
                             f"flagos_shm compiles this piece against torch {_torch_version()} on first use")
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            _unlink(partial)
            raise BuildError(f"{what}: running the C++ compiler failed: {exc}") from None
        if proc.returncode != 0:
            _unlink(partial)
            raise BuildError(
                f"{what}: compiling against torch {_torch_version()} failed (exit {proc.returncode}; flagos_shm "
                f"is tested with torch 2.10 to 2.15):\n{' '.join(cmd)}\n{proc.stderr[-8000:]}")
        os.replace(partial, library)  # atomic: readers see the whole library or none
        with open(os.path.join(directory, "build.log"), "w") as log:
            log.write(f"{' '.join(cmd)}\n{time.monotonic() - started:.1f} s\n{proc.stderr}")
    return library


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise
