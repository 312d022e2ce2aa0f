"""Shared fixtures: pools of rank processes (see ``support/harness.py``) and the leak checks.

``worlds(n)`` returns the session's pool of ``n`` ranks (started on first use, reused by
every later test, rebuilt if a call killed it). The backend under test is ``flagos_shm``;
``--backend gloo`` (or ``FLAGOS_SHM_TEST_BACKEND=gloo``) runs the same tests against gloo
to cross-check the references (gloo lacks some ops and dtypes; the tests skip those cases
on gloo).

At the end of the session every pool is closed (``destroy_process_group`` on each rank, then
the processes are reaped) and the session fails if a rank process is still alive or a new
``flagos_shm-*`` segment file is left in ``/dev/shm`` or in the pools' segment directories.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Groups use the core's fallback plan instead of measuring one (test_plan.py measures):
# fast, and the same algorithms on every machine. The rank processes inherit it.
os.environ.setdefault("FLAGOS_SHM_PLAN", "fallback")
# And 256 KiB chunk slots (_core.SMALL_SLOT_BYTES) instead of the default chosen per file
# system (1 MiB in a large /dev/shm): the suite's "large" sizes are multiples of the slot,
# so this keeps them small; test_collectives.py's test_collective_default_slots runs with
# the default.
os.environ.setdefault("FLAGOS_SHM_SLOT_BYTES", "262144")

from support.harness import World  # noqa: E402
from support.flagos import EMU_ENV  # noqa: E402
from support.leaks import check_world_closed, segments  # noqa: E402
from support.spawn import spawn  # noqa: E402


def pytest_sessionstart(session):
    """Build flagos_shm's c10d adapter for this torch before any rank starts (about 30 s the
    first time on 2 cores, then cached): a rank of a test would otherwise spend that inside
    the test's own time limit."""
    try:
        from flagos_shm.backend import native
    except ImportError:  # the package is not installed: the tests report that themselves
        return
    started = time.monotonic()
    native()
    if time.monotonic() - started > 1:
        print(f"\nflagos_shm: built the c10d adapter in {time.monotonic() - started:.0f} s", flush=True)


def pytest_addoption(parser):
    parser.addoption("--backend", default=os.environ.get("FLAGOS_SHM_TEST_BACKEND", "flagos_shm"),
                     help="process-group backend under test (default flagos_shm; gloo to cross-check)")


@pytest.fixture(scope="session")
def backend(request) -> str:
    name = request.config.getoption("--backend")
    if name == "flagos_shm":
        import flagos_shm  # noqa: F401  the suite requires the real backend
    return name


@pytest.fixture
def flagos_only(backend):
    """Skip the test unless the backend under test is flagos_shm (``--backend gloo`` runs
    the cross-checks only): for tests of flagos_shm's own behaviour, used as
    ``pytestmark = pytest.mark.usefixtures("flagos_only")``."""
    if backend != "flagos_shm":
        pytest.skip("behaviour of the flagos_shm backend itself")


@pytest.fixture(scope="session")
def worlds(backend):
    """``worlds(world_size, **env)`` -> the session's :class:`World` for that size and
    environment (created lazily, replaced if a failure killed it). At the end of the
    session every pool is closed, and the session fails if a rank process survived or a
    segment file is left in a pool's segment directory."""
    pools: dict = {}
    problems: list = []

    def get(world_size: int, **env) -> World:
        key = (world_size, tuple(sorted(env.items())))
        world = pools.get(key)
        if world is None or not world.alive:
            if world is not None:  # killed by a timeout/failure: check its leftovers now
                problems.extend(check_world_closed(world))
            pools[key] = world = World(world_size, backend, env=env)
        return world

    get.backend = backend
    yield get
    for world in pools.values():
        problems.extend(check_world_closed(world))
    assert not problems, "leaks after the test session:\n" + "\n".join(problems)


@pytest.fixture(scope="session", autouse=True)
def no_new_segments_in_dev_shm():
    """No test may leave a ``flagos_shm-*`` entry in /dev/shm (set up first, so its check
    runs after every pool was closed)."""
    before = segments("/dev/shm")
    yield
    new = segments("/dev/shm") - before
    if new:  # another job on the machine may be attaching right now: look again
        time.sleep(2.0)
        new &= segments("/dev/shm")
    assert not new, "new entries left in /dev/shm: " + ", ".join(sorted(new))


# ---- the emulated flagos device (test_flagos_*.py, test_emulation*.py) --------------------------------------------

@pytest.fixture(scope="module")
def emulator_built():
    """Compile (or find cached) the emulator's C++ part once, without enabling it here."""
    compiler = os.environ.get("CXX", "c++").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler {compiler!r} to build the flagos emulator")
    from flagos_shm import emulation

    path = emulation.build()
    assert os.path.isfile(path)
    return path


@pytest.fixture(scope="module")
def built(emulator_built):
    """:func:`emulator_built` under the name the ``test_emulation*.py`` files use."""
    return emulator_built


@pytest.fixture
def flagos_world(worlds, backend, emulator_built):
    """``flagos_world(n)``: the session's pool of ``n`` flagos_shm ranks with the emulator."""
    if backend != "flagos_shm":
        pytest.skip("flagos tensors need the flagos_shm backend")
    return lambda world_size: worlds(world_size, **EMU_ENV)


@pytest.fixture
def fresh(backend, emulator_built):
    """:func:`support.spawn.spawn`, for tests of fresh flagos ranks (skipped on gloo)."""
    if backend != "flagos_shm":
        pytest.skip("flagos tensors need the flagos_shm backend")
    return spawn
