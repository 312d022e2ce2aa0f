"""Every ``FLAGOS_SHM_*`` setting flagos_shm reads, in one place.

No other module of the package reads a ``FLAGOS_SHM_*`` variable: each function here reads
its variable when it is called and returns a value, and the callers pass that value on (to
the core, to a group, to a pool). A test or a launcher can therefore set a variable at any
time before the moment the table gives. It imports nothing of flagos_shm but the core, so
every layer (the staging, the compiler cache, the emulator, the backend) may use it.

Two parsers serve every setting: :func:`parse_flag` for on/off settings (unset or empty:
the default; ``0``, ``false``, ``no``, ``off`` in any case: off; anything else: on) and
:func:`parse_bytes` for sizes (a whole number of bytes, ``262144``; in ``FLAGOS_SHM_PLAN``'s
thresholds also with a binary suffix, ``256K``, ``2M``; where a size may be switched off,
``never`` or ``off``).

========================================  =======================  ===========================================
variable                                  read (function; when)    passed to
========================================  =======================  ===========================================
FLAGOS_SHM_DIR, FLAGOS_SHM_SLOT_BYTES     :func:`segment_config`;  the segment rank 0 creates (rendezvous)
                                          group creation
FLAGOS_SHM_ASYNC                          :func:`async_enabled`;   the group (``CollectiveBase._async``)
                                          group creation
FLAGOS_SHM_PLAN                           :func:`plan_request`;    the plan's agreement (``backend.plan``)
                                          group creation
FLAGOS_SHM_CACHE_DIR                      :func:`cache_dir`; each  the plan cache, the compiled adapter and
                                          use                      emulator (``_cxx``)
FLAGOS_SHM_NODE_ID                        :func:`node_id`; group   the rendezvous (this rank's node)
                                          creation
FLAGOS_SHM_HIER_RS_MIN_BYTES              :func:`hier_rs_min_      groups spanning nodes (``hierarchy.rs``)
                                          bytes`; a group's first
                                          allreduce that may use it
FLAGOS_SHM_P2P_SLOTS,                     :func:`p2p_geometry`;    each point-to-point channel
FLAGOS_SHM_P2P_SLOT_BYTES                 when a pair first talks
FLAGOS_SHM_PINNED_POOL_BYTES              :func:`pinned_pool_      the staging pools (``staging``, the C++
                                          bytes`; first staging    adapter's)
FLAGOS_SHM_EXTEND_GLOO                    :func:`extend_gloo`;     the device map of ``"gloo"`` groups
                                          group creation           (``backend.device_map``)
FLAGOS_SHM_FLIGHT_RECORDER                :func:`flight_recorder`; torch's flight-recorder opt-out
                                          import                   (``backend.torch_patches``)
FLAGOS_SHM_EMULATE                        :func:`emulate`; import  ``flagos_shm.emulation.enable``
FLAGOS_SHM_EMULATE_DEVICES                :func:`emulate_devices`; the emulator's device count
                                          ``emulation.enable()``
FLAGOS_SHM_CMA, FLAGOS_SHM_STREAM,        :func:`single_copy`,     the core, as ``Communicator`` arguments
FLAGOS_SHM_PROGRESS_BATCH                 :func:`stream_mode`,     (:func:`core_settings`)
                                          :func:`progress_batch`;
                                          group creation
========================================  =======================  ===========================================

``FLAGOS_SHM_DIR``, ``FLAGOS_SHM_SLOT_BYTES``, ``FLAGOS_SHM_HIER_RS_MIN_BYTES``,
``FLAGOS_SHM_P2P_SLOTS``, ``FLAGOS_SHM_P2P_SLOT_BYTES`` and ``FLAGOS_SHM_PINNED_POOL_BYTES``,
used later than a group's creation or by one rank only, are also checked by every rank when
each group is set up (:func:`check_group_settings`), so that a malformed one fails there on
every rank.

The core reads no environment: its settings reach it as arguments. Development tools read their own
(the launcher's ``FLAGOS_SHM_LAUNCHER_PID``, the test suite's and the benchmarks').
What each means for a user, with its default: the README's configuration table. The
settings older versions read and this one does not are in :data:`RETIRED`; ``import
flagos_shm`` warns about any that is still set.
"""

