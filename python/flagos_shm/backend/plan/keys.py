"""What a plan is: its keys and the fallback (both the core's, ``rust/plan.rs``), which
dicts are plans, and how one reads to a person."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from ... import _core
from ...config import SIZE_LIMIT

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


def valid_plan(plan) -> bool:
    """Whether ``plan`` is a dict with exactly :data:`KEYS`, each a non-negative int below
    2**64 (the core's sizes; the single-copy ones may be None)."""
    if not isinstance(plan, dict) or set(plan) != set(KEYS):
        return False
    ok = lambda v, none: (v is None and none) or (type(v) is int and 0 <= v < SIZE_LIMIT)  # noqa: E731
    return ok(plan["one_shot_max_bytes"], False) and all(ok(plan[k], True) for k in KEYS[1:])


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
