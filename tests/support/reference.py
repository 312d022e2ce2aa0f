"""Inputs and reference results for the collective tests.

Every rank generates *all* ranks' inputs of a case deterministically (a seed derived from
the case and the rank), so each rank can compute the expected result of a collective
locally, with plain torch ops, and compare it with what the backend delivered.

Reference reductions follow the documented semantics of the flagos_shm core
(``/README.md``, "Reduce ops"), computed another way than the backend does it:

* floating point: the inputs are combined in rank order 0..n-1 in an accumulation type
  (float32 for float16/bfloat16, the tensor's own type otherwise) and rounded once to
  the tensor's type; ``AVG`` divides that sum by n; ``PREMUL_SUM`` sums ``factor * x``.
  SUM/PRODUCT/MIN/MAX are then bitwise determined; AVG/PREMUL_SUM may differ in the last
  bit (``x / n`` vs ``x * (1 / n)``, fused multiply-add), so they are compared with a
  tolerance of a few units in the last place.
* integers: computed on int64 copies (exact for every narrower type; int64 itself wraps,
  as torch's int64 arithmetic does), then cast back, which wraps modulo 2**bits, i.e.
  the wrap-around of SUM/PRODUCT in the tensor's type. ``AVG`` is the int64 sum divided
  by n rounded toward zero.
* bool: SUM/MAX/BOR = any, PRODUCT/MIN/BAND = all, BXOR = parity.
* complex: (real, imag) pairs reduced as float32.
"""

from __future__ import annotations

import functools
import zlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
DTYPES = FLOAT_DTYPES + INT_DTYPES + [torch.bool]
#: Non-reduction collectives (and SUM/AVG/PREMUL_SUM) also run on complex64.
DTYPES_WITH_COMPLEX = DTYPES + [torch.complex64]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM", "BAND", "BOR", "BXOR"]
BITWISE = ("BAND", "BOR", "BXOR")
#: PREMUL_SUM's factor: not a power of two, so a missing or doubled factor shows.
PREMUL_FACTOR = 0.3
#: Ops whose float results are bitwise determined by the documented semantics.
EXACT_FLOAT_OPS = ("SUM", "PRODUCT", "MIN", "MAX")
SMALL_SIZES = [0, 1, 3, 7]
DEFAULT_SLOT_BYTES = 256 * 1024  # used only when flagos_shm is not importable (gloo runs)
DEFAULT_ONE_SHOT_MAX_BYTES = 256 * 1024


def slot_bytes() -> int:
    """The chunk-slot size of this rank's flagos_shm groups, as the backend picks it for the
    default group's size (``FLAGOS_SHM_SLOT_BYTES``, else the core's default for the segment
    directory: ``config.segment_config``); 256 KiB where flagos_shm is not importable."""
    try:
        from flagos_shm.config import segment_config
    except ImportError:
        return DEFAULT_SLOT_BYTES
    return segment_config(dist.get_world_size() if dist.is_initialized() else 1)[1]


def one_shot_max_bytes() -> int:
    """Above this message size (bytes) the core's allreduce takes two steps (2+ ranks)."""
    try:
        from flagos_shm import _core

        return int(_core.ONE_SHOT_MAX_BYTES)
    except ImportError:
        return DEFAULT_ONE_SHOT_MAX_BYTES