from __future__ import annotations

import os
import re
from typing import Optional

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
DEFAULT_DIR = "/dev/shm"
ENV_CACHE_DIR = "FLAGOS_SHM_CACHE_DIR"
ENV_P2P_SLOTS = "FLAGOS_SHM_P2P_SLOTS"
ENV_P2P_SLOT_BYTES = "FLAGOS_SHM_P2P_SLOT_BYTES"
DEFAULT_P2P_SLOTS = 4
DEFAULT_P2P_SLOT_BYTES = 64 << 10
ENV_PINNED_POOL_BYTES = "FLAGOS_SHM_PINNED_POOL_BYTES"
#: Default of ``FLAGOS_SHM_PINNED_POOL_BYTES``: 256 MiB.
DEFAULT_PINNED_POOL_BYTES = 256 << 20
#: ``1`` makes ``import flagos_shm`` enable the emulated flagos device (:func:`emulate`).
ENV_EMULATE = "FLAGOS_SHM_EMULATE"
ENV_EMULATE_DEVICES = "FLAGOS_SHM_EMULATE_DEVICES"
#: Settings older versions read and this one does not, with what replaced them.
RETIRED = {
    "FLAGOS_SHM_ROUTE": "every torch (2.10 to 2.15) now uses the one per-device c10d adapter",
    "FLAGOS_SHM_CMA_MIN_BYTES": "the single-copy thresholds are the plan's: FLAGOS_SHM_PLAN=single_copy=N "
                                "sets every collective's to N bytes (add allreduce_single_copy=8N for what "
                                "FLAGOS_SHM_CMA_MIN_BYTES=N did)",
}

# ---- the parsers ---------------------------------------------------------------------------

#: The words that turn a flag off (compared stripped and lower-cased).
_OFF = ("0", "false", "no", "off")
#: The words that switch a size setting off where it can be (compared stripped and
#: lower-cased): the flags' off words but ``0``, which is a size, and ``never``.
NEVER_WORDS = ("never", "off", "false", "no", "none", "inf")
_SIZE = re.compile(r"\s*([0-9]+)\s*([KMG]?)(?:i?B)?\s*", flags=re.IGNORECASE)
_SHIFT = {"": 0, "K": 10, "M": 20, "G": 30}
#: Sizes are the core's 64-bit counts: every one is below this.
SIZE_LIMIT = 1 << 64


def parse_flag(raw: Optional[str], default: bool) -> bool:
    """An on/off setting: ``default`` when ``raw`` is None or blank, off for :data:`_OFF`
    (any case), on for anything else."""
    raw = (raw or "").strip().lower()
    return default if not raw else raw not in _OFF


def _flag(name: str, default: bool) -> bool:
    return parse_flag(os.environ.get(name), default)


def parse_bytes(text: str, what: str, *, never: bool = False, suffix: bool = False) -> Optional[int]:
    """A size in bytes: ASCII digits (blanks around them ignored), below :data:`SIZE_LIMIT`.

    Args:
        text: the setting's text.
        what: what to name in an error (a variable, or a variable and a key).
        never: a word of :data:`NEVER_WORDS` gives None.
        suffix: a binary suffix ``K``, ``M`` or ``G`` (any case, ``KiB``/``KB``/``B``
            spellings too) is allowed: ``FLAGOS_SHM_PLAN``'s thresholds.

    Raises:
        ValueError: anything else, naming ``what`` and ``text``.
    """
    if never and text.strip().lower() in NEVER_WORDS:
        return None
    m = _SIZE.fullmatch(text)
    if m and not suffix and m.group(0).strip() != m.group(1):  # a suffix where none is allowed
        m = None
    if not m:
        example = "262144, 256K, 2M" if suffix else "262144"
        raise ValueError(f"{what}={text!r}: expected bytes (e.g. {example})" + (" or 'never'" if never else ""))
    if len(m.group(1).lstrip("0")) > 20:  # more than 64 bits whatever the suffix (and int() has a digit limit)
        raise ValueError(f"{what}={text.strip()[:40]!r}...: too large for the core's 64-bit sizes")
    value = int(m.group(1)) << _SHIFT[m.group(2).upper()]
    if value >= SIZE_LIMIT:
        raise ValueError(f"{what}={text!r}: {value} bytes do not fit the core's 64-bit sizes")
    return value


