"""Staging: turning caller tensors into the host buffers the core works on, and back.

The core (``flagos_shm._core``) takes raw addresses of contiguous host (CPU) memory plus an
element count and a dtype name. This module is the one place that turns a caller's tensor
into such a buffer and, after the collective, writes the result back into the caller's
tensor:

* a contiguous CPU tensor is used in place (no copy, any storage offset);
* a non-contiguous (or conjugate/negative-bit) CPU tensor goes through a contiguous copy that
  is written back with ``copy_`` afterwards;
* a tensor on any other device (``flagos``, ``cuda``, any PrivateUse1 device) is staged
  through pinned host memory (:class:`PinnedPool`): a non-blocking device-to-host copy on
  the tensor's current stream, a synchronisation of that stream only (so the collective
  sees the data, without synchronising the whole device), the collective on host memory,
  and a non-blocking host-to-device copy back on the same stream, which the caller's later
  work on that stream is ordered after. The pinned buffer returns to the pool with an event
  recorded after that copy and is reused only once the event has completed. Device type,
  streams and events come from ``torch.get_device_module(device.type)`` and ``torch.Stream``
  / ``torch.Event``, so the emulated flagos device, a real torch_fl device and CUDA take the
  same path;
* a complex tensor is handled as its ``torch.view_as_real`` floats (2 elements per value);
* an empty tensor gives a buffer of 0 elements (still a valid collective).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Optional

import torch
from torch.autograd.graph import increment_version as _increment_version

from . import _core, config

__all__ = ["CORE_DTYPES", "HostBuffer", "PinnedPool", "core_dtype", "check", "stage", "scratch", "pack",
           "unpack", "concat", "split_into", "copy_into", "finish", "pinned_pool", "stage_device"]

#: Element count from which torch splits a CPU copy over its intra-op threads
#: (``at::internal::GRAIN_SIZE``, aten/src/ATen/Parallel.h): :func:`copy_into` copies
#: such tensors itself.
_TORCH_GRAIN = 32768

#: torch dtype -> the core's dtype name: the core's own table (``_core.DTYPES``, in its
#: order, which the hierarchy's wire codes follow; ``rust/reduce/mod.rs``, ``DType::ALL``), whose
#: names are torch's. Complex dtypes are handled as their real component dtype
#: (``torch.view_as_real``).
CORE_DTYPES: dict[torch.dtype, str] = {getattr(torch, name): name for name in _core.DTYPES}

#: Stands for ``torch.no_grad()`` where nothing needs it (a tensor that does not require grad):
#: entering no_grad costs about 2 us.
_NO_GRAD_NEEDED = contextlib.nullcontext()

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

    __slots__ = ("tensor", "host", "ptr", "numel", "dtype", "torch_dtype", "_write_back", "_pinned", "_event",
                 "_stream")

    def __init__(self, tensor, host: torch.Tensor, dtype: str, write_back: bool,
                 pinned: Optional[torch.Tensor] = None, stream: Optional[torch.Stream] = None):
        self.tensor = tensor
        self.host = host
        self.ptr = host.data_ptr()
        self.torch_dtype = host.dtype
        self.numel = host.numel() * (2 if self.torch_dtype in _COMPLEX_TO_REAL else 1)
        self.dtype = dtype
        self._write_back = write_back
        self._pinned = pinned  # the pool's byte buffer behind ``host`` (device tensors only)
        self._event = None  # recorded after the host-to-device copy of ``finish``
        self._stream = stream  # the device stream current at staging (device tensors only)

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
        """Write the result back into the caller's tensor if it went through a copy.

        For a device tensor this enqueues a non-blocking host-to-device copy on the stream
        that was current when the tensor was staged (later work on that stream sees the
        result, also when this runs on the progress thread of an asynchronous collective)
        and records an event after it, which the pool waits for before reusing the pinned
        buffer.
        """
        if self._write_back:
            with torch.no_grad() if self.tensor.requires_grad else _NO_GRAD_NEEDED:
                if self._pinned is None:
                    copy_into(self.tensor, self.host)
                else:
                    with self._stream:
                        self.tensor.copy_(self.host, non_blocking=True)
                        self._event = self._stream.record_event()
            self._write_back = False


class _PinnedHostBuffer(HostBuffer):
    """A :class:`HostBuffer` in the pinned pool's memory (device tensors): returns that
    memory to the pool once nothing refers to the buffer any more (right after the call
    in CPython). A separate class so that CPU buffers, the per-call fast path, carry no
    finaliser."""

    __slots__ = ("_key",)

    def __del__(self):
        # The event orders the memory's reuse after any pending host-to-device copy from it.
        pinned = getattr(self, "_pinned", None)
        if pinned is not None:
            self._pinned = None
            pinned_pool().release(pinned, self._event, self.host, getattr(self, "_key", None))


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
    if tensor.is_meta:
        raise TypeError(f"{arg}: tensor is on the meta device and holds no data")
    if write and not tensor.is_contiguous() and any(
            s == 0 and n > 1 for s, n in zip(tensor.stride(), tensor.shape)):
        raise ValueError(f"{arg}: output tensor has overlapping elements (stride 0, e.g. from expand()); "
                         "pass a tensor that owns its memory")
    return dtype


def stage(tensor, arg: str, *, read: bool = True, write: bool = False) -> HostBuffer:
    """Return a contiguous host buffer for ``tensor``.

    Args:
        tensor: the caller's tensor (strided layout, any shape, any storage offset, any
            address: one that is not a multiple of the element size is copied too).
        arg: the argument's name, used in error messages (e.g. ``"tensors[0]"``).
        read: the collective reads the tensor's current values.
        write: the collective writes results that must land in ``tensor`` (call
            :meth:`HostBuffer.finish` afterwards).

    Raises:
        TypeError, ValueError: see :func:`check`.
        RuntimeError: the device runtime failed to allocate pinned memory or to copy.
    """
    dtype = check(tensor, arg, write=write)
    if not tensor.is_cpu:
        return stage_device(tensor, dtype, read, write)
    lazy = tensor.is_neg() or (tensor.dtype in _COMPLEX_TO_REAL and tensor.is_conj())
    aligned = tensor.data_ptr() % tensor.element_size() == 0
    if tensor.is_contiguous() and aligned and not lazy:
        return HostBuffer(tensor, tensor, dtype, write_back=False)
    # A copy: strided, lazily negated or conjugated, or at an address that is not a
    # multiple of the element size (a view of a byte buffer at an odd offset, say), which
    # the core refuses; torch.empty's memory is aligned (64 bytes).
    host = torch.empty(tensor.shape, dtype=tensor.dtype)
    if read:
        copy_into(host, tensor.resolve_conj().resolve_neg())
    return HostBuffer(tensor, host, dtype, write_back=write)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for two tensors of the same dtype and element count (the shapes
    may differ, as between a flat buffer block and a caller's tensor).

    When both are contiguous CPU tensors without lazy negation or conjugation, of at
    least :data:`_TORCH_GRAIN` elements, the bytes are copied by the core on this thread
    (``_core.copy_bytes``, GIL released), not by torch, whose CPU copy of that many
    elements runs on its intra-op thread pool: with several ranks on a node, each with
    such a pool (``mp.spawn`` leaves the default of one thread per CPU), the threads
    outnumber the CPUs and one copy of 1 MiB took 7.7 ms instead of 34 us on the AMD EPYC
    2-vCPU VM (docs/benchmark.md, "torch's copy threads"). Anything else (smaller copies,
    which torch runs on this thread, strided or device tensors, lazy bits) is
    ``dst.copy_(src)``. Either way ``dst``'s autograd version counter goes up.

    Raises:
        ValueError: the element counts differ (on the core's route; torch's own error
            otherwise).
    """
    numel = src.numel()
    if (numel >= _TORCH_GRAIN and dst.is_cpu and src.is_cpu and dst.dtype == src.dtype and dst.is_contiguous()
            and src.is_contiguous() and not (dst.is_neg() or src.is_neg() or dst.is_conj() or src.is_conj())):
        if dst.numel() != numel:
            raise ValueError(f"copy_into: dst has {dst.numel()} elements, src {numel}")
        _core.copy_bytes(dst.data_ptr(), src.data_ptr(), numel * src.element_size())
        # As copy_ does: autograd then sees that dst changed (a tensor saved for backward
        # and overwritten here raises at backward instead of giving a wrong gradient).
        _increment_version(dst)
        return
    dst.copy_(src)


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
            copy_into(buf.host[i * count: i * count + t.numel()], t.reshape(-1))
    return buf


