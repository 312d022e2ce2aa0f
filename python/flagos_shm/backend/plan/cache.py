"""The plan cache: one file per machine (:func:`machine_key`) in
:func:`flagos_shm.config.cache_dir`, holding up to :data:`SETTLE_RUNS` calibrations and the
plan decided from them."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from typing import List, Optional

from ... import config
from .calibrate import GRID
from .decide import decide, merge
from .keys import SINGLE_COPY_OPS, valid_plan

_log = logging.getLogger("flagos_shm")

#: 2: bursts, and 16 MiB in the grid; 3: the one-shot rule of decide(); 4: several runs,
#: rewritten allgather input; 5: the single-copy rule of _switch() (a tie at a larger size
#: no longer vetoes a clear win); 6: broadcast and all-to-all measured (single-copy paths),
#: single-copy bands (a min and a max per collective); 7: a band's ends where the paths'
#: times cross (:func:`~.decide._band`), so plans decided by the rule before are measured again;
#: 8: the single-copy broadcast's root writes a slice into each peer, the single-copy allreduce's
#: ranks write their reduced slices into the others, and single-copy transfers alternate their
#: order (all faster), so the bands are measured again; 9: in-place float reductions on
#: slices (vectorized) and the single-copy allreduce writing each chunk as it is reduced
#: (much faster from 1 MiB up), measured again; 10: a single-copy allgather's and
#: all-to-all's own piece streamed from 4 MiB (was 16 MiB; 7 % faster at 8 and 16 MiB), so
#: their bands are measured again.
CACHE_SCHEMA = 10
#: A machine's plan is settled after this many calibrations, each taken at the first group
#: created at least :data:`RUN_GAP_S` after the previous one, their figures merged
#: (:func:`merge`). One calibration can fall into one of the VM's slow phases: on the AMD
#: EPYC 2-vCPU VM they came and went every few seconds to minutes, and in them every plain
#: slot transfer took 4-8 times as long while single-copy reads of clean input barely
#: slowed, so a plan measured there chose single-copy from 32 KiB and kept it
#: (docs/benchmark.md, "The VM's placements").
SETTLE_RUNS = 3


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
    return os.path.join(config.cache_dir(), f"plan-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json")


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
