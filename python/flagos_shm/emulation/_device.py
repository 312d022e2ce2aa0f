"""The ``torch.flagos`` device module of the emulated flagos device.

Registered by :func:`flagos_shm.emulation.enable` with
``torch._register_device_module("flagos", ...)``; do not import it for any
other purpose. It mirrors the parts of ``torch.cuda`` that PyTorch's generic
code (``torch.accelerator``, FSDP2, DDP, autocast, ``torch.random``) calls on
a device module.

Device and stream state lives in the C++ extension and is read through
``torch.ops.flagos_emu``; nothing here calls ``torch.accelerator``, which
itself calls this module (``torch.accelerator.device_count`` calls
:func:`device_count`).

The emulated devices run every operation synchronously on the host, so
streams and events only carry identities: ``synchronize`` returns at once,
``query`` is always True and ``elapsed_time`` measures host time between two
``record`` calls. Random numbers come from the host (CPU) default generator,
shared by all emulated devices: the seed functions here seed that generator.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Union

import torch

#: ``c10::DeviceType::PrivateUse1`` (c10/core/DeviceType.h).
_PRIVATEUSE1 = 20
_NAME = "flagos"

#: Marks this module as the emulator's, so that enable() can tell it from a
#: real vendor module registered under the same name.
_FLAGOS_SHM_EMULATED = True

_DeviceLike = Union[int, str, torch.device, None]


def _ops() -> Any:
    return torch.ops.flagos_emu


def _get_device_index(device: _DeviceLike = None, optional: bool = True) -> int:
    """Device index of ``device`` (int, "flagos", "flagos:1", torch.device).

    ``None`` and an index-less "flagos" mean the current device (when
    ``optional``). Raises TypeError for other types, ValueError for another
    device type or an index out of range.
    """
    if device is None:
        if not optional:
            raise ValueError("device: expected a flagos device or index, got None")
        return current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != _NAME:
            raise ValueError(f"device: expected a {_NAME} device, got {device}")
        index = current_device() if device.index is None else device.index
    elif isinstance(device, int) and not isinstance(device, bool):
        index = device
    else:
        raise TypeError(
            f"device: expected an int, str or torch.device, got {type(device).__name__}"
        )
    count = device_count()
    if not 0 <= index < count:
        raise ValueError(f"device: index {index} out of range, {count} flagos devices")
    return index


# ------------------------------------------------------------------ devices
def device_count() -> int:
    """Number of emulated flagos devices (set by enable())."""
    return int(_ops().device_count())


def is_available() -> bool:
    """True: the emulated devices are always available once enabled."""
    return True


_initialized = False


def is_initialized() -> bool:
    """Whether the device was "initialised" (set_device/init/_lazy_init called), like
    ``torch.cuda.is_initialized`` before first use. DeviceMesh selects the per-rank device
    (LOCAL_RANK, else rank % device_count) only while this is False."""
    return _initialized


def _lazy_init() -> None:
    """Mark the device initialised (nothing else to do)."""
    global _initialized
    _initialized = True


def init() -> None:
    """Mark the device initialised; for parity with ``torch.cuda.init``."""
    _lazy_init()


def _is_in_bad_fork() -> bool:
    """False: the emulator has no driver state that a fork could break."""
    return False


def current_device() -> int:
    """Index of this thread's current flagos device."""
    return int(_ops().current_device())


def set_device(device: _DeviceLike) -> None:
    """Make ``device`` this thread's current flagos device.

    Raises ValueError/TypeError as :func:`_get_device_index`.
    """
    _ops().set_device(_get_device_index(device))
    _lazy_init()


class device:
    """Context manager that makes ``device`` current and restores the old one.

    ``device`` may be an int, "flagos:N", a torch.device or None (no-op);
    a negative int is also a no-op, as in ``torch.cuda.device``.
    """

    def __init__(self, device: _DeviceLike) -> None:
        if device is None or (isinstance(device, int) and device < 0):
            self.idx = -1
        else:
            self.idx = _get_device_index(device)
        self.prev_idx = -1

    def __enter__(self) -> "device":
        if self.idx >= 0:
            self.prev_idx = current_device()
            _ops().set_device(self.idx)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.idx >= 0:
            _ops().set_device(self.prev_idx)


class device_of(device):
    """Context manager that makes the device of tensor ``obj`` current."""

    def __init__(self, obj: torch.Tensor) -> None:
        super().__init__(obj.device if obj.device.type == _NAME else None)


def synchronize(device: _DeviceLike = None) -> None:
    """Wait for all work on ``device``: returns at once (work is synchronous).

    The argument is still validated (ValueError/TypeError).
    """
    _get_device_index(device)


def get_device_name(device: _DeviceLike = None) -> str:
    _get_device_index(device)
    return "flagos (emulated by flagos_shm)"


