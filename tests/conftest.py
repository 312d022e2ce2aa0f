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
from collections import OrderedDict

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

from support.flagos import EMU_ENV  # noqa: E402
from support.harness import World  # noqa: E402
from support.leaks import check_world_closed, creator_alive, segments  # noqa: E402
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


#: The most rank processes the session's pools keep alive at once. An idle rank holds about
#: 300 MiB of memory of its own (torch imported: ``Private_Dirty`` in smaps_rollup); a whole
#: run asks for 13 pools (33 ranks), which, all kept until the end, held 10 GiB and more
#: besides the spawned ranks and whatever else the machine runs. Past this many, the least
#: recently used pool is closed first (a later test that asks for it starts it again, ~2 s).
MAX_POOL_RANKS = 16

#: The session's pools by (world size, environment), least recently used first.
_POOLS: "OrderedDict[tuple, World]" = OrderedDict()


@pytest.fixture(scope="session")
def worlds(backend):
    """``worlds(world_size, **env)`` -> the session's :class:`World` for that size and
    environment (created lazily, replaced if a failure killed it, closed when more than
    :data:`MAX_POOL_RANKS` ranks would be alive). At the end of the session every pool is
    closed, and the session fails if a rank process survived or a segment file is left in
    a pool's segment directory."""
    problems: list = []

    def get(world_size: int, **env) -> World:
        key = (world_size, tuple(sorted((k, str(v)) for k, v in env.items())))  # as the ranks see it
        world = _POOLS.pop(key, None)
        if world is not None and not world.alive:  # killed by a timeout/failure: check its leftovers now
            problems.extend(check_world_closed(world))
            world = None
        if world is None:
            while _POOLS and sum(w.world_size for w in _POOLS.values()) + world_size > MAX_POOL_RANKS:
                _, evicted = _POOLS.popitem(last=False)
                problems.extend(check_world_closed(evicted))
            world = World(world_size, backend, env=env)
        _POOLS[key] = world
        return world

    get.backend = backend
    yield get
    while _POOLS:
        problems.extend(check_world_closed(_POOLS.popitem(last=False)[1]))
    assert not problems, "leaks after the test session:\n" + "\n".join(problems)


@pytest.fixture(autouse=True)
def pool_ranks_alive():
    """A pool rank that died during a test, or while the pool sat idle in it, fails that
    test with the rank's exit status (or the signal that killed it), the machine's memory
    and every rank's log; the pool is killed, and the next test that asks for it gets a
    fresh one instead of a broken pipe."""
    yield
    for key, world in list(_POOLS.items()):
        if world.alive and world.dead_ranks():
            report = world.death_report()
            world.close(graceful=False)
            pytest.fail(f"a rank of the pool {key} died during this test: {report}", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def no_new_segments_in_dev_shm():
    """No test may leave a ``flagos_shm-*`` entry in /dev/shm (set up first, so its check
    runs after every pool was closed). Entries whose creator is alive (it holds the file's
    creator lock) are another job's: the suite may share the machine with other runs."""
    before = segments("/dev/shm")
    yield
    new = segments("/dev/shm") - before
    if new:  # another job on the machine may be attaching right now: look again
        time.sleep(2.0)
        new &= segments("/dev/shm")
    # Every process of this session is gone by now: a file whose creator lock is still held
    # belongs to another job on the machine (another test run, a benchmark), not to us.
    new = {path for path in new if not creator_alive(path)}
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
