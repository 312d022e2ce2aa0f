"""From calibrations' figures to a plan: pure functions, so ranks holding the same figures
derive the same plan."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .calibrate import GRID
from .keys import SINGLE_COPY_KEYS, SINGLE_COPY_MAX_KEYS, SINGLE_COPY_OPS

#: A single-copy path needs a size where it is faster than the slots by this factor, and
#: sizes where it is slower by more than that bound its band (:func:`_band`); one-shot
#: allreduce is kept only where it is faster than two-step by this factor at its size and
#: every smaller one. Within the margin neither counts, so one noisy figure does not flip
#: plans.
MARGIN = 0.85


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
    than :data:`MARGIN`) cut the grid into runs; the band lies in the run with the most
    clear wins (faster by the margin; of two runs with as many, the one at larger sizes),
    none means never. It spans that run less the sizes at either end of it where ``alt``
    was not faster at all: so an end of the band falls where the two paths' times cross
    (or at a clear loss), and noise that moves it by a grid step swaps two paths of about
    the same speed. One noisy figure cannot move the band to another run.

    The ends used to be the run's first clear win and the clear loss after it. A size just
    inside the margin then flipped between calibrations at a cost of up to 15 %, and ties
    in which ``alt`` was slower extended the band: on the Intel Xeon 2-vCPU VM
    (2026-12-05, quiet, calibrations minutes apart) allgather's single-copy path started
    at 128 KiB, 512 KiB or 2 MiB (its figures 0.99, 0.85, 0.75, 0.72 and 0.76 of the
    slots' at 64 KiB-16 MiB), so the benchmark's 1 MiB allgather took 56 or 92 us; and
    broadcast's band ended at 2 MiB or not at all (single-copy 1.19 and 1.14 of the slots
    at 4 and 16 MiB).

    Bands rather than one threshold because single-copy can win at middle sizes only: on
    the Intel Xeon VM (2026-12-04) a single-copy broadcast took 52.7 us at 1 MiB against
    70.0 through the slots, and 430 against 307 at 4 MiB. The rules before (one threshold,
    "wins at that size and at every larger one", then "first clear win above the last
    clear loss") chose the slots for every size there."""
    loses = [a * MARGIN > b for b, a in zip(base, alt)]
    wins = [a < MARGIN * b for b, a in zip(base, alt)]
    faster = [a < b for b, a in zip(base, alt)]
    best = None  # (clear wins, first index, end index)
    start = 0
    for end in [k for k, lost in enumerate(loses) if lost] + [len(grid)]:
        won = sum(wins[start:end])
        if won and (best is None or won >= best[0]):
            best = (won, start, end)
        start = end + 1
    if best is None:
        return None, None
    _, first, end = best
    while not faster[first]:  # the run holds a clear win, so this stops inside it
        first += 1
    while not faster[end - 1]:
        end -= 1
    return grid[first] // 2, (None if end == len(grid) else grid[end] // 2)


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
