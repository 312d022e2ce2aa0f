"""Every ``FLAGOS_SHM_*`` setting the backend reads, in one place.

Each function reads the environment when it is called (group creation or import), so a
test or a launcher can set a variable before it creates a group. The core (``_core``)
still reads ``FLAGOS_SHM_CMA``, ``FLAGOS_SHM_CMA_MIN_BYTES``, ``FLAGOS_SHM_PROGRESS_BATCH`` and
``FLAGOS_SHM_STREAM`` (plain or streaming stores into the slots, ``rust/stream.rs``) itself
(see the README).

Variables:
    FLAGOS_SHM_DIR: directory of the shared-memory segments (default ``/dev/shm``).
    FLAGOS_SHM_SLOT_BYTES: bytes per chunk slot (default 1 MiB, or 256 KiB in a small
        ``/dev/shm``: see :func:`segment_config`).
    FLAGOS_SHM_ASYNC: ``0`` runs ``async_op=True`` collectives inline too.
    FLAGOS_SHM_FLIGHT_RECORDER: ``1`` lets torch's generic flight-recorder hook (torch >=
        2.15) record flagos_shm's collectives (off by default: it costs several
        microseconds per call; :mod:`flagos_shm.backend.device_map`).
    FLAGOS_SHM_EXTEND_GLOO: ``0`` leaves ``backend="gloo"`` groups exactly as torch makes
        them; by default they also serve the PrivateUse1 device through
        flagos_shm (:mod:`flagos_shm.backend.device_map`).
    FLAGOS_SHM_NODE_ID: the node this rank is on, replacing the detected identity (host
        name, boot id and IPC namespace): ranks with equal values share one segment, ranks
        with different values talk through Gloo (:mod:`flagos_shm.backend.hierarchy`).
        Ranks given one value must still share ``FLAGOS_SHM_DIR``, or set-up fails at once.
    FLAGOS_SHM_HIER_RS_MIN_BYTES: in a group spanning nodes of equal size, the smallest
        allreduce (bytes of the tensor) that runs as in-node reduce-scatter, Gloo among the
        ranks of equal local rank, in-node allgather (default
        :data:`DEFAULT_HIER_RS_MIN_BYTES`; ``0`` always, ``off`` never; see
        :mod:`flagos_shm.backend.hierarchy.rs`).
        Every rank must use the same value (a disagreement raises ValueError on every rank).
    FLAGOS_SHM_PLAN: ``auto`` (default: measured once per machine and cached), ``calibrate``,
        ``fallback`` or explicit thresholds: which algorithm each collective uses at which
        size (:mod:`flagos_shm.backend.plan`). Every rank must set the same value.
    FLAGOS_SHM_CMA_MIN_BYTES: read by the core; checked here (:func:`cma_min_bytes`) so that
        a value the core cannot parse raises instead of being ignored.
"""

from __future__ import annotations

import os

from . import _core

ENV_DIR = "FLAGOS_SHM_DIR"
ENV_SLOT_BYTES = "FLAGOS_SHM_SLOT_BYTES"
ENV_ASYNC = "FLAGOS_SHM_ASYNC"
ENV_EXTEND_GLOO = "FLAGOS_SHM_EXTEND_GLOO"
ENV_FLIGHT_RECORDER = "FLAGOS_SHM_FLIGHT_RECORDER"
ENV_NODE_ID = "FLAGOS_SHM_NODE_ID"
ENV_HIER_RS_MIN_BYTES = "FLAGOS_SHM_HIER_RS_MIN_BYTES"
#: Default of FLAGOS_SHM_HIER_RS_MIN_BYTES (4 MiB): from the simulated 2 x 2 benchmark in
#: docs/multinode.md, where the reduce-scatter path loses up to 1 MiB, ties at 4 MiB and wins
#: at 16 MiB (a pessimistic setting for it: its parallel Gloo steps share 2 CPUs there).
DEFAULT_HIER_RS_MIN_BYTES = 4 << 20
ENV_PLAN = "FLAGOS_SHM_PLAN"
ENV_CMA_MIN_BYTES = "FLAGOS_SHM_CMA_MIN_BYTES"
DEFAULT_DIR = "/dev/shm"
#: Settings older versions read and this one does not, with what replaced them.
RETIRED = {
    "FLAGOS_SHM_ROUTE": "every torch (2.10 to 2.15) now uses the one per-device c10d adapter",
}

#: The words that turn a flag off; the core reads FLAGOS_SHM_CMA, FLAGOS_SHM_PROGRESS_BATCH and
#: FLAGOS_SHM_STREAM with the same ones (``rust/env.rs``).
_OFF = ("0", "false", "no", "off")


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    return default if not raw else raw not in _OFF


