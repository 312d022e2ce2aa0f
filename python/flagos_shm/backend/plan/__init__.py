"""The plan of a node's communicator: which algorithm each collective uses at which size,
measured on this machine (see ``rust/plan.rs`` and docs/design.md, "The plan").

When a group is created, its ranks agree on a plan through the group's store:

1. every rank publishes what it asks for: ``FLAGOS_SHM_PLAN`` (``auto`` when unset); ranks
   that ask for different things raise ValueError, on every rank, naming the variable and
   the ranks;
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
:data:`KEYS` (short names without ``_min_bytes``/``_bytes`` allowed; ``single_copy`` sets every
collective's single-copy threshold at once, the keys of one collective then override it),
values in bytes with optional K/M/G suffix or ``never``; missing keys take the fallback's
values. ``FLAGOS_SHM_CMA=0`` turns single-copy off.
The plan is logged at DEBUG level on logger ``flagos_shm``.

The package, by concern (this module is the agreement, :func:`setup`, and hands every
name of the parts on):

* :mod:`.keys`: the plan's keys and fallback (the core's), :func:`valid_plan`, :func:`describe`;
* :mod:`.parse`: ``FLAGOS_SHM_PLAN``'s text (:func:`parse`);
* :mod:`.calibrate`: the measurement (:func:`calibrate`, :data:`GRID`);
* :mod:`.decide`: figures to a plan (:func:`decide`, :func:`merge`, :data:`MARGIN`);
* :mod:`.cache`: the per-machine cache (:func:`machine_key`, :func:`load_cached`,
  :func:`store_cached`, :data:`SETTLE_RUNS`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Tuple

from ... import config
from .. import options, rendezvous
from .cache import CACHE_SCHEMA, SETTLE_RUNS, load_cached, machine_key, store_cached
from .calibrate import BURST, GRID, ROUNDS, _set, calibrate
from .decide import _band as _band  # the band rule, which the plan's tests check directly
from .decide import MARGIN, decide, merge
from .keys import FALLBACK, KEYS, SINGLE_COPY_KEYS, SINGLE_COPY_MAX_KEYS, SINGLE_COPY_OPS, describe, valid_plan
from .parse import parse

__all__ = ["BURST", "BUSY_MARGIN", "CACHE_SCHEMA", "FALLBACK", "GRID", "KEYS", "MARGIN", "ROUNDS", "RUN_GAP_S",
           "SETTLE_RUNS", "SINGLE_COPY_KEYS", "SINGLE_COPY_MAX_KEYS", "SINGLE_COPY_OPS", "calibrate",
           "decide", "describe", "load_cached", "machine_key", "merge", "parse", "setup", "store_cached",
           "valid_plan"]

_log = logging.getLogger("flagos_shm")

RUN_GAP_S = 60.0
#: A calibration is cached only if the 1-minute load average was at most
#: max(CPU count, group size) + this when it ended.
BUSY_MARGIN = 1.0


def _request() -> str:
    return json.dumps({"plan": config.plan_request()})


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
        ValueError: ``FLAGOS_SHM_PLAN`` is malformed on some rank, or the ranks asked for
            different plans: on every rank of every node, naming the ranks. A malformed
            request is published as such, so that the peers learn of it at once instead of
            waiting for a request that never comes; and a rank leaves only once its peers
            have read the outcome (or at most ``rendezvous.LEAVE_WAIT_S``), so that a store
            living in it (``TCPStore`` on rank 0) outlasts their reads.
        RuntimeError: a rank of the node exited (or, on a leader, a rank of another node
            on this machine whose request was still missing), a rank of the group gave up
            setting it up (``rendezvous.publish_failure``: a rank of another node that could not
            attach, say), or ``timeout_s`` passed, while this waited; or a calibration's
            collective failed (on a group that spans nodes, naming the group ranks of the
            node's ranks, which the core numbers 0, 1, ...).
    """
    base, node, local_rank, local_size = layout.base, layout.node, layout.local_rank, layout.local_size
    deadline = time.monotonic() + timeout_s
    # the node's ranks: their process ids are this rank's to watch
    mates = rendezvous.watchable(layout, rank, layout.nodes[node])
    try:
        mine = _request()
        parse(json.loads(mine)["plan"])  # a malformed FLAGOS_SHM_PLAN raises here
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
    # compared by meaning: "AUTO" and unset, "64K" and "65536" ask for the same plan
    meanings = [parse(p["plan"]) for p in parsed]
    differ = [r for r, meaning in enumerate(meanings) if meaning != meanings[0]]
    if differ:
        return json.dumps({"error": f"ranks disagree on {config.ENV_PLAN}: rank 0 "
                                    f"has {parsed[0]}, ranks {differ} have "
                                    f"{[parsed[r] for r in differ]}; set the same on every rank"})
    asked = meanings[0]
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