def large_numel(dtype: torch.dtype) -> int:
    """An element count of at least 2.5 chunk slots and 1.25 x ONE_SHOT_MAX_BYTES bytes,
    plus 3 elements (neither slot- nor vector-aligned): the message goes through the slots
    in 3 or more chunks and, at 2+ ranks, takes the two-step allreduce. With the default
    256 KiB slot that is 640 KiB (3 chunks); with 4 KiB slots 320 KiB (80 chunks)."""
    nbytes = max(5 * slot_bytes() // 2, 5 * one_shot_max_bytes() // 4)
    return nbytes // _itemsize(dtype) + 3


def sizes(dtype: torch.dtype, large: bool = True) -> list:
    return SMALL_SIZES + ([large_numel(dtype)] if large else [])


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def op_allowed(dtype: torch.dtype, op: str) -> bool:
    """The documented dtype x op rules (unsupported combinations raise TypeError)."""
    if dtype.is_complex:
        return op in ("SUM", "AVG", "PREMUL_SUM")
    if op in BITWISE:
        return not dtype.is_floating_point
    if op == "PREMUL_SUM":
        return dtype.is_floating_point
    if op == "AVG":
        return dtype != torch.bool
    return True


def reduce_op(op: str):
    import torch.distributed as dist

    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    return getattr(dist.ReduceOp, op)


def case_seed(*parts) -> int:
    return zlib.crc32("|".join(str(p) for p in parts).encode())


def make_input(dtype: torch.dtype, numel: int, *key, op: Optional[str] = None) -> torch.Tensor:
    """A deterministic 1-D input of ``numel`` elements for the case identified by ``key``
    (include the rank); a fresh tensor the caller may modify. Floats: normal(0, 3), or
    magnitudes in [0.5, 2) with random signs for PRODUCT (no overflow over 4 ranks);
    integers: uniformly random bits, i.e. the whole range of the type (so SUM/PRODUCT
    wrap); bool: fair coin."""
    kind = "PRODUCT" if op == "PRODUCT" and (dtype.is_floating_point or dtype.is_complex) else None
    return _make_input(dtype, numel, kind, key).clone()


@functools.lru_cache(maxsize=64)
def _make_input(dtype: torch.dtype, numel: int, kind: Optional[str], key: tuple) -> torch.Tensor:
    g = torch.Generator().manual_seed(case_seed(dtype, numel, kind, *key))
    if dtype.is_complex:
        real = torch.randn(numel, 2, generator=g, dtype=torch.float32) * 3
        return torch.view_as_complex(real).to(dtype)
    if dtype.is_floating_point:
        gen_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if kind == "PRODUCT":
            mag = torch.rand(numel, generator=g, dtype=gen_dtype) * 1.5 + 0.5
            sign = torch.randint(0, 2, (numel,), generator=g, dtype=torch.int8) * 2 - 1
            return (mag * sign).to(dtype)
        return (torch.randn(numel, generator=g, dtype=gen_dtype) * 3).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g, dtype=torch.uint8).to(torch.bool)
    raw = torch.randint(0, 256, (numel * _itemsize(dtype),), generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def all_inputs(dtype: torch.dtype, numel: int, world_size: int, *key, op: Optional[str] = None) -> list:
    """Every rank's input of one case: ``[make_input(..., rank r) for r in range(world_size)]``."""
    return [make_input(dtype, numel, *key, f"rank{r}", op=op) for r in range(world_size)]


def _accumulate(ys: Sequence[torch.Tensor], fn) -> torch.Tensor:
    acc = ys[0].clone()
    for y in ys[1:]:
        acc = fn(acc, y)
    return acc


def reference_reduce(inputs: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of ``inputs`` (rank order) under ``op``, in the inputs' dtype."""
    dtype = inputs[0].dtype
    n = len(inputs)
    if dtype.is_complex:
        real = reference_reduce([torch.view_as_real(x) for x in inputs], op)
        return torch.view_as_complex(real.contiguous())
    if dtype.is_floating_point:
        acc_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        ys = [x.to(acc_dtype) for x in inputs]
        if op == "SUM":
            out = _accumulate(ys, torch.add)
        elif op == "AVG":
            out = _accumulate(ys, torch.add) / n
        elif op == "PREMUL_SUM":
            out = _accumulate([y * PREMUL_FACTOR for y in ys], torch.add)
        elif op == "PRODUCT":
            out = _accumulate(ys, torch.mul)
        elif op == "MIN":
            out = _accumulate(ys, torch.minimum)
        elif op == "MAX":
            out = _accumulate(ys, torch.maximum)
        else:
            raise ValueError(f"op {op} is not defined for {dtype}")
        return out.to(dtype)
    if dtype == torch.bool:
        stacked = torch.stack([x.to(torch.int64) for x in inputs])
        if op in ("SUM", "MAX", "BOR"):
            return stacked.amax(0).to(torch.bool)
        if op in ("PRODUCT", "MIN", "BAND"):
            return stacked.amin(0).to(torch.bool)
        if op == "BXOR":
            return (stacked.sum(0) % 2).to(torch.bool)
        raise ValueError(f"op {op} is not defined for bool")
    ys = [x.to(torch.int64) for x in inputs]
    if op == "SUM":
        out = _accumulate(ys, torch.add)
    elif op == "AVG":
        out = torch.div(_accumulate(ys, torch.add), n, rounding_mode="trunc")
    elif op == "PRODUCT":
        out = _accumulate(ys, torch.mul)
    elif op == "MIN":
        out = _accumulate(ys, torch.minimum)
    elif op == "MAX":
        out = _accumulate(ys, torch.maximum)
    elif op == "BAND":
        out = functools.reduce(torch.bitwise_and, ys)
    elif op == "BOR":
        out = functools.reduce(torch.bitwise_or, ys)
    elif op == "BXOR":
        out = functools.reduce(torch.bitwise_xor, ys)
    else:
        raise ValueError(f"op {op} is not defined for {dtype}")
    return out.to(dtype)


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def compare(got: torch.Tensor, expected: torch.Tensor, *, op: Optional[str] = None,
            exact: bool = True, inputs: Optional[Sequence[torch.Tensor]] = None) -> Optional[str]:
    """``None`` if ``got`` matches ``expected`` (same dtype and element count, flattened in
    row-major order), else a description of the mismatch.

    Integer, bool and non-reduced data must match exactly. Floats must match exactly when
    ``exact`` and ``op`` is None or one of :data:`EXACT_FLOAT_OPS`; otherwise within
    ``2 * n * eps(acc) * max|term|`` absolute plus ``2 * eps(dtype)`` relative, where the
    terms are the inputs (times the PREMUL factor) and n their count.
    """
    if got.dtype != expected.dtype:
        return f"dtype {got.dtype}, expected {expected.dtype}"
    if got.numel() != expected.numel():
        return f"{got.numel()} elements, expected {expected.numel()}"
    g = got.reshape(-1)
    e = expected.reshape(-1)
    if g.dtype.is_complex:
        g, e = torch.view_as_real(g).reshape(-1), torch.view_as_real(e).reshape(-1)
    if g.numel() == 0:
        return None
    if g.dtype.is_floating_point and not (exact and (op is None or op in EXACT_FLOAT_OPS)):
        # exact=False (a backend without a documented summation order or accumulation type,
        # e.g. gloo, which also rounds half types after every step): eps of the dtype itself
        acc = torch.float32 if exact and g.dtype in (torch.float16, torch.bfloat16) else g.dtype
        terms = max((float(x.abs().max()) for x in inputs if x.numel()), default=0.0) if inputs else 0.0
        if op == "PREMUL_SUM":
            terms *= PREMUL_FACTOR
        n = len(inputs) if inputs else 1
        atol = 2 * n * _eps(acc) * terms + torch.finfo(g.dtype).tiny
        rtol = 2 * _eps(g.dtype)
        g64, e64 = g.to(torch.float64), e.to(torch.float64)
        bad = ~(((g64 - e64).abs() <= atol + rtol * e64.abs()) | (g64.isnan() & e64.isnan()) | (g64 == e64))
    elif g.dtype.is_floating_point:
        bad = ~((g == e) | (g.isnan() & e.isnan()))
    else:
        bad = g != e
    count = int(bad.sum())
    if count == 0:
        return None
    i = int(bad.nonzero()[0, 0])
    return (f"{count}/{g.numel()} elements differ; first at flat index {i}: got {g[i].item()!r}, "
            f"expected {e[i].item()!r}")


def tname(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---- layouts: where the caller's tensor lives ------------------------------------------------

LAYOUTS = ["contiguous", "offset", "strided", "transposed"]
SENTINEL = 7


def place(values: torch.Tensor, layout: str):
    """A tensor equal to ``values`` (1-D; "transposed" needs ``values`` 2-D) stored in
    ``layout``: "contiguous"; "offset" (a slice at storage offset 3 of a larger buffer);
    "strided" (column 1 of an (n, 3) buffer); "transposed" (``.t()`` of a contiguous
    buffer). Returns ``(tensor, check)`` where ``check()`` returns ``None`` if the buffer
    elements outside the tensor still hold their sentinel, else a description."""
    dtype = values.dtype
    if layout == "contiguous":
        return values.clone(), lambda: None
    if layout == "offset":
        n = values.numel()
        buf = torch.full((n + 6,), SENTINEL, dtype=dtype) if dtype != torch.bool else torch.ones(n + 6, dtype=dtype)
        view = buf[3:3 + n].view(values.shape)
        view.copy_(values)
        outside = torch.cat([buf[:3], buf[3 + n:]])
        keep = outside.clone()
        return view, lambda: None if torch.equal(torch.cat([buf[:3], buf[3 + n:]]), keep) else \
            "elements outside the offset view were modified"
    if layout == "strided":
        n = values.numel()
        buf = torch.full((n, 3), SENTINEL, dtype=dtype) if dtype != torch.bool else torch.ones(n, 3, dtype=dtype)
        view = buf[:, 1]
        view.copy_(values.reshape(-1))
        keep = buf[:, [0, 2]].clone()
        return view, lambda: None if torch.equal(buf[:, [0, 2]], keep) else \
            "elements outside the strided view were modified"
    if layout == "transposed":
        if values.dim() != 2:
            raise ValueError("layout 'transposed' needs a 2-D tensor")
        buf = values.t().contiguous()
        view = buf.t()
        return view, lambda: None
    raise ValueError(f"unknown layout {layout!r}")


def layout_shape(layout: str, numel: int):
    """The shape used for ``layout`` with about ``numel`` elements (2-D for transposed)."""
    if layout == "transposed":
        return (3, 5)
    return (numel,)