def _bytes_env(name: str, default: int) -> int:
    """A size variable: ``default`` when unset or blank, else :func:`parse_bytes`."""
    raw = os.environ.get(name, "")
    return parse_bytes(raw, name) if raw.strip() else default


def parse_count(text: str, what: str) -> int:
    """A count: ASCII digits.

    Raises:
        ValueError: anything else, naming ``what`` and ``text``.
    """
    raw = text.strip()
    if not (raw.isascii() and raw.isdigit()):
        raise ValueError(f"{what}={text!r}: expected a whole number")
    return int(raw)


# ---- the settings --------------------------------------------------------------------------


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


def emulate() -> bool:
    """``FLAGOS_SHM_EMULATE`` (default off): whether ``import flagos_shm`` enables the
    emulated flagos device."""
    return _flag(ENV_EMULATE, False)


def emulate_devices() -> Optional[int]:
    """``FLAGOS_SHM_EMULATE_DEVICES``: the emulator's device count, or None when unset (the
    emulator checks the range).

    Raises:
        ValueError: not a whole number.
    """
    raw = os.environ.get(ENV_EMULATE_DEVICES, "")
    return parse_count(raw, ENV_EMULATE_DEVICES) if raw.strip() else None


def node_id() -> str:
    """``FLAGOS_SHM_NODE_ID``: this rank's node, or ``""`` (unset: detected at set-up)."""
    return os.environ.get(ENV_NODE_ID, "").strip()


def plan_request() -> str:
    """``FLAGOS_SHM_PLAN`` as set (stripped), ``"auto"`` when unset or blank; parsed by
    ``flagos_shm.backend.plan.parse`` (the plan's agreement publishes malformed text as
    such, so that every rank raises)."""
    return os.environ.get(ENV_PLAN, "").strip() or "auto"


def cache_dir() -> str:
    """``$FLAGOS_SHM_CACHE_DIR``, else ``$XDG_CACHE_HOME/flagos_shm``, else
    ``~/.cache/flagos_shm``: where the compiled C++ pieces and the measured plans are kept."""
    root = os.environ.get(ENV_CACHE_DIR)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "flagos_shm")
    return root


def hier_rs_min_bytes():
    """``FLAGOS_SHM_HIER_RS_MIN_BYTES``: bytes (an int >= 0), or None (``off``, ``never``).

    Raises:
        ValueError: neither a size nor ``off``.
    """
    raw = os.environ.get(ENV_HIER_RS_MIN_BYTES, "")
    if not raw.strip():
        return DEFAULT_HIER_RS_MIN_BYTES
    return parse_bytes(raw, ENV_HIER_RS_MIN_BYTES, never=True)  # "0" is a size here: always


def p2p_geometry() -> tuple[int, int]:
    """(slots, slot_bytes) of new point-to-point channels: ``FLAGOS_SHM_P2P_SLOTS``
    (default 4) and ``FLAGOS_SHM_P2P_SLOT_BYTES`` (default 64 KiB).

    Raises:
        ValueError: a variable is not a valid number, or the core refuses the geometry
            (naming the bad one).
    """
    raw = os.environ.get(ENV_P2P_SLOTS, "")
    slots = parse_count(raw, ENV_P2P_SLOTS) if raw.strip() else DEFAULT_P2P_SLOTS
    slot_bytes = _bytes_env(ENV_P2P_SLOT_BYTES, DEFAULT_P2P_SLOT_BYTES)
    try:
        _core.P2PChannel.segment_bytes(slots, slot_bytes)  # the core's bounds
    except ValueError as exc:  # "p2p slots: expected 1..=1024, got 0": name the variables
        raise ValueError(f"{ENV_P2P_SLOTS}={slots}, {ENV_P2P_SLOT_BYTES}={slot_bytes}: {exc}") from None
    return slots, slot_bytes


def pinned_pool_bytes() -> int:
    """``FLAGOS_SHM_PINNED_POOL_BYTES`` (default 256 MiB): the idle pinned host memory each
    staging pool keeps between calls.

    Raises:
        ValueError: not a size.
    """
    return _bytes_env(ENV_PINNED_POOL_BYTES, DEFAULT_PINNED_POOL_BYTES)


