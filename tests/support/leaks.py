"""Leak checks of the suite (used by ``conftest.py`` and ``test_harness.py``): rank
processes still alive and segment files left behind."""

from __future__ import annotations

import glob
import os

from .harness import World

#: The names of the core's segment files (``_core.SEGMENT_PREFIX`` followed by ``*``).
SEGMENT_GLOB = "flagos_shm-*"


def segments(directory: str) -> set:
    """The paths of the segment files in ``directory``."""
    return set(glob.glob(os.path.join(directory, SEGMENT_GLOB)))


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
    problems = [f"rank process {pid} still alive" for pid in world.pids if alive(pid)]
    left = world.remove_files()
    problems += [f"segment file left behind: {os.path.join(world.shm_dir, name)}" for name in left]
    return problems
