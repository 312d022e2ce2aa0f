"""The plan of a node's communicator: which algorithm each collective uses at which size,
measured on this machine (see ``rust/plan.rs`` and docs/design.md, "The plan").

When a group is created, its ranks agree on a plan through the group's store:

1. every rank publishes what it asks for: ``FLAGOS_SHM_PLAN`` (``auto`` when unset) and
   ``FLAGOS_SHM_CMA_MIN_BYTES``; ranks that ask for different things raise ValueError, on
   every rank, naming the variable and the ranks;
2. the leader of each node (on one node, rank 0) resolves the request for its node: an
   explicit plan, the core's fallback, the plan cached for this machine
   (:func:`machine_key`), or "calibrate" (no cache entry, or ``FLAGOS_SHM_PLAN=calibrate``),
   and publishes the outcome;
3. on "calibrate" every rank of the node runs :func:`calibrate` in lockstep (a fixed sequence of calls
   with forced paths, 1.7-1.9 s on a loaded 2-vCPU AMD EPYC VM, 0.72 s on a quiet
   Intel Xeon one), the per-case times are reduced with MAX across
   the node's ranks (so every rank holds the same numbers) and every rank derives the same plan
   from them (:func:`decide`); the leader writes the cache, unless the machine was busy (load
   average above the CPU count + 1): a plan measured under contention is used by that
   group but not kept;
4. a cached plan is settled after :data:`SETTLE_RUNS` calibrations: until then the first
   group created :data:`RUN_GAP_S` or more after the last calibration measures again,
   and the plan is decided from the fastest figure of each case over the runs
   (:func:`merge`), published by the leader so every rank merges the same ones. A single
   calibration can fall into one of the VM's slow phases and choose for it alone.

A group that spans nodes thus has one plan per node (each node may be another kind of
machine); the plan only chooses how the node's ranks move bytes among themselves, so
every rank's result is the same whichever plans the nodes hold.

``FLAGOS_SHM_PLAN`` values: ``auto`` (default), ``calibrate`` (measure again, start the
cache's runs afresh), ``fallback`` (the core's built-in guess, ``_core`` :data:`FALLBACK`; what the test
suite uses, for speed), or ``key=value`` pairs separated by commas with the keys of
:data:`KEYS` (short names without ``_min_bytes``/``_bytes`` allowed), values in bytes with
optional K/M/G suffix or ``never``; missing keys take the fallback's values.
``FLAGOS_SHM_CMA_MIN_BYTES`` still overrides the single-copy thresholds (allgather,
reduce-scatter, broadcast and all-to-all from it, allreduce from 8x it) and ``FLAGOS_SHM_CMA=0`` turns single-copy off.
The plan is logged at DEBUG level on logger ``flagos_shm``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import re
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from .. import _core
from . import config, options, rendezvous

_log = logging.getLogger("flagos_shm")

#: The plan's keys (``rust/plan.rs``, ``KEYS``): the one-shot allreduce limit, then per
#: collective that has a single-copy path the start and the end of its single-copy band.
KEYS: Tuple[str, ...] = tuple(_core.PLAN_KEYS)
#: Per collective with a single-copy path, where the band in which it takes that path
#: starts (None: never) and where it ends (None: no end); ``rust/plan.rs``, ``Band``.
SINGLE_COPY_KEYS = tuple(k for k in KEYS if k.endswith("_single_copy_min_bytes"))
SINGLE_COPY_MAX_KEYS = tuple(k for k in KEYS if k.endswith("_single_copy_max_bytes"))
#: The collectives with a single-copy path, in :data:`SINGLE_COPY_KEYS`' order
#: (``allreduce``, ``allgather``, ``reduce_scatter``, ``broadcast``, ``alltoall``).
SINGLE_COPY_OPS: Tuple[str, ...] = tuple(k[:-len("_single_copy_min_bytes")] for k in SINGLE_COPY_KEYS)
#: The core's plan before a measured one is set (rust/plan.rs, ``Plan::FALLBACK``).
FALLBACK: Dict[str, Optional[int]] = dict(_core.PLAN_FALLBACK)
#: Sizes S (bytes) the calibration measures (larger messages follow the largest): a 4x
#: grid, so a threshold falls at the geometric middle (2x) between two measured sizes.
GRID = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
#: A single-copy path is chosen where it is faster than the slots by this factor, up to a
#: size where it is slower by more than that (:func:`_band`),
#: and one-shot allreduce is kept only where it is faster than two-step by this factor at
#: its size and every smaller one: near a boundary the default (slots; two-step) stays, so
#: noise does not flip plans.
MARGIN = 0.85
ROUNDS = 5  # timed rounds (each runs every variant of every case once, alternating)
#: Calls per variant and round, back to back; the last one is timed. The first call after
#: a switch of algorithm finds the slots in the state the other algorithm left (which
#: lines the peer holds), so a single call measured the switch, not the algorithm: on the
#: AMD EPYC VM single calls had the one-shot allreduce ahead at 1 MiB in 1 MiB slots,
#: where back-to-back calls run the two-step one in 91-96 us against 126-131 us.
BURST = 2
#: 2: bursts, and 16 MiB in the grid; 3: the one-shot rule of decide(); 4: several runs,
#: rewritten allgather input; 5: the single-copy rule of _switch() (a tie at a larger size
#: no longer vetoes a clear win); 6: broadcast and all-to-all measured (single-copy paths),
#: single-copy bands (a min and a max per collective).
CACHE_SCHEMA = 6
#: A machine's plan is settled after this many calibrations, each taken at the first group
#: created at least :data:`RUN_GAP_S` after the previous one, their figures merged
#: (:func:`merge`). One calibration can fall into one of the VM's slow phases: on the AMD
#: EPYC 2-vCPU VM they came and went every few seconds to minutes, and in them every plain
#: slot transfer took 4-8 times as long while single-copy reads of clean input barely
#: slowed, so a plan measured there chose single-copy from 32 KiB and kept it
#: (docs/benchmark.md, "The VM's placements").
SETTLE_RUNS = 3
RUN_GAP_S = 60.0
#: A calibration is cached only if the 1-minute load average was at most
#: max(CPU count, group size) + this when it ended.
BUSY_MARGIN = 1.0
_NEVER = None
_LIMIT = 1 << 64  # thresholds are the core's 64-bit sizes (usize)


def cache_dir() -> str:
    """``$FLAGOS_SHM_CACHE_DIR`` (as the emulator's cache), else ``$XDG_CACHE_HOME/flagos_shm``,
    else ``~/.cache/flagos_shm``."""
    if os.environ.get("FLAGOS_SHM_CACHE_DIR"):
        return os.environ["FLAGOS_SHM_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flagos_shm")


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine_key(world_size: int, slot_bytes: int, single_copy: bool) -> str:
    """Identity of what a plan was measured on: CPU model, CPU count, kernel release,
    group size, slot size and whether single-copy transfers were usable."""
    parts = [f"schema={CACHE_SCHEMA}", _cpu_model(), f"cpus={os.cpu_count()}", platform.release(),
             f"n={world_size}", f"slot={slot_bytes}", f"cma={int(single_copy)}"]
    return "|".join(parts)


def _cache_path(key: str) -> str:
    return os.path.join(cache_dir(), f"plan-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json")


def valid_plan(plan) -> bool:
    """Whether ``plan`` is a dict with exactly :data:`KEYS`, each a non-negative int below
    2**64 (the core's sizes; the single-copy ones may be None)."""
    if not isinstance(plan, dict) or set(plan) != set(KEYS):
        return False
    ok = lambda v, none: (v is None and none) or (type(v) is int and 0 <= v < _LIMIT)  # noqa: E731
    return ok(plan["one_shot_max_bytes"], False) and all(ok(plan[k], True) for k in KEYS[1:])


def _valid_runs(runs) -> bool:
    """Whether ``runs`` is a non-empty list of at most :data:`SETTLE_RUNS` calibration
    records (``{"epoch": seconds, "measured_us": {op: {variant: [us per size]}}}``) with
    every case :func:`decide` needs, one positive figure per :data:`GRID` size."""
    def figures(v):
        return isinstance(v, list) and len(v) == len(GRID) and all(
            type(x) in (int, float) and 0 < x < float("inf") for x in v)
    need = {"allreduce": ("one_shot", "two_step"), **{op: ("slots",) for op in SINGLE_COPY_OPS[1:]}}
    if not isinstance(runs, list) or not 0 < len(runs) <= SETTLE_RUNS:
        return False
    for run in runs:
        m = run.get("measured_us") if isinstance(run, dict) else None
        if not isinstance(m, dict) or type(run.get("epoch")) not in (int, float) or set(m) != set(need):
            return False
        for op, names in need.items():
            if not isinstance(m[op], dict) or not set(names) <= set(m[op]) <= set(names) | {"single_copy"} \
                    or not all(figures(v) for v in m[op].values()):
                return False
    return True


def load_cached(key: str) -> Optional[dict]:
    """The cache entry of ``key``, ``{"plan": ..., "runs": [...]}`` (see
    :func:`store_cached`), or None (missing, unreadable or corrupt: ignored)."""
    path = _cache_path(key)
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("key") != key or not valid_plan(doc.get("plan")) \
            or not _valid_runs(doc.get("runs")):
        _log.debug("flagos_shm: ignoring corrupt plan cache %s", path)
        return None
    return {"plan": doc["plan"], "runs": doc["runs"]}


def store_cached(key: str, runs: List[dict]) -> Optional[str]:
    """Write the cache entry of ``key``: the calibrations ``runs`` (each ``{"epoch":
    seconds since the epoch, "measured_us": figures of calibrate()}``, at most
    :data:`SETTLE_RUNS`) and the plan :func:`decide` takes from their :func:`merge`.
    Written atomically (a temporary file renamed over it, so concurrent writers and
    readers never see a partial file). Returns the path, or None when the directory is
    not writable (then the next group measures again)."""
    path = _cache_path(key)
    doc = {"key": key, "plan": decide(merge([r["measured_us"] for r in runs])), "runs": runs,
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".plan-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(doc, fh, indent=1)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        _log.debug("flagos_shm: cannot write plan cache %s: %s", path, exc)
        return None
    return path


def _bytes(text: str, what: str) -> Optional[int]:
    if text.strip().lower() in ("never", "none", "inf"):
        return None
    m = re.fullmatch(r"\s*([0-9]+)\s*([KMG]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"{config.ENV_PLAN}: {what}={text!r}: expected bytes (e.g. 262144, 256K, 2M) or 'never'")
    if len(m.group(1).lstrip("0")) > 20:  # more than 64 bits whatever the suffix (and int() has a digit limit)
        raise ValueError(f"{config.ENV_PLAN}: {what}={text.strip()[:40]!r}...: too large for the core's 64-bit sizes")
    value = int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]
    if value >= _LIMIT:
        raise ValueError(f"{config.ENV_PLAN}: {what}={text!r}: {value} bytes do not fit the core's 64-bit sizes")
    return value


def parse(text: str):
    """``FLAGOS_SHM_PLAN`` -> ``"auto"``, ``"calibrate"``, ``"fallback"`` or a plan dict.

    Raises:
        ValueError: unknown word or key, malformed value (the message names the variable).
    """
    word = text.strip().lower()
    if word in ("", "auto"):
        return "auto"
    if word in ("calibrate", "fallback"):
        return word
    if word == "default":
        return "fallback"
    plan = dict(FALLBACK)
    short = {k.replace("_min_bytes", "").replace("_bytes", ""): k for k in KEYS}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        key = short.get(name.strip(), name.strip())
        if not sep or key not in KEYS:
            raise ValueError(f"{config.ENV_PLAN}={text!r}: {item!r}: expected auto, calibrate, fallback or "
                             f"key=value pairs with keys {', '.join(short)}")
        plan[key] = _bytes(value, name.strip())
    for lo, hi in zip(SINGLE_COPY_KEYS, SINGLE_COPY_MAX_KEYS):
        if plan[lo] is not None and plan[hi] is not None and plan[hi] <= plan[lo]:
            raise ValueError(f"{config.ENV_PLAN}={text!r}: {hi}={plan[hi]} is not above {lo}={plan[lo]} (a band "
                             "from the first up to below the second; missing keys take the fallback's values, "
                             f"{describe(FALLBACK)})")
    if plan["one_shot_max_bytes"] is None:
        plan["one_shot_max_bytes"] = 1 << 62
    return plan


# ----------------------------------------------------------------------------- calibration

def _variants(single_copy: bool) -> Dict[str, List[Tuple[str, dict]]]:
    """Per op, the variants to time, each as the plan that forces it."""
    slots = dict(FALLBACK, **{k: _NEVER for k in KEYS[1:]})
    big = 1 << 62
    out = {"allreduce": [("one_shot", dict(slots, one_shot_max_bytes=big)),
                         ("two_step", dict(slots, one_shot_max_bytes=0))],
           **{op: [("slots", slots)] for op in SINGLE_COPY_OPS[1:]}}
    if single_copy:
        for op, key in zip(SINGLE_COPY_OPS, SINGLE_COPY_KEYS):
            out[op].append(("single_copy", dict(slots, **{key: 0})))  # from 0 B, no end
    return out


def _set(comm, plan: dict) -> None:
    comm.set_plan({k: plan[k] for k in KEYS})


def calibrate(comm, grid=GRID, rounds: int = ROUNDS, burst: int = BURST) -> Dict[str, Dict[str, List[float]]]:
    """Time every variant of allreduce, allgather, reduce-scatter, broadcast (root 0) and
    all-to-all (float32, SUM where it reduces) at each
    size of ``grid`` on ``comm``, all ranks together: one warm-up round, then ``rounds``
    rounds alternating the variants, each variant run ``burst`` times back to back with
    the last call timed (see :data:`BURST`). Returns ``{op: {variant: [us per size]}}``: each
    variant's fastest round (other processes can only add time, so the minimum is the
    least disturbed estimate), the same on every rank (MAX over ranks). Leaves the
    fallback plan set.

    In ``FLAGOS_SHM_STREAM=auto`` (the default) each slot variant is timed with plain and
    with streaming stores into the slots and keeps the faster (``rust/stream.rs``: at run
    time each rank's streamer chooses the faster kind, and on the AMD EPYC VM which one
    that is changes with the placement of the vCPUs: a calibration timing plain stores only
    in the slow placement found single-copy ahead where streaming slots were faster).

    Every call reads input this rank has just written (the allgather's input is rewritten
    before each call, untimed), as gradients are in training: a single-copy transfer
    reading data that stayed clean in both CPUs' caches looks faster than it is. On the
    AMD EPYC 2-vCPU VM, in one of its slow phases, a 1 MiB single-copy allgather took
    67 us on clean input and 110-122 us on freshly written input (slots: 260-330 us);
    docs/benchmark.md, "The VM's placements".

    Must be called by every rank of the group at the same point of its sequence."""
    import torch

    from .. import _core

    n = comm.world_size
    variants = _variants(bool(comm.single_copy_available))
    # In auto mode the streamer would need more calls than the calibration makes to find
    # the faster kind of store: time both and keep the faster (restored to auto after).
    both_stores = getattr(comm, "stream_mode", None) == "auto"
    top = max(grid)
    buf = torch.zeros(top // 4, dtype=torch.float32)
    out = torch.zeros_like(buf)  # the all-to-all's output
    half = torch.zeros(max(1, top // 4 // n), dtype=torch.float32)
    fresh = torch.ones_like(half)
    cases = []  # (op, variant, size index, plan, call, pre, kind of store)
    for i, s in enumerate(grid):
        count = s // 4
        per = max(1, count // n)
        ar = lambda c=count: comm.allreduce(buf.data_ptr(), c * 4, c, "float32", 0)  # noqa: E731
        ag = lambda p=per: comm.allgather(half.data_ptr(), p * 4, buf.data_ptr(), p * 4 * n, p, "float32")  # noqa: E731
        rs = lambda p=per: comm.reduce_scatter(buf.data_ptr(), p * 4 * n, half.data_ptr(), p * 4, p,  # noqa: E731
                                               "float32", 0)
        bc = lambda c=count: comm.broadcast(buf.data_ptr(), c * 4, c, "float32", 0)  # noqa: E731
        a2a = lambda p=per: comm.alltoall(buf.data_ptr(), p * 4 * n, out.data_ptr(), p * 4 * n, p,  # noqa: E731
                                          "float32")
        # The allreduce writes its input (in place) and the allgather writes the
        # reduce-scatter's; the allgather's own input is rewritten here.
        rewrite = lambda p=per: _core.copy_bytes(half.data_ptr(), fresh.data_ptr(), p * 4)  # noqa: E731
        for op, call, pre in (("allreduce", ar, None), ("allgather", ag, rewrite), ("reduce_scatter", rs, None),
                              ("broadcast", bc, None), ("alltoall", a2a, None)):
            for name, plan in variants[op]:
                # slot variants with each kind of store (the streamer picks the faster at run
                # time); single-copy transfers do not touch the slots
                for stores in ("plain", "stream") if both_stores and name != "single_copy" else ("plain",):
                    cases.append((op, name, i, plan, call, pre, stores))
    times: List[List[float]] = [[] for _ in cases]
    clock = time.perf_counter_ns
    for r in range(rounds + 1):
        order = cases if r % 2 == 0 else cases[::-1]
        index = range(len(cases)) if r % 2 == 0 else range(len(cases) - 1, -1, -1)
        for j, (_, _, _, plan, call, pre, stores) in zip(index, order):
            _set(comm, plan)
            if both_stores:
                comm.set_stream_mode(stores)
            for _ in range(burst - 1):
                if pre:
                    pre()
                call()
            if pre:
                pre()
            t0 = clock()
            call()
            if r:
                times[j].append((clock() - t0) / 1e3)
    _set(comm, FALLBACK)
    if both_stores:
        comm.set_stream_mode("auto")
    med = torch.tensor([min(t) for t in times], dtype=torch.float64)
    comm.allreduce(med.data_ptr(), med.numel() * 8, med.numel(), "float64", 4)  # MAX: same on every rank
    out: Dict[str, Dict[str, List[float]]] = {}
    for (op, name, i, _, _, _, _), value in zip(cases, med.tolist()):
        row = out.setdefault(op, {}).setdefault(name, [float("inf")] * len(grid))
        row[i] = min(row[i], round(value, 2))  # the faster kind of store
    return out


def merge(runs: List[Dict[str, Dict[str, List[float]]]]) -> Dict[str, Dict[str, List[float]]]:
    """Per case, the fastest of several calibrations' figures (the variants every run
    has): as within one calibration, other load and the VM's slow phases only add time,
    so the minimum over runs taken minutes apart is the least disturbed estimate."""
    out: Dict[str, Dict[str, List[float]]] = {}
    for op, by_variant in runs[0].items():
        for name in by_variant:
            if all(name in run.get(op, {}) for run in runs):
                out.setdefault(op, {})[name] = [min(v) for v in zip(*(run[op][name] for run in runs))]
    return out


def _band(base: List[float], alt: List[float], grid) -> Tuple[Optional[int], Optional[int]]:
    """The band ``(min, max)`` of message sizes in which ``alt`` is used (bytes; ``min`` None:
    never, ``max`` None: no end), each end at the geometric middle between two measured
    sizes. The measured sizes at which ``alt`` loses clearly (slower than ``base`` by more
    than :data:`MARGIN`) cut the grid into runs; the band starts at the first clear win
    (faster by the margin) of the run with the most clear wins (of two with as many, the
    one at larger sizes) and ends at the clear loss after it. Within the margin either way
    (a tie) nothing moves: noise between calibrations only changes which of two equal
    paths runs, and one noisy figure cannot move the band to another run.

    Bands rather than one threshold because single-copy can win at middle sizes only: on
    the Intel Xeon VM (2026-12-04) a single-copy broadcast took 52.7 us at 1 MiB against
    70.0 through the slots, and 430 against 307 at 4 MiB. The rules before (one threshold,
    "wins at that size and at every larger one", then "first clear win above the last
    clear loss") chose the slots for every size there."""
    loses = [a * MARGIN > b for b, a in zip(base, alt)]
    wins = [a < MARGIN * b for b, a in zip(base, alt)]
    best = None  # (clear wins, first index, end index)
    start = 0
    for end in [k for k, lost in enumerate(loses) if lost] + [len(grid)]:
        won = [k for k in range(start, end) if wins[k]]
        if won and (best is None or len(won) >= best[0]):
            best = (len(won), won[0], end)
        start = end + 1
    if best is None:
        return None, None
    return grid[best[1]] // 2, (None if best[2] == len(grid) else grid[best[2]] // 2)


def _keep_below(small: List[float], large: List[float], grid) -> Optional[int]:
    """The threshold up to which ``small`` (the algorithm with fewer synchronisations)
    stays, given that it wins clearly at that size and every smaller measured size (the
    geometric middle below the first size where it does not), or None when it wins
    clearly at every measured size. Below the smallest measured size it always stays."""
    k = 0
    while k < len(grid) and small[k] < MARGIN * large[k]:
        k += 1
    return None if k == len(grid) else grid[k] // 2


def decide(measured: Dict[str, Dict[str, List[float]]], grid=GRID) -> dict:
    """The plan implied by :func:`calibrate`'s figures; a pure function, so ranks holding
    the same figures derive the same plan."""
    ar = measured["allreduce"]
    # One-shot only while it wins clearly from the smallest size up; above, the two-step
    # one, which moves 2(n-1)/n of S per rank where one-shot moves n - 1 times S: where
    # the two tie (a calibration in one of the VM's slow phases, when every transfer
    # between the CPUs is slow), the one that scales is kept, not the one with one sync.
    keep = _keep_below(ar["one_shot"], ar["two_step"], grid)
    one_shot_max = (1 << 62) if keep is None else keep
    slots = [o if s <= one_shot_max else t for s, o, t in zip(grid, ar["one_shot"], ar["two_step"])]
    plan = {"one_shot_max_bytes": one_shot_max}
    for op, lo, hi in zip(SINGLE_COPY_OPS, SINGLE_COPY_KEYS, SINGLE_COPY_MAX_KEYS):
        base = slots if op == "allreduce" else measured[op]["slots"]
        alt = measured[op].get("single_copy")
        plan[lo], plan[hi] = (None, None) if alt is None else _band(base, alt, grid)
    return plan


# ----------------------------------------------------------------------------- agreement

def _request() -> str:
    return json.dumps({"plan": os.environ.get(config.ENV_PLAN, "").strip() or "auto",
                       "cma_min_bytes": config.cma_min_bytes()})


def setup(comm, store, layout, rank: int, world_size: int, where: str, timeout_s: float) -> Tuple[dict, str]:
    """Agree on the plan of ``comm``, this rank's node communicator (module docstring), and
    set it. Every rank of the group calls this right after attaching. Returns ``(plan,
    source)``, source one of ``"env"``, ``"fallback"``, ``"cache"``, ``"calibrated"``.

    Args:
        layout: the rendezvous' :class:`~flagos_shm.backend.rendezvous.Layout`. Its
            ``base``, the key prefix of this incarnation of the group in ``store``, holds
            the plan's keys: a store that outlives the group (``init_process_group(store=
            ...)`` again after ``destroy_process_group``) still holds the previous
            incarnation's request and outcome, which a rank must not read as this one's.
            On a group that spans nodes, every rank's request is checked against every
            other's as on one node, and each node's leader resolves and measures (with the
            node's ranks, on its segment) the plan of its own node: nodes may be
            different machines.
        timeout_s: the group's timeout, seconds: the longest this waits for the peers'
            requests and the outcome.

    Raises:
        ValueError: ``FLAGOS_SHM_PLAN`` or ``FLAGOS_SHM_CMA_MIN_BYTES`` is malformed on
            some rank, or the ranks asked for different plans: on every rank of every
            node, naming the ranks. A malformed request is published as such, so that the
            peers learn of it at once instead of waiting for a request that never comes;
            and a rank leaves only once its peers have read the outcome (or at most
            ``rendezvous.LEAVE_WAIT_S``), so that a store living in it (``TCPStore`` on
            rank 0) outlasts their reads.
        RuntimeError: a rank of the node exited (or, on a leader, a rank of another node
            on this machine whose request was still missing), a rank of the group gave up
            setting it up (``rendezvous.publish_failure``: a rank of another node that could not
            attach, say), or ``timeout_s`` passed, while this waited; or a calibration's
            collective failed (on a group that spans nodes, naming the group ranks of the
            node's ranks, which the core numbers 0, 1, ...).
    """
    base, node, local_rank, local_size = layout.base, layout.node, layout.local_rank, layout.local_size
    # FLAGOS_SHM_CMA_MIN_BYTES' thresholds, which the core set at attach: a calibration below
    # leaves the fallback plan set, so they are read now.
    legacy = comm.plan
    deadline = time.monotonic() + timeout_s
    # the node's ranks: their process ids are this rank's to watch
    mates = rendezvous.watchable(layout, rank, layout.nodes[node])
    try:
        mine = _request()  # a malformed FLAGOS_SHM_CMA_MIN_BYTES raises here
        parse(json.loads(mine)["plan"])  # and a malformed FLAGOS_SHM_PLAN here
    except ValueError as exc:
        mine = json.dumps({"error": str(exc)})  # published instead of a request: every rank raises it
    store.set(f"{base}/plan/request/{rank}", mine)
    outcome_key = f"{base}/plan/outcome/{node}"
    if local_rank == 0:  # each node's leader: every leader reads every request, so all agree
        # and, while their requests are missing, the other nodes' ranks on this machine (a
        # rank alone on its node has no node mate to notice that it exited)
        watched = rendezvous.watchable(layout, rank, range(world_size))
        requests = [f"{base}/plan/request/{r}" for r in range(world_size)]
        rendezvous.wait_keys(store, requests, deadline, "waiting for every rank's plan request",
                             lambda: {r: pid for r, pid in watched.items() if not store.check([requests[r]])}, base)
        store.set(outcome_key, _resolve(comm, store, base, world_size, local_size))
    else:
        rendezvous.wait_keys(store, [outcome_key], deadline, "waiting for the node's plan", lambda: mates, base)
    outcome = json.loads(store.get(outcome_key))
    if "error" in outcome:
        rendezvous.leave_together(store, base, rank, world_size, time.monotonic() + rendezvous.LEAVE_WAIT_S)
        raise ValueError(f"{where}: {outcome['error']}")
    key, source = outcome.get("key"), outcome["source"]
    if source == "calibrate":
        t0 = time.perf_counter()
        try:
            measured = calibrate(comm)
        except RuntimeError as exc:
            if layout.single_node:
                raise
            # the core numbers the node's ranks 0, 1, ...: name the group ranks they are
            raise options.with_context(exc, f"{exc} (in node {node}, whose ranks 0..{local_size - 1} are group "
                                            f"ranks {layout.nodes[node]})") from exc
        runs = outcome.get("runs", []) + [{"epoch": math.floor(time.time() * 10) / 10, "measured_us": measured}]
        plan, source = decide(merge([r["measured_us"] for r in runs])), "calibrated"
        if local_rank == 0:
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
            # Measured while other processes compete for the CPUs: use it, do not keep it.
            busy = load > max(os.cpu_count() or 1, local_size) + BUSY_MARGIN
            path = None if busy else store_cached(key, runs)
            _log.debug("flagos_shm: calibration %d of %d in %.3f s (%s, load %.1f): %s; %s", len(runs), SETTLE_RUNS,
                       time.perf_counter() - t0, key, load, runs[-1]["measured_us"],
                       f"cached in {path}" if path else "not cached (machine busy or cache not writable)")
    else:
        plan = outcome["plan"]
    if json.loads(mine)["cma_min_bytes"]:  # the legacy override: keep the core's thresholds
        plan = dict(plan, **{k: legacy[k] for k in KEYS[1:]})
    _set(comm, plan)
    _log.debug("%s: plan %s (%s)", where, describe(comm.plan), source)
    return comm.plan, source


def _resolve(comm, store, base: str, world_size: int, local_size: int) -> str:
    """On a node's leader: the outcome for its node, from every rank's request (the same
    verdict on every leader: the requests are compared with group rank 0's)."""
    requests = [store.get(f"{base}/plan/request/{r}").decode() for r in range(world_size)]
    parsed = [json.loads(req) for req in requests]
    malformed = [f"group rank {r}: {p['error']}" for r, p in enumerate(parsed) if "error" in p]
    if malformed:
        return json.dumps({"error": "; ".join(malformed)})
    differ = [r for r, req in enumerate(requests) if req != requests[0]]
    if differ:
        return json.dumps({"error": f"ranks disagree on {config.ENV_PLAN} / FLAGOS_SHM_CMA_MIN_BYTES: rank 0 "
                                    f"has {parsed[0]}, ranks {differ} have "
                                    f"{[parsed[r] for r in differ]}; set the same on every rank"})
    asked = parse(parsed[0]["plan"])
    if local_size == 1 and not isinstance(asked, dict):  # nothing to choose between
        return json.dumps({"source": "fallback", "plan": FALLBACK})
    if isinstance(asked, dict):
        return json.dumps({"source": "env", "plan": asked})
    if asked == "fallback":
        return json.dumps({"source": "fallback", "plan": FALLBACK})
    key = machine_key(local_size, comm.slot_bytes, bool(comm.single_copy_available))
    cached = load_cached(key) if asked == "auto" else None
    if cached is None:
        return json.dumps({"source": "calibrate", "key": key})
    runs = cached["runs"]
    if len(runs) < SETTLE_RUNS and time.time() - runs[-1]["epoch"] >= RUN_GAP_S:
        # not settled: measure once more and merge (every rank merges the same runs)
        return json.dumps({"source": "calibrate", "key": key, "runs": runs})
    return json.dumps({"source": "cache", "plan": cached["plan"], "key": key})


def describe(plan: dict) -> str:
    """``allreduce one-shot up to 256 KiB, two-step above; single-copy from: allreduce 2 MiB,
    ..., broadcast 32 KiB below 2 MiB, ...`` (a band's end only where it has one)."""
    def b(v):
        if v is None or v >= 1 << 60:
            return "never"
        for unit, s in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if v >= 1 << s and v % (1 << s) == 0:
                return f"{v >> s} {unit}"
        return f"{v} B"
    one = plan["one_shot_max_bytes"]
    def band(lo, hi):
        return b(lo) + ("" if lo is None or hi is None else f" below {b(hi)}")
    return (f"allreduce one-shot up to {'any size' if one >= 1 << 60 else b(one)}, two-step above; single-copy "
            "from: " + ", ".join(f"{op} {band(plan[lo], plan[hi])}"
                                 for op, lo, hi in zip(SINGLE_COPY_OPS, SINGLE_COPY_KEYS, SINGLE_COPY_MAX_KEYS)))