def check_group_settings(world_size: int) -> None:
    """Read now every setting a group reads later or on one rank only, so that a malformed
    one fails the group's set-up on the rank that has it (the rendezvous publishes the
    failure, and every other rank raises too, naming it) rather than a later call, with
    its peers waiting until the timeout: :func:`segment_config` (used by the ranks that
    create a segment), :func:`hier_rs_min_bytes`, :func:`p2p_geometry`,
    :func:`pinned_pool_bytes`.

    Args:
        world_size: the group's size (the default slot size depends on it).

    Raises:
        ValueError: a setting is malformed (its message names it).
    """
    segment_config(world_size)
    hier_rs_min_bytes()
    p2p_geometry()
    pinned_pool_bytes()


def retired() -> dict:
    """The retired settings (:data:`RETIRED`) that are set in the environment, with why
    they are no longer read."""
    return {name: why for name, why in RETIRED.items() if os.environ.get(name, "").strip()}


def segment_config(world_size: int = 1) -> tuple[str, int]:
    """The segment directory and slot size: ``FLAGOS_SHM_DIR``, ``FLAGOS_SHM_SLOT_BYTES``.

    ``FLAGOS_SHM_DIR`` (default ``/dev/shm``): an existing directory, ideally a tmpfs.
    ``FLAGOS_SHM_SLOT_BYTES``: the per-rank chunk-slot size, a size (:func:`parse_bytes`)
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
    slot_bytes = parse_bytes(raw, ENV_SLOT_BYTES)
    if slot_bytes <= 0:
        raise ValueError(f"{ENV_SLOT_BYTES}={raw!r}: expected a positive number of bytes "
                         f"(default {_core.DEFAULT_SLOT_BYTES})")
    try:
        _core.segment_bytes(1, slot_bytes)  # the core's own bounds and alignment rules
    except ValueError as exc:
        raise ValueError(f"{ENV_SLOT_BYTES}={raw!r}: {exc}") from None
    return directory, slot_bytes


# ---- the core's settings: read here, passed to ``_core.Communicator`` (the core reads no
# environment; ``rust/group.rs``, ``Settings``) ---------------------------------------------

ENV_CMA = "FLAGOS_SHM_CMA"
ENV_STREAM = "FLAGOS_SHM_STREAM"
ENV_PROGRESS_BATCH = "FLAGOS_SHM_PROGRESS_BATCH"
#: FLAGOS_SHM_STREAM words beyond the flags' on and off words: ``never`` is plain stores,
#: ``always`` streaming ones.
_STREAM_PLAIN = ("never",)
_STREAM_ALWAYS = ("1", "true", "yes", "on", "always")


def single_copy() -> bool:
    """``FLAGOS_SHM_CMA`` (default on): whether this rank allows single-copy transfers
    (``process_vm_readv``); off on any rank turns them off for its groups."""
    return _flag(ENV_CMA, True)


def stream_mode() -> str:
    """``FLAGOS_SHM_STREAM``: how this rank first copies into its slots (``rust/stream.rs``):
    ``"plain"`` for the off words and ``never``, ``"stream"`` for ``1``, ``true``, ``yes``,
    ``on`` and ``always`` (any case), ``"auto"`` (timed per size class) otherwise, unset
    included."""
    raw = os.environ.get(ENV_STREAM, "").strip().lower()
    if raw in _OFF or raw in _STREAM_PLAIN:
        return "plain"
    return "stream" if raw in _STREAM_ALWAYS else "auto"


def progress_batch() -> bool:
    """``FLAGOS_SHM_PROGRESS_BATCH`` (default on): whether each group's progress thread runs
    under ``SCHED_BATCH`` (its wake-ups do not preempt the thread that submitted)."""
    return _flag(ENV_PROGRESS_BATCH, True)


def core_settings() -> dict:
    """The keyword arguments of ``_core.Communicator`` that carry this rank's settings, read
    now: ``single_copy``, ``stream``, ``progress_batch``."""
    return {"single_copy": single_copy(), "stream": stream_mode(), "progress_batch": progress_batch()}