def unpack(buf: HostBuffer, tensors, count: int) -> None:
    """Copy block i (``count`` elements apart, the first ``tensors[i].numel()`` of them) of
    ``buf`` into ``tensors[i]``; the inverse of :func:`pack`."""
    with torch.no_grad():
        for i, t in enumerate(tensors):
            copy_into(t, buf.host[i * count: i * count + t.numel()].view(t.shape))


def concat(tensors, dtype: torch.dtype) -> HostBuffer:
    """Copy ``tensors`` (flattened, of torch ``dtype``) back to back into a new host buffer."""
    buf = scratch(sum(t.numel() for t in tensors), dtype)
    at = 0
    with torch.no_grad():
        for t in tensors:
            copy_into(buf.host[at: at + t.numel()], t.reshape(-1))
            at += t.numel()
    return buf


def split_into(buf: HostBuffer, tensors) -> None:
    """Copy consecutive pieces of ``buf`` into ``tensors`` (each its own element count);
    the inverse of :func:`concat`."""
    at = 0
    with torch.no_grad():
        for t in tensors:
            copy_into(t, buf.host[at: at + t.numel()].view(t.shape))
            at += t.numel()


def finish(buffers) -> None:
    """Write results back into the callers' tensors for every buffer that went through a copy."""
    for buf in buffers:
        buf.finish()


