"""Driver: ``torch.testing._internal.distributed.distributed_test`` against flagos_shm.

The torch wheel ships the suite (``DistributedTest._DistTestBase``, about 400 tests) but not
its driver, ``test/distributed/test_distributed_spawn.py``; this module is that driver. As
upstream's, it reads the suite's environment, which must be set before it is imported:

    BACKEND     the backend under test (``flagos_shm`` or ``gloo``; default ``flagos_shm``)
    WORLD_SIZE  ranks per test (default 2)
    TEMP_DIR    an existing directory for the suite's barrier files (default: a new one)

Each test spawns ``WORLD_SIZE`` processes (``_spawn_processes`` in ``setUp``); the parent
kills them after ``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT`` seconds (set it before import; the
suite's default is 300).

Opt-ins. The suite gates many tests on the backend's name, and an unknown name is skipped
by most gates. flagos_shm is opted into the gates whose feature it supports, as gloo is:

* ``DistTestCases.backend_feature``: ``"ddp"`` (DistributedDataParallel on CPU modules),
  ``"subgroup"`` (``new_group`` subgroups), ``"plugin"`` (``require_backend_is_available``
  treats a registered plugin as available) and ``"gpu"`` (backends that also take device
  tensors: flagos_shm stages them through host memory as gloo does CUDA tensors; on a
  machine without accelerators these tests skip on their device-count gates, except the
  object collectives, which then run on CPU). Not ``"cuda"``: DDP communication hooks on
  CUDA modules, which this CPU selection does not exercise.
* Gloo-only gates written as name comparisons (``BACKEND != "gloo"``, ``BACKEND == "gloo"``,
  ``@require_backend_is_available({"gloo"})``): the suite's source is loaded with these
  comparisons widened to ``BACKEND in GLOO_LIKE`` (``{"gloo", "flagos_shm"}``) before it is
  compiled (:data:`GLOO_GATES`; line numbers are unchanged, so tracebacks point at the
  installed file). They cover: barrier timeouts, ``batch_isend_irecv`` on CPU, sparse
  allreduce, the DDP tests written for gloo's CPU path, ``monitored_barrier`` and the other
  "gloo" feature tests (see ``docs/conformance.md`` for the list and the outcomes).
  A comparison that names gloo for a reason flagos_shm cannot share is excluded again by
  name in :data:`NOT_GLOO_LIKE`, with the reason.

``import flagos_shm`` registers the backend in this process and, through pickling of the
test class, in every spawned rank (they import this module).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import unittest

os.environ.setdefault("BACKEND", "flagos_shm")
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:  # imported on its own, not by run.py: this process owns it
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="flagos_conf-")
    atexit.register(shutil.rmtree, os.environ["TEMP_DIR"], True)

import torch  # noqa: E402
import flagos_shm  # noqa: E402,F401  (registers the backend, here and in every spawned rank)
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

BACKEND = os.environ["BACKEND"]
SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"

#: Backends that pass the suite's gloo-only gates (see the module docstring).
GLOO_LIKE = frozenset({"gloo", flagos_shm.BACKEND_NAME})

#: ``DistTestCases.backend_feature`` sets flagos_shm joins.
FEATURES = ("ddp", "subgroup", "plugin", "gpu")

#: (pattern, replacement) applied to the suite's source: the gloo-only name comparisons.
GLOO_GATES = (
    (r'BACKEND != "gloo"', "BACKEND not in GLOO_LIKE"),
    (r'BACKEND == "gloo"', "BACKEND in GLOO_LIKE"),
    (r'@require_backend_is_available\(\{"gloo"\}\)', "@require_backend_is_available(GLOO_LIKE)"),
)

#: Tests kept out of the gloo opt-in (they still skip on flagos_shm), with the reason.
NOT_GLOO_LIKE: dict[str, str] = {}

#: Tests skipped on flagos_shm by this driver, with the reason (kept short; each entry is
#: also listed in docs/conformance.md).
SKIPS: dict[str, str] = {}


def _opt_in() -> None:
    for feature in FEATURES:
        DistTestCases.backend_feature[feature].add(flagos_shm.BACKEND_NAME)


def _load_suite():
    """Import the suite with the gloo gates widened; returns the module (cached in
    ``sys.modules`` under its own name)."""
    if SUITE_MODULE in sys.modules:
        return sys.modules[SUITE_MODULE]
    spec = importlib.util.find_spec(SUITE_MODULE)
    with open(spec.origin, encoding="utf-8") as f:
        source = f.read()
    for pattern, replacement in GLOO_GATES:
        source, count = re.subn(pattern, replacement, source)
        if count == 0:
            print(f"conformance: gate {pattern!r} not found in {spec.origin}", file=sys.stderr)
    module = importlib.util.module_from_spec(spec)
    module.GLOO_LIKE = GLOO_LIKE if BACKEND in GLOO_LIKE else frozenset({"gloo"})
    sys.modules[SUITE_MODULE] = module
    try:
        exec(compile(source, spec.origin, "exec"), module.__dict__)
    except BaseException:
        del sys.modules[SUITE_MODULE]
        raise
    return module


_opt_in()
_suite = _load_suite()
DistributedTest = _suite.DistributedTest
TestDistBackend = _suite.TestDistBackend


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """The suite's tests, each in ``WORLD_SIZE`` freshly spawned processes."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


class TestDistBackendWithForkserver(TestDistBackendWithSpawn):
    """The same tests, with ranks forked from a server that has already imported torch, the
    suite and flagos_shm (``multiprocessing`` "forkserver" with this module preloaded).

    A spawned rank imports all of that again: about 30 s per test on a loaded 2-core machine,
    against a few seconds here. The ranks still start from a fresh, thread-free process
    (the server), not from the test runner.
    """

    def setUp(self):
        # TestDistBackend.setUp (temp directories, barrier), without the spawn.
        super(TestDistBackendWithSpawn, self).setUp()
        self._start_processes(_forkserver().Process)

    def _start_processes(self, proc) -> None:
        # As MultiProcessTestCase._start_processes, but the server's environment dates from
        # its start: each rank gets the variables setUp has just set (TEMP_DIR, INIT_METHOD).
        self.processes = []
        env = {k: os.environ[k] for k in _PER_TEST_ENV if k in os.environ}
        for rank in range(int(self.world_size)):
            parent_conn, child_conn = torch.multiprocessing.Pipe()
            process = proc(target=_forked_run, name=f"process {rank}",
                           args=(type(self), env, rank, self._current_test_name(), self.file_name, child_conn))
            process.start()
            self.pid_to_pipe[process.pid] = parent_conn
            self.processes.append(process)


#: Variables the suite sets per test in the parent (initialize_temp_directories).
_PER_TEST_ENV = ("TEMP_DIR", "INIT_METHOD")


def _forked_run(cls, env, rank, test_name, file_name, pipe):
    os.environ.update(env)
    cls._run(rank, test_name, file_name, pipe)


def _forkserver():
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    # The server does not take the parent's sys.path (Python < 3.13 ignores it), so a preload
    # that is not on PYTHONPATH fails silently and every rank imports the suite again.
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if package_parent not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([package_parent] + [p for p in paths if p])
    ctx.set_forkserver_preload([__name__])
    return ctx


def _apply_skips() -> None:
    if BACKEND != flagos_shm.BACKEND_NAME:
        return
    for name, reason in {**NOT_GLOO_LIKE, **SKIPS}.items():
        if hasattr(DistributedTest._DistTestBase, name):
            setattr(TestDistBackendWithSpawn, name,
                    unittest.skip(reason)(getattr(DistributedTest._DistTestBase, name)))


_apply_skips()