def get_amp_supported_dtype() -> list[torch.dtype]:
    """Dtypes accepted by ``torch.autocast("flagos", dtype=...)``.

    Autocast on flagos does not cast (AutocastPrivateUse1 is a fallthrough),
    so ops run in the dtypes of their inputs.
    """
    return [torch.float16, torch.bfloat16, torch.float32]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# ------------------------------------------------------------------ streams
class Stream(torch.Stream):
    """A flagos stream (a ``torch.Stream`` with device type flagos).

    Args:
        device: device of the stream (default: current device).
        priority: kept as the ``priority`` attribute; 0 or negative as in
            ``torch.cuda.Stream``. It has no effect (work is synchronous).

    The keyword form ``Stream(stream_id=, device_index=, device_type=)``
    wraps an existing stream, as ``torch.Stream`` does.
    """

    def __new__(cls, device: _DeviceLike = None, priority: int = 0, **kwargs: Any) -> "Stream":
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority: expected an int, got {type(priority).__name__}")
        if kwargs:
            if device is not None or set(kwargs) - {"stream_id", "device_index", "device_type"}:
                raise TypeError(
                    "Stream: give either device/priority or all of "
                    "stream_id, device_index, device_type"
                )
            obj = super().__new__(cls, **kwargs)
        else:
            index = _get_device_index(device)
            obj = super().__new__(
                cls,
                stream_id=int(_ops().new_stream()),
                device_index=index,
                device_type=_PRIVATEUSE1,
            )
        obj.priority = priority
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # all done in __new__
        pass

    def record_event(self, event: Optional["Event"] = None) -> "Event":
        """Record ``event`` (a new one if None) on this stream and return it."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def __enter__(self) -> "Stream":
        ctx = StreamContext(self)
        ctx.__enter__()
        self.__dict__.setdefault("_contexts", []).append(ctx)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.__dict__["_contexts"].pop().__exit__(*exc_info)


def _wrap(stream_id: int, index: int) -> Stream:
    return Stream(stream_id=stream_id, device_index=index, device_type=_PRIVATEUSE1)


def current_stream(device: _DeviceLike = None) -> Stream:
    """This thread's current stream on ``device`` (default: current device)."""
    index = _get_device_index(device)
    return _wrap(int(_ops().current_stream(index)), index)


def default_stream(device: _DeviceLike = None) -> Stream:
    """The default stream (id 0) of ``device``."""
    return _wrap(0, _get_device_index(device))


def set_stream(stream: torch.Stream) -> None:
    """Make ``stream`` current on its device for this thread."""
    _check_stream(stream)
    _ops().exchange_stream(stream.device_index, stream.stream_id)


def _check_stream(stream: Any) -> None:
    if not isinstance(stream, torch.Stream):
        raise TypeError(f"stream: expected a torch.Stream, got {type(stream).__name__}")
    if stream.device_type != _PRIVATEUSE1:
        raise ValueError(f"stream: expected a {_NAME} stream, got {stream}")


class StreamContext:
    """Context manager that makes ``stream`` current (and its device current).

    ``None`` makes it a no-op, as ``torch.cuda.StreamContext``.
    """

    def __init__(self, stream: Optional[torch.Stream]) -> None:
        if stream is not None:
            _check_stream(stream)
        self.stream = stream
        self._saved: list[tuple[int, int]] = []
        self._prev_device = -1

    def __enter__(self) -> Optional[torch.Stream]:
        s = self.stream
        if s is not None:
            self._prev_device = current_device()
            ops = _ops()
            if s.device_index != self._prev_device:
                # Also remember the current stream of the previous device, as
                # torch.cuda.StreamContext does.
                old = int(ops.current_stream(self._prev_device))
                self._saved.append((self._prev_device, old))
                ops.set_device(s.device_index)
            old = int(ops.exchange_stream(s.device_index, s.stream_id))
            self._saved.append((s.device_index, old))
        return s

    def __exit__(self, *exc_info: object) -> None:
        if self.stream is not None:
            ops = _ops()
            while self._saved:
                index, stream_id = self._saved.pop()
                ops.exchange_stream(index, stream_id)
            ops.set_device(self._prev_device)


def stream(stream: Optional[torch.Stream]) -> StreamContext:
    """``with torch.flagos.stream(s):`` runs the block with ``s`` current."""
    return StreamContext(stream)


