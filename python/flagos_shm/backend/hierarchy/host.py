"""Host buffers and reduction rules of a :class:`~flagos_shm.backend.hierarchy.HierarchicalComm`.

Every inter-node step works on host memory: the core ``Communicator`` interface hands raw
addresses, byte lengths, element counts and core dtype names, viewed here as 1-D tensors
(no copy). The reduction across levels follows the core's rules (``rust/reduce.rs``):
float16/bfloat16 accumulate in float32, integer AVG sums in int64.
"""

from __future__ import annotations

import ctypes

import torch

from ... import staging

SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM = range(9)
_TORCH = {name: dtype for dtype, name in staging.CORE_DTYPES.items()}

_FLOAT_OPS = {SUM: torch.add, PRODUCT: torch.mul, MIN: torch.minimum, MAX: torch.maximum,
              BAND: torch.bitwise_and, BOR: torch.bitwise_or, BXOR: torch.bitwise_xor}
_BOOL_OPS = {SUM: torch.logical_or, MAX: torch.logical_or, BOR: torch.logical_or, PRODUCT: torch.logical_and,
             MIN: torch.logical_and, BAND: torch.logical_and, BXOR: torch.logical_xor}


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of a contiguous tensor's elements (what the core is told the buffer holds)."""
    return t.numel() * t.element_size()


def _checked_view(arg: str, ptr: int, nbytes: int, numel: int, dtype: str) -> torch.Tensor:
    """:func:`_view` of ``numel`` elements of core dtype ``dtype`` at ``ptr``, after checking
    them against the buffer's ``nbytes``, as the core does for its own buffers.

    Raises:
        ValueError: ``numel`` elements do not fit in ``nbytes`` bytes (naming ``arg``).
    """
    tdt = _TORCH[dtype]
    need = numel * torch.empty((), dtype=tdt).element_size()
    if need > nbytes:
        raise ValueError(f"{arg}: {numel} elements of {dtype} need {need} bytes, the buffer has {nbytes}")
    return _view(ptr, numel, tdt)


def _view(ptr: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor over ``numel`` elements of ``dtype`` at host address ``ptr`` (no copy;
    the caller keeps the memory alive)."""
    if numel == 0 or ptr == 0:
        return torch.empty(0, dtype=dtype)
    size = numel * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * size).from_address(ptr), dtype=dtype)


def _acc_dtype(dtype: torch.dtype, op: int) -> torch.dtype:
    """The dtype a reduction accumulates in across levels (the core's rules)."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if op == AVG and not dtype.is_floating_point and dtype not in (torch.int64, torch.bool):
        return torch.int64  # integer AVG: the exact sum, then division rounding toward zero
    return dtype


def _combine(acc: torch.Tensor, other: torch.Tensor, op: int) -> None:
    """``acc = op(acc, other)`` elementwise, in place."""
    table = _BOOL_OPS if acc.dtype == torch.bool else _FLOAT_OPS
    table[op](acc, other, out=acc)