def async_enabled() -> bool:
    """``FLAGOS_SHM_ASYNC`` (default on): whether ``async_op=True`` calls run on the
    group's progress thread (off: inline, for debugging and measurements)."""
    return _flag(ENV_ASYNC, True)


def extend_gloo() -> bool:
    """``FLAGOS_SHM_EXTEND_GLOO`` (default on): whether ``backend="gloo"`` groups also
    serve the PrivateUse1 device type through flagos_shm."""
    return _flag(ENV_EXTEND_GLOO, True)


def flight_recorder() -> bool:
    """``FLAGOS_SHM_FLIGHT_RECORDER`` (default off): whether torch's generic flight-recorder
    hook may record flagos_shm's collectives."""
    return _flag(ENV_FLIGHT_RECORDER, False)


def node_id() -> str:
    """``FLAGOS_SHM_NODE_ID``: this rank's node, or ``""`` (unset: detected at set-up)."""
    return os.environ.get(ENV_NODE_ID, "").strip()


def hier_rs_min_bytes():
    """``FLAGOS_SHM_HIER_RS_MIN_BYTES``: bytes (an int >= 0), or None (``off``).

    Raises:
        ValueError: neither a non-negative integer nor ``off``.
    """
    raw = os.environ.get(ENV_HIER_RS_MIN_BYTES, "").strip().lower()
    if not raw:
        return DEFAULT_HIER_RS_MIN_BYTES
    if raw in ("off", "never", "false", "no"):  # "0" is a size here: always
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{ENV_HIER_RS_MIN_BYTES}={raw!r}: expected a number of bytes >= 0 or 'off' "
                         f"(default {DEFAULT_HIER_RS_MIN_BYTES})")
    return value


def cma_min_bytes() -> str:
    """``FLAGOS_SHM_CMA_MIN_BYTES`` as set (stripped; ``""`` when unset). The core reads the
    number itself and ignores one it cannot parse as a 64-bit count (``64K``, ``-1``), which
    would silently drop the plan's thresholds for its defaults, so it is checked here.

    Raises:
        ValueError: set to anything but an integer number of bytes in [0, 2**64).
    """
    raw = os.environ.get(ENV_CMA_MIN_BYTES, "").strip()
    if raw and not (raw.isascii() and raw.isdigit() and int(raw) < 1 << 64):
        raise ValueError(f"{ENV_CMA_MIN_BYTES}={raw!r}: expected a non-negative integer number of bytes "
                         f"(unset: the plan's single-copy thresholds)")
    return raw


def retired() -> dict:
    """The retired settings (:data:`RETIRED`) that are set in the environment, with why
    they are no longer read."""
    return {name: why for name, why in RETIRED.items() if os.environ.get(name, "").strip()}


def segment_config(world_size: int = 1) -> tuple[str, int]:
    """Read the segment directory and slot size from the environment.

    ``FLAGOS_SHM_DIR`` (default ``/dev/shm``): an existing directory, ideally a tmpfs.
    ``FLAGOS_SHM_SLOT_BYTES``: the per-rank chunk-slot size in bytes, a positive integer
    within the core's bounds (a multiple of 4096 up to 1 GiB in this version; each rank owns
    2 slots of the segment). Unset: ``_core.default_slot_bytes(directory, world_size)``,
    i.e. ``_core.DEFAULT_SLOT_BYTES`` (1 MiB) where the directory's file system is large
    enough (the group's segment at most 1/32 of its size), else ``_core.SMALL_SLOT_BYTES``
    (256 KiB; e.g. a container's 64 MiB ``/dev/shm``).

    Args:
        world_size: ranks of the segment to create (the default slot size depends on it).

    Returns:
        (directory, slot size in bytes).

    Raises:
        ValueError: a variable is set to an unusable value.
    """
    directory = os.environ.get(ENV_DIR, DEFAULT_DIR)
    if not directory or not os.path.isdir(directory):
        raise ValueError(f"{ENV_DIR}={directory!r}: expected an existing directory (default {DEFAULT_DIR})")
    raw = os.environ.get(ENV_SLOT_BYTES)
    if raw is None or raw.strip() == "":
        return directory, int(_core.default_slot_bytes(directory, world_size))
    try:
        slot_bytes = int(raw.strip())
    except ValueError:
        slot_bytes = 0
    if slot_bytes <= 0:
        raise ValueError(f"{ENV_SLOT_BYTES}={raw!r}: expected a positive integer number of bytes "
                         f"(default {_core.DEFAULT_SLOT_BYTES})")
    try:
        _core.segment_bytes(1, slot_bytes)  # the core's own bounds and alignment rules
    except ValueError as exc:
        raise ValueError(f"{ENV_SLOT_BYTES}={raw!r}: {exc}") from None
    return directory, slot_bytes