# ------------------------------------------------------------------- events
class Event(torch.Event):
    """A flagos event (a ``torch.Event`` with device type flagos).

    Signature as ``torch.cuda.Event``. ``record`` stores the host time;
    ``elapsed_time`` returns milliseconds between two recorded events;
    ``query`` is True; ``wait`` and ``synchronize`` return at once.
    """

    def __new__(
        cls,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        device: _DeviceLike = None,
    ) -> "Event":
        index = _get_device_index(device)
        return super().__new__(
            cls,
            device=torch.device(_NAME, index),
            enable_timing=enable_timing,
            blocking=blocking,
            interprocess=interprocess,
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # all done in __new__
        pass

    def record(self, stream: Optional[torch.Stream] = None) -> None:
        if stream is None:
            stream = current_stream(self.device.index)
        _check_stream(stream)
        super().record(stream)
        self.__dict__["_recorded_at"] = time.perf_counter()

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds of host time from recording this event to ``end_event``.

        Raises TypeError when ``end_event`` is not a flagos ``Event`` and
        RuntimeError when either event was not recorded.
        """
        # torch.Event.elapsed_time accepts only exact torch.Event objects, so
        # the host timestamps are also kept here.
        if not isinstance(end_event, Event):
            raise TypeError(
                f"end_event: expected a torch.flagos.Event, got {type(end_event).__name__}"
            )
        start = self.__dict__.get("_recorded_at")
        end = end_event.__dict__.get("_recorded_at")
        if start is None or end is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end - start) * 1000.0

    def wait(self, stream: Optional[torch.Stream] = None) -> None:
        if stream is None:
            stream = current_stream(self.device.index)
        _check_stream(stream)
        super().wait(stream)


# ------------------------------------------------------------------ memory
# The emulator's device allocator (csrc/flagos_emu.cpp) hands out exactly the
# bytes a storage asks for (no rounding, no caching): a tensor of ``nbytes``
# raises memory_allocated by ``nbytes`` and its free lowers it again, and
# reserved memory always equals allocated memory.

#: Names of the allocator's statistics, in the order ``flagos_emu.memory_stats`` returns them.
_STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
               "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
_STAT_FIELDS = ("current", "peak", "allocated", "freed")


def memory_stats(device: _DeviceLike = None) -> dict[str, int]:
    """Allocator statistics of ``device``, keyed as ``torch.cuda.memory_stats``
    (``"allocated_bytes.all.current"`` etc.; only the ``all`` pool)."""
    raw = [int(v) for v in _ops().memory_stats(_get_device_index(device))]
    stats: dict[str, int] = {}
    for i, name in enumerate(_STAT_NAMES):
        for j, field in enumerate(_STAT_FIELDS):
            stats[f"{name}.all.{field}"] = raw[4 * i + j]
    stats["num_device_alloc"], stats["num_device_free"] = raw[-2], raw[-1]
    stats["num_alloc_retries"] = stats["num_ooms"] = 0
    return dict(sorted(stats.items()))


def memory_allocated(device: _DeviceLike = None) -> int:
    """Bytes held by live flagos tensors on ``device``."""
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: _DeviceLike = None) -> int:
    """Peak of :func:`memory_allocated` since start or the last peak reset."""
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device: _DeviceLike = None) -> int:
    """Bytes reserved by the allocator: equal to :func:`memory_allocated` (no cache)."""
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device: _DeviceLike = None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: _DeviceLike = None) -> None:
    """Set every peak statistic of ``device`` to its current value."""
    _ops().reset_peak_memory_stats(_get_device_index(device))


def reset_max_memory_allocated(device: _DeviceLike = None) -> None:
    """Same as :func:`reset_peak_memory_stats` (as in ``torch.cuda``)."""
    reset_peak_memory_stats(device)


def reset_max_memory_cached(device: _DeviceLike = None) -> None:
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device: _DeviceLike = None) -> None:
    """Zero the accumulated (``allocated``/``freed``) counts of ``device``."""
    _ops().reset_accumulated_memory_stats(_get_device_index(device))


def empty_cache() -> None:
    """Release cached memory: nothing to do, the allocator caches nothing."""


def mem_get_info(device: _DeviceLike = None) -> tuple[int, int]:
    """(free, total) bytes: host RAM, since device memory is host memory."""
    free, total = _ops().mem_get_info(_get_device_index(device))
    return int(free), int(total)


# --------------------------------------------------------------------- RNG
# All emulated devices run random ops on the host and draw from the CPU
# default generator, so these functions act on torch.default_generator.
def manual_seed(seed: int) -> None:
    """Seed the (shared, host) generator of the emulated devices."""
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Same as :func:`manual_seed`: all emulated devices share one generator."""
    manual_seed(seed)


def seed() -> None:
    """Seed the shared generator with a non-deterministic random number."""
    torch.default_generator.seed()


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def get_rng_state(device: _DeviceLike = _NAME) -> torch.Tensor:
    """State of the shared generator as a uint8 CPU tensor."""
    _get_device_index(device)
    return torch.default_generator.get_state()


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state(new_state: torch.Tensor, device: _DeviceLike = _NAME) -> None:
    _get_device_index(device)
    torch.default_generator.set_state(new_state)


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def __getattr__(name: str) -> Any:
    if name == "default_generators":
        # One entry per device, all the shared host generator.
        return tuple(torch.default_generator for _ in range(device_count()))
    raise AttributeError(f"module 'torch.{_NAME}' has no attribute {name!r}")
