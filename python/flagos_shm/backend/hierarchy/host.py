"""Host buffers and reduction rules of a :class:`~flagos_shm.backend.hierarchy.HierarchicalComm`.

Every inter-node step works on host memory: the core ``Communicator`` interface hands raw
addresses, byte lengths, element counts and core dtype names, viewed here as 1-D tensors
(no copy). The reduction across levels follows the core's rules (``rust/reduce/mod.rs``):
float16/bfloat16 accumulate in float32, integer AVG sums in int64.

The leaders' combinations, conversions and copies run on the calling thread through the
core (:func:`_reduce_into`, :func:`_convert`, :func:`_clone`: ``_core.reduce_into``,
``_core.convert_into``, :func:`staging.copy_into`), not through torch, which splits an
element-wise op or copy of 32768 elements or more over its intra-op thread pool: with
several ranks on a node, each with such a pool, the threads outnumber the CPUs
(docs/benchmark.md, "torch's copy threads").
"""

from __future__ import annotations

import ctypes

import torch

from ... import _core, staging

_TORCH = {name: dtype for dtype, name in staging.CORE_DTYPES.items()}


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
    """The dtype a reduction of ``dtype`` by ``op`` (a ``REDUCE_OPS`` code) is carried in across
    levels, so that reducing within each node and then across nodes gives what one level gives:
    the core's rule (``_core.CARRY_DTYPES``, ``DType::carried_in`` in ``rust/reduce/mod.rs``)."""
    return _TORCH[_core.CARRY_DTYPES[staging.CORE_DTYPES[dtype]][op]]


def _reduce_into(dst: torch.Tensor, srcs, op: int, factor: float = 1.0, world: int = 1) -> None:
    """``dst = srcs[0] op srcs[1] op ...`` elementwise, in list order, by the core's kernels
    (``_core.reduce_into``, GIL released): AVG divides the sum by ``world``, PREMUL_SUM
    scales each source by ``factor`` first; bool SUM/MAX are logical or, PRODUCT/MIN
    logical and. ``dst`` and every source: contiguous 1-D host tensors of one core dtype
    and element count; ``dst`` may be one of the sources.

    Raises:
        ValueError: buffers that do not fit (naming ``dst`` / ``srcs[i]``).
        TypeError: an op the dtype does not take (e.g. BAND on floats).
    """
    _core.reduce_into(dst.data_ptr(), _nbytes(dst), [s.data_ptr() for s in srcs], [_nbytes(s) for s in srcs],
                      dst.numel(), staging.CORE_DTYPES[dst.dtype], op, factor, world)


def _convert(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for contiguous 1-D host tensors of one element count, on this
    thread: the same dtype by :func:`staging.copy_into`, a type and its accumulation type
    (float16/bfloat16 and float32, int8/uint8/int16/int32 and int64) by
    ``_core.convert_into`` (rounding to nearest even, truncating integers, as torch; only
    a NaN's payload may differ from torch's).

    Raises:
        ValueError: the element counts differ.
    """
    if dst.dtype == src.dtype:
        staging.copy_into(dst, src)
        return
    if dst.numel() != src.numel():
        raise ValueError(f"convert: dst has {dst.numel()} elements, src {src.numel()}")
    _core.convert_into(dst.data_ptr(), _nbytes(dst), staging.CORE_DTYPES[dst.dtype], src.data_ptr(), _nbytes(src),
                       staging.CORE_DTYPES[src.dtype], src.numel())


def _clone(x: torch.Tensor, dtype=None) -> torch.Tensor:
    """A new contiguous copy of the 1-D host tensor ``x`` (converted to ``dtype``, one of
    :func:`_convert`'s pairs), made on this thread."""
    out = torch.empty(x.numel(), dtype=x.dtype if dtype is None else dtype)
    if x.numel():
        _convert(out, x)
    return out
