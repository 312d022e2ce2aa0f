"""Rounds of :mod:`flagos_shm.bench` (private): the run measures everything ``--rounds``
times, the torch backends' part and Open MPI's part alternating, and keeps each figure's
best round.

Why: on a shared VM the speed of memory and of the scheduler moves in phases of minutes
(on the 2-vCPU AMD EPYC VM, 2026-12-01, a single-thread copy of 16 MiB took 1.19 ms in one
phase and 2.30 ms in another, the same allreduce varied 2x between runs a minute apart),
and Open MPI runs after the torch backends, as its own ``mpirun`` job. With one round a
phase change between the two parts decides the comparison; with rounds that alternate,
every backend and baseline gets the same chances, and keeping the round with the lowest
median for each (as ``timeit`` keeps the best of its repeats) compares each at its best.
Each kept record says which round it came from (``"round"``, 0-based).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Tuple


def _key(row: dict) -> Tuple:
    return tuple(row.get(k) for k in ("backend", "op", "dtype", "size_bytes"))


def best_of(rounds: Sequence[Iterable[dict]]) -> List[dict]:
    """The rows of every round merged: for each (backend, op, dtype, size_bytes), the row
    with the lowest ``time_us_median``, tagged with its round as ``"round"`` and with every
    round's median as ``"round_medians_us"`` (in round order; a round that lacks the row
    is left out); in the order the rows first appear. Rows are dicts as in the JSON's
    ``results``, ``copy_baseline`` and ``xcopy_baseline`` (the baselines have no backend
    or op: they are keyed by size)."""
    best: Dict[Tuple, dict] = {}
    medians: Dict[Tuple, List[float]] = {}
    for i, rows in enumerate(rounds):
        for row in rows:
            k = _key(row)
            medians.setdefault(k, []).append(row["time_us_median"])
            if k not in best or row["time_us_median"] < best[k]["time_us_median"]:
                best[k] = {**row, "round": i}
    return [{**row, "round_medians_us": medians[k]} for k, row in best.items()]