# ---- device tensors: pinned host memory -----------------------------------------------------


def _accelerator_stream_getter():
    """``torch._C._accelerator_getStream`` (the current stream of an accelerator device index,
    as a C++ ``torch.Stream``; torch >= 2.6), or None. ``torch.accelerator.current_stream``
    wraps it with device normalisation in Python (3 us a call on the AMD EPYC VM); a device
    module's own ``current_stream`` may be slower still (the emulator's, written in Python:
    14 us)."""
    getter = getattr(torch._C, "_accelerator_getStream", None)
    accelerator = getattr(torch, "accelerator", None)
    if getter is None or accelerator is None or not hasattr(accelerator, "current_accelerator"):
        return None
    return getter


_GET_STREAM = _accelerator_stream_getter()


_accelerator_type: Optional[str] = None  # this process's accelerator, once torch has one


def _current_stream(device: torch.device) -> torch.Stream:
    """The current stream of ``device``: through torch's accelerator API when ``device`` is
    this process's accelerator (a C++ ``torch.Stream``: cheap to get, to synchronise, to
    record events on and to make current), else from its device module (``torch.cuda``,
    ``torch.flagos``, ...)."""
    global _accelerator_type
    if _GET_STREAM is not None and device.index is not None:
        if _accelerator_type is None:  # set once: a process's accelerator does not change
            accelerator = torch.accelerator.current_accelerator()
            _accelerator_type = accelerator.type if accelerator is not None else None
        if _accelerator_type == device.type:
            return _GET_STREAM(device.index)
    return torch.get_device_module(device.type).current_stream(device)


def stage_device(tensor: torch.Tensor, dtype: str, read: bool, write: bool) -> HostBuffer:
    """Stage a tensor on an accelerator through a pinned host buffer (see the module
    docstring); :func:`stage` calls it after its checks, the c10d adapter's digested
    allreduce directly (it has checked the tensor in C++). ``dtype`` is the core's name of
    the tensor's dtype.

    Per call: one pooled pinned buffer already shaped like ``tensor`` (the pool keeps the
    last view it made of each buffer), the current stream, and for an input the copy out and
    a synchronisation of that stream; no autograd bookkeeping unless the tensor requires
    grad."""
    pinned, host, key = pinned_pool().acquire_as(tensor.numel() * tensor.element_size(), tensor.dtype, tensor.shape)
    stream = _current_stream(tensor.device)
    if read and host.numel():
        # Enqueued on the tensor's current stream, after the work that produced it; a
        # non-contiguous source is gathered by the copy itself.
        src = tensor.resolve_conj().resolve_neg() if tensor.is_conj() or tensor.is_neg() else tensor
        if tensor.requires_grad:
            with torch.no_grad():
                host.copy_(src, non_blocking=True)
        else:
            host.copy_(src, non_blocking=True)
        stream.synchronize()  # this stream only, not the device
    buf = _PinnedHostBuffer(tensor, host, dtype, write_back=write, pinned=pinned, stream=stream)
    buf._key = key
    return buf


