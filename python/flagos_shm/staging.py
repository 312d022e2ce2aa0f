"""Staging: turning caller tensors into the host buffers the core works on, and back.

The core (``flagos_shm._core``) takes raw addresses of contiguous host (CPU) memory plus an
element count and a dtype name. This module is the one place that turns a caller's tensor
into such a buffer and, after the collective, writes the result back into the caller's
tensor:

* a contiguous CPU tensor is used in place (no copy, any storage offset);
* a non-contiguous (or conjugate/negative-bit) tensor goes through a contiguous copy that is
  written back with ``copy_`` afterwards;
* a complex tensor is handled as its ``torch.view_as_real`` floats (2 elements per value);
* an empty tensor gives a buffer of 0 elements (still a valid collective).

Tensors on other devices raise ``TypeError`` for now; the later device support adds a
pinned-host-memory branch in :func:`stage` (copy in before, copy out after the collective)
without changing the callers.
"""

from __future__ import annotations

import torch

__all__ = ["CORE_DTYPES", "HostBuffer", "core_dtype", "check", "stage", "scratch", "pack", "unpack", "finish"]

#: torch dtype -> the core's dtype name (see the core's API). Complex dtypes are handled as
#: their real component dtype (``torch.view_as_real``).
CORE_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
}

_COMPLEX_TO_REAL = {
    torch.complex32: torch.float16,
    torch.complex64: torch.float32,
    torch.complex128: torch.float64,
}


# Every accepted torch dtype -> the core dtype name its elements travel as.
_CORE_NAMES = {**CORE_DTYPES, **{c: CORE_DTYPES[r] for c, r in _COMPLEX_TO_REAL.items()}}


def core_dtype(dtype: torch.dtype, arg: str) -> str:
    """Return the core's name for ``dtype`` (complex: its real component dtype).

    Raises:
        TypeError: ``dtype`` is not supported (e.g. float8 types, uint16/32/64).
    """
    name = _CORE_NAMES.get(dtype)
    if name is None:
        supported = ", ".join(str(d).replace("torch.", "") for d in _CORE_NAMES)
        raise TypeError(f"{arg}: dtype {dtype} is not supported by flagos_shm; expected one of {supported}")
    return name


class HostBuffer:
    """A contiguous host buffer standing for one caller tensor during a collective.

    Attributes:
        tensor: the caller's tensor (``None`` for scratch buffers).
        host: contiguous CPU tensor in the caller's dtype and shape (the caller's tensor itself
            when no copy was needed).
        ptr: address of the first byte (may be 0 when ``numel`` is 0).
        numel: element count in the core dtype (a complex value counts as 2).
        dtype: the core's dtype name (``"float32"``, ...).
        torch_dtype: the caller tensor's dtype (complex stays complex), for validation.
    """

    __slots__ = ("tensor", "host", "ptr", "numel", "dtype", "torch_dtype", "_write_back")

    def __init__(self, tensor, host: torch.Tensor, dtype: str, write_back: bool):
        self.tensor = tensor
        self.host = host
        self.ptr = host.data_ptr()
        self.torch_dtype = host.dtype
        self.numel = host.numel() * (2 if self.torch_dtype in _COMPLEX_TO_REAL else 1)
        self.dtype = dtype
        self._write_back = write_back

    @property
    def flat(self) -> torch.Tensor:
        """1-D view of the buffer in the core dtype (what the core reads and writes)."""
        host = self.host
        return (torch.view_as_real(host) if host.is_complex() else host).reshape(-1)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.host.numel() * self.host.element_size()

    def overlaps(self, other: "HostBuffer") -> bool:
        """Whether the two buffers share any byte of memory."""
        mine, theirs = self.nbytes, other.nbytes
        return mine > 0 and theirs > 0 and self.ptr < other.ptr + theirs and other.ptr < self.ptr + mine

    def finish(self) -> None:
        """Write the result back into the caller's tensor if it went through a copy."""
        if self._write_back:
            with torch.no_grad():
                self.tensor.copy_(self.host)
            self._write_back = False


def check(tensor, arg: str, *, write: bool = False) -> str:
    """Validate a caller tensor and return the core's dtype name for it.

    Raises:
        TypeError: not a tensor, not strided, unsupported dtype, or not on the CPU.
        ValueError: ``write`` on a tensor whose elements overlap in memory (stride 0).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(tensor).__name__}")
    dtype = core_dtype(tensor.dtype, arg)
    if tensor.layout != torch.strided:
        raise TypeError(f"{arg}: expected a dense (strided) tensor, got layout {tensor.layout}")
    if not tensor.is_cpu:
        # Device tensors: a later issue stages them through pinned host memory in stage().
        raise TypeError(f"{arg}: tensor is on device '{tensor.device}'; flagos_shm supports CPU tensors only")
    if write and not tensor.is_contiguous() and any(
            s == 0 and n > 1 for s, n in zip(tensor.stride(), tensor.shape)):
        raise ValueError(f"{arg}: output tensor has overlapping elements (stride 0, e.g. from expand()); "
                         "pass a tensor that owns its memory")
    return dtype


def stage(tensor, arg: str, *, read: bool = True, write: bool = False) -> HostBuffer:
    """Return a contiguous host buffer for ``tensor``.

    Args:
        tensor: the caller's tensor (strided layout, any shape, any storage offset).
        arg: the argument's name, used in error messages (e.g. ``"tensors[0]"``).
        read: the collective reads the tensor's current values.
        write: the collective writes results that must land in ``tensor`` (call
            :meth:`HostBuffer.finish` afterwards).

    Raises:
        TypeError, ValueError: see :func:`check`.
    """
    dtype = check(tensor, arg, write=write)
    if tensor.is_contiguous() and not tensor.is_neg() and not (tensor.dtype in _COMPLEX_TO_REAL and tensor.is_conj()):
        return HostBuffer(tensor, tensor, dtype, write_back=False)
    if read:
        host = tensor.resolve_conj().resolve_neg().contiguous()
    else:
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
    return HostBuffer(tensor, host, dtype, write_back=write)


def scratch(numel: int, dtype: torch.dtype) -> HostBuffer:
    """A new contiguous host buffer of ``numel`` elements of torch ``dtype`` (uninitialised)."""
    return HostBuffer(None, torch.empty(numel, dtype=dtype), core_dtype(dtype, "scratch"), write_back=False)


def pack(tensors, count: int, dtype: torch.dtype | None = None) -> HostBuffer:
    """Copy ``tensors`` (flattened) into a new buffer of ``len(tensors)`` blocks of ``count``
    elements each, tensor i at block i; the rest of a block (padding) is left uninitialised.

    ``count`` is in elements of the tensors' dtype (``dtype``, default the first tensor's).
    """
    dtype = tensors[0].dtype if dtype is None else dtype
    buf = scratch(len(tensors) * count, dtype)
    with torch.no_grad():
        for i, t in enumerate(tensors):
            buf.host[i * count: i * count + t.numel()].copy_(t.reshape(-1))
    return buf


def unpack(buf: HostBuffer, tensors, count: int) -> None:
    """Copy block i (``count`` elements apart, the first ``tensors[i].numel()`` of them) of
    ``buf`` into ``tensors[i]``; the inverse of :func:`pack`."""
    with torch.no_grad():
        for i, t in enumerate(tensors):
            t.copy_(buf.host[i * count: i * count + t.numel()].view(t.shape))


def finish(buffers) -> None:
    """Write results back into the callers' tensors for every buffer that went through a copy."""
    for buf in buffers:
        buf.finish()
