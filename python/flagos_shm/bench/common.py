"""Torch-free rules of :mod:`flagos_shm.bench`, shared with the MPI ranks
(:mod:`flagos_shm.bench.mpi_rank`, which runs without importing torch): ops, dtypes, sizes S,
iteration counts, statistics and the result record. See :mod:`flagos_shm.bench` for the
method.
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Dict, Optional, Sequence, Tuple

KiB, MiB = 1 << 10, 1 << 20
#: Default sizes S: 4 B .. 64 MiB in powers of 4.
DEFAULT_SIZES = [4 ** k for k in range(1, 14)]
#: Default timed-iteration budget: iterations = clamp(ITER_BUDGET_BYTES / S, MIN_ITERS,
#: MAX_ITERS); warm-up = iterations / 10 (>= 1). Keeps a default 2-rank run within about
#: a minute and a half on 2 cores (gloo: about 60 ms per 64 MiB allreduce).
ITER_BUDGET_BYTES = 1024 * MiB
MIN_ITERS, MAX_ITERS = 10, 500
#: Timed iterations of the 4-byte per-call overhead measurement (unless --iters is given).
OVERHEAD_ITERS = 2000

OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall")
#: dtype name (torch.<name>) -> element size in bytes.
DTYPES: Dict[str, int] = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2,
                          "int64": 8, "int32": 4, "int8": 1, "uint8": 1}
#: dtypes the MPI comparison can time (numpy types with a predefined MPI datatype).
MPI_DTYPES = ("float32", "float64", "int64", "int32", "int8", "uint8")
TORCH_BACKENDS = ("flagos_shm", "gloo")
ALL_BACKENDS = TORCH_BACKENDS + ("mpi",)
#: The backend the others are compared against (the ratio columns are other / this).
REFERENCE = "flagos_shm"
SCHEMA = "flagos_shm.bench/2"

TIME_DEFINITION = ("per timed iteration, the slowest rank's time of one synchronous call "
                   "(time.perf_counter_ns); median, min and p90 over iterations, microseconds")
BANDWIDTH_DEFINITION = ("nccl-tests, GB = 1e9 bytes: algbw = S / median time; busbw = algbw x "
                        "2(n-1)/n (allreduce), (n-1)/n (allgather: S = whole output; "
                        "reduce_scatter: S = whole input; alltoall: S = one rank's input), "
                        "1 (broadcast)")


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``op`` at world size ``n`` (busbw = algbw x factor).

    Raises:
        ValueError: unknown op.
    """
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("allgather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"op: unknown op {op!r}; expected one of {', '.join(OPS)}")


def case_numel(op: str, requested: int, n: int, element_bytes: int) -> Tuple[int, int]:
    """Element count per rank and the size S actually used for a requested S (bytes).

    Returns ``(numel, size_bytes)``: ``numel`` is the element count of the buffer
    (allreduce, broadcast), of each rank's input (allgather), of each rank's output
    (reduce_scatter) or of one rank's piece for each peer (alltoall: the buffers hold
    ``n * numel``); ``size_bytes`` is S as nccl-tests counts it (see the module docstring),
    rounded down to whole elements per rank and at least one element per rank.

    Raises:
        ValueError: unknown op, ``requested`` < 1, ``n`` < 1 or ``element_bytes`` < 1.
    """
    if requested < 1 or n < 1 or element_bytes < 1:
        raise ValueError(f"requested={requested}, n={n}, element_bytes={element_bytes}: "
                         "all must be >= 1")
    if op in ("allreduce", "broadcast"):
        numel = max(1, requested // element_bytes)
        return numel, numel * element_bytes
    if op in ("allgather", "reduce_scatter", "alltoall"):
        per = max(1, requested // (element_bytes * n))
        return per, per * n * element_bytes
    raise ValueError(f"op: unknown op {op!r}; expected one of {', '.join(OPS)}")


def iterations(size_bytes: int, iters: Optional[int] = None,
               warmup: Optional[int] = None) -> Tuple[int, int]:
    """``(warm-up, timed)`` iteration counts for one measurement of S bytes.

    A pure function of its arguments, so every rank derives the same counts. ``iters``
    None: ``ITER_BUDGET_BYTES / S`` clamped to ``[MIN_ITERS, MAX_ITERS]``; ``warmup`` None:
    ``iters // 10``, at least 1.
    """
    n_iters = iters if iters is not None else \
        min(MAX_ITERS, max(MIN_ITERS, ITER_BUDGET_BYTES // max(1, size_bytes)))
    return (warmup if warmup is not None else max(1, n_iters // 10)), n_iters


def summarize(times_ns: Sequence[float]) -> Dict[str, float]:
    """Median, min and p90 (nearest rank) of per-iteration times in ns, as microseconds.

    Raises:
        ValueError: ``times_ns`` is empty.
    """
    if not times_ns:
        raise ValueError("times_ns: no timed iterations")
    ordered = sorted(times_ns)
    p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
    return {"time_us_median": statistics.median(ordered) / 1e3,
            "time_us_min": ordered[0] / 1e3, "time_us_p90": p90 / 1e3}


def make_record(backend: str, op: str, dtype: str, size_bytes: int, numel: int, n: int,
                device: str, warmup: int, iters: int, stats: Dict[str, float]) -> dict:
    """One result row (the JSON ``results`` item): the stats plus algbw and busbw in GB/s."""
    algbw = size_bytes / (stats["time_us_median"] * 1e-6) / 1e9 if stats["time_us_median"] > 0 else 0.0
    factor = busbw_factor(op, n)
    return {"backend": backend, "op": op, "dtype": dtype, "size_bytes": size_bytes,
            "numel_per_rank": numel, "world_size": n, "device": device, "warmup": warmup,
            "iters": iters, **stats, "algbw_GBps": algbw, "busbw_factor": factor,
            "busbw_GBps": algbw * factor}


def parse_size(text: str) -> int:
    """Parse '4', '64K', '64KiB', '1M', '16MiB', '1G' (binary units) into bytes (>= 1).

    Raises:
        ValueError: malformed or < 1 byte.
    """
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"--sizes: cannot parse {text!r}; expected e.g. 4, 1K, 64KiB, 16M")
    value = int(m.group(1)) * {"": 1, "K": KiB, "M": MiB, "G": 1 << 30}[m.group(2).upper()]
    if value < 1:
        raise ValueError(f"--sizes: {text!r} is {value} bytes; sizes must be >= 1 byte")
    return value


def human(nbytes: int) -> str:
    """4 -> '4 B', 65536 -> '64 KiB' (exact binary units only, else bytes)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"