class PinnedPool:
    """Pinned (page-locked) host buffers reused across collectives.

    Buffers come from the device runtime's own host allocator
    (``torch.empty(..., pin_memory=True)``), are sized in powers of two (at least 64 KiB) so
    that a few sizes serve many calls, and grow on demand: a call holds as many pinned bytes
    as its device tensors have. Between calls the pool keeps at most ``limit_bytes`` of idle
    buffers (``FLAGOS_SHM_PINNED_POOL_BYTES``, default 256 MiB); idle buffers beyond that
    are freed, smallest first. Each idle buffer keeps the typed view last made of it
    (:meth:`acquire_as`), so a call that stages a tensor of the same dtype and shape as an
    earlier one (DDP's buckets, a training loop's metrics) gets it back without slicing and
    viewing again (several us a call). Thread-safe.

    Args:
        limit_bytes: bytes of idle buffers to keep (>= 0).
    """

    MIN_BYTES = 64 << 10

    def __init__(self, limit_bytes: int):
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes: expected >= 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        # [size, uint8 pinned tensor, event or None, view key or None, view or None], by size
        self._idle: list = []
        self._idle_bytes = 0
        # Given back but not yet in _idle: release() runs from HostBuffer.__del__, so also from
        # the garbage collector, at any allocation, on a thread that may hold _lock itself
        # (inside acquire): it appends here without the lock (deque.append is atomic) and
        # whoever holds the lock next moves the buffers into _idle (_settle).
        self._returned: collections.deque = collections.deque()
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        """Bytes of pinned buffers currently held for reuse."""
        with self._lock:
            self._settle()
            return self._idle_bytes

    def acquire_as(self, nbytes: int, dtype: torch.dtype, shape) -> tuple:
        """A pinned buffer of at least ``nbytes`` bytes and a view of its first ``nbytes``
        bytes as a tensor of ``dtype`` and ``shape`` (``nbytes`` must be their size):
        ``(buffer, view, key)``; give the buffer back with ``release(buffer, event, view,
        key)``. An idle buffer whose kept view has this dtype and shape is preferred."""
        key = (dtype, shape)
        entry = self._take(nbytes, key)
        if entry is None:
            size = max(self.MIN_BYTES, 1 << max(nbytes - 1, 0).bit_length())
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            return buf, buf[:nbytes].view(dtype).view(shape), key
        _, buf, event, old_key, view = entry
        if event is not None:
            event.synchronize()  # the host-to-device copy that last read it has finished
        if old_key != key:
            view = buf[:nbytes].view(dtype).view(shape)
        return buf, view, key

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 pinned tensor of at least ``nbytes`` bytes, free to overwrite."""
        entry = self._take(nbytes, None)
        if entry is None:
            size = max(self.MIN_BYTES, 1 << max(nbytes - 1, 0).bit_length())
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        if entry[2] is not None:
            entry[2].synchronize()
        return entry[1]

    def _take(self, nbytes: int, key) -> Optional[list]:
        """Remove and return the idle entry for a call of ``nbytes`` bytes: the smallest
        one that fits and keeps a view with ``key``, else the smallest that fits; None when
        none fits."""
        with self._lock:
            if self._returned:
                self._settle()
            fit = None
            for i, entry in enumerate(self._idle):
                if entry[0] >= nbytes:
                    if key is not None and entry[3] == key:
                        fit = i
                        break
                    if fit is None:
                        fit = i
                        if key is None:
                            break
            if fit is None:
                return None
            entry = self._idle.pop(fit)
            self._idle_bytes -= entry[0]
            return entry

    def release(self, buf: torch.Tensor, event=None, view=None, key=None) -> None:
        """Give ``buf`` back; ``event`` (if any) completes when the last copy from it did;
        ``view`` and ``key`` are what :meth:`acquire_as` handed out with it (kept for the
        next call of that dtype and shape). Never blocks: when the pool's lock is held (by
        another thread, or by this one when the garbage collector runs a finaliser inside
        :meth:`acquire`), the lock's holder or the next call files the buffer."""
        self._returned.append([buf.numel(), buf, event, key, view])
        if self._lock.acquire(blocking=False):
            try:
                self._settle()
            finally:
                self._lock.release()

    def _settle(self) -> None:
        """Under the lock: file the returned buffers by size, then free idle ones beyond
        ``limit_bytes``, smallest first."""
        if not self._returned:
            return
        while self._returned:
            entry = self._returned.popleft()
            self._idle.append(entry)
            self._idle_bytes += entry[0]
        self._idle.sort(key=lambda item: item[0])
        while self._idle and self._idle_bytes > self.limit_bytes:
            size, _, old_event, _, _ = self._idle.pop(0)
            if old_event is not None:
                old_event.synchronize()
            self._idle_bytes -= size


_pool: Optional[PinnedPool] = None
_pool_lock = threading.Lock()


def pinned_pool() -> PinnedPool:
    """The process-wide :class:`PinnedPool`, created on first use from
    ``FLAGOS_SHM_PINNED_POOL_BYTES``.

    Raises:
        ValueError: the variable is not a size (:func:`flagos_shm.config.parse_bytes`).
    """
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = PinnedPool(config.pinned_pool_bytes())
    return _pool
