"""Leak checks of the suite (used by ``conftest.py`` and ``test_harness.py``): rank
processes still alive and segment files left behind."""

from __future__ import annotations

import errno
import fcntl
import glob
import os

from .harness import World

#: The names of the core's segment files (``_core.SEGMENT_PREFIX`` followed by ``*``).
SEGMENT_GLOB = "flagos_shm-*"


def segments(directory: str) -> set:
    """The paths of the segment files in ``directory`` (regular files only: a test's private
    directory such as test_smoke.py's ``flagos_shm-smoke-*`` is not one)."""
    return {path for path in glob.glob(os.path.join(directory, SEGMENT_GLOB)) if os.path.isfile(path)}


def creator_alive(path: str) -> bool:
    """Whether the process that created segment ``path`` is alive: it holds an exclusive
    ``flock`` on the file until it unlinks it (``rust/segment.rs``, "Liveness of a
    creator"), which the kernel drops when it exits. False if the file is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # closing drops the lock if we took it
    return False


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def check_world_closed(world: World) -> list:
    """Close ``world`` (if needed) and return a list of problems: live processes, segment
    files left in its directory."""
    world.close()
    # Asked of the Popen objects, not of the pids: once reaped, a pid may already name
    # another process (pid_max is 32768 on many machines, and a test run starts thousands).
    problems = [f"rank process {proc.pid} still alive" for proc in world.procs if proc.poll() is None]
    left = world.remove_files()
    problems += [f"segment file left behind: {os.path.join(world.shm_dir, name)}" for name in left]
    return problems
