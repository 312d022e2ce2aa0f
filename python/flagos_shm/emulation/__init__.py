"""An emulated ``flagos`` accelerator: a test double for a vendor plugin.

On real FlagOS machines the vendor plugin renames PyTorch's PrivateUse1
backend to ``"flagos"`` and registers ``torch.flagos``. :func:`enable` does the
same on any machine with a C++ compiler, backed by host memory, so that code
paths that see ``tensor.device.type == "flagos"`` (process groups, DDP, FSDP2,
pinned-memory staging) can be tested without the hardware. It is not part of
the flagos_shm transport.

What it gives (after ``enable(n)``):

* devices ``flagos:0`` .. ``flagos:{n-1}``; memory is host memory from a
  ``c10::DeviceAllocator`` (so ``torch.accelerator.memory_allocated`` etc.
  work); copies between CPU and flagos and between flagos devices;
* every other ATen op through ``at::native::cpu_fallback`` (the op runs on
  CPU copies of the inputs), so models train with CPU-identical results;
* pinned host memory (``torch.empty(..., pin_memory=True)``,
  ``t.pin_memory()``, ``t.is_pinned()``) from an ``at::HostAllocator``;
* ``untyped_storage().resize_()`` on flagos storage (as FSDP2 does);
* ``torch.flagos`` with devices, streams, events, seeds, memory statistics (see
  :mod:`flagos_shm.emulation._device`); ``torch.accelerator`` reports flagos.

Limits: all work is synchronous (streams and events only carry identities);
random numbers come from the CPU default generator, shared by all emulated
devices; autocast on flagos does not cast; ops with no CPU kernel fail as on
CPU. Enabling is process-wide and cannot be undone.

The C++ part (``csrc/flagos_emu.cpp``) is compiled with the system C++
compiler on first use (10 to 20 s on 2 busy cores) and cached under
``$FLAGOS_SHM_CACHE_DIR`` (default ``$XDG_CACHE_HOME/flagos_shm`` or
``~/.cache/flagos_shm``), keyed by the source, the compiler flags, and the
torch and Python versions.

Environment:
    FLAGOS_SHM_EMULATE_DEVICES: device count used when ``enable()`` gets
        none (default 8).
    FLAGOS_SHM_CACHE_DIR: where the compiled extension is cached.
    CXX: the C++ compiler (default ``c++``).
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch

__all__ = ["enable", "is_enabled", "build", "DEFAULT_DEVICE_COUNT", "MAX_DEVICE_COUNT"]

#: Device count when neither the argument nor FLAGOS_SHM_EMULATE_DEVICES gives one.
DEFAULT_DEVICE_COUNT = 8
#: Largest device count (kMaxDevices in csrc/flagos_emu.cpp).
MAX_DEVICE_COUNT = 64

_NAME = "flagos"
_LIB_NAME = "flagos_shm_emulation"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "flagos_emu.cpp")
_ENV_DEVICES = "FLAGOS_SHM_EMULATE_DEVICES"

_lock = threading.Lock()
_enabled = False
_loaded = False


def is_enabled() -> bool:
    """True when this process enabled the emulated flagos device."""
    return _enabled


def _resolve_device_count(device_count: Optional[int]) -> int:
    if device_count is None:
        raw = os.environ.get(_ENV_DEVICES, "").strip()
        if not raw:
            return DEFAULT_DEVICE_COUNT
        try:
            device_count = int(raw)
        except ValueError:
            raise ValueError(
                f"{_ENV_DEVICES}: expected an integer in [1, {MAX_DEVICE_COUNT}], got {raw!r}"
            ) from None
        source = _ENV_DEVICES
    else:
        if not isinstance(device_count, int) or isinstance(device_count, bool):
            raise TypeError(
                f"device_count: expected an int, got {type(device_count).__name__}"
            )
        source = "device_count"
    if not 1 <= device_count <= MAX_DEVICE_COUNT:
        raise ValueError(
            f"{source}: expected an integer in [1, {MAX_DEVICE_COUNT}], got {device_count}"
        )
    return device_count


def build(verbose: bool = False) -> str:
    """Compile the C++ part if no cached build matches; return the .so path.

    :func:`flagos_shm._cxx.build` does the work: the system C++ compiler run on the one
    source file, cached per source, compile command, torch build and Python; concurrent
    callers (several ranks) wait for one build; a killed build never leaves a partial
    library under the cached name. Loads nothing. ``verbose`` is accepted for compatibility
    and ignored (the command is in the cache directory's ``build.log``).

    Raises:
        flagos_shm._cxx.BuildError (a RuntimeError): no compiler, a torch without headers, or
            the compile failed (with the compiler's output).
        OSError: the cache directory cannot be written.
    """
    from .. import _cxx

    return _cxx.build(_SOURCE, _LIB_NAME, what="flagos emulation (the emulated device's C++ part)",
                      python_module=False, headers=("c10/core/CachingDeviceAllocator.h",), optimize="-O1")


def _privateuse1_taken_by_others() -> bool:
    """True when another extension registered PrivateUse1 kernels."""
    if _loaded:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::empty.memory_format", "PrivateUse1"
    ) or torch._C._dispatch_has_backend_fallback(torch._C.DispatchKey.PrivateUse1)


def _generate_methods() -> None:
    # Skip what exists (e.g. generated by whoever renamed PrivateUse1 first):
    # torch refuses to generate a method twice.
    from torch.nn.utils.rnn import PackedSequence

    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=not hasattr(torch.Tensor, f"is_{_NAME}"),
        for_module=not hasattr(torch.nn.Module, _NAME),
        for_packed_sequence=not hasattr(PackedSequence, f"is_{_NAME}"),
        for_storage=not hasattr(torch.storage._StorageBase, f"is_{_NAME}"),
    )


def enable(device_count: Optional[int] = None) -> bool:
    """Register the emulated ``flagos`` device in this process.

    Steps: compile/load the C++ extension (cached, see :func:`build`), rename
    PrivateUse1 to ``"flagos"`` before loading it, set the device count,
    register ``torch.flagos`` and generate ``Tensor.flagos()``,
    ``Tensor.is_flagos``, ``Module.flagos()`` and the storage methods.

    Args:
        device_count: number of devices, 1..MAX_DEVICE_COUNT (64). None: the
            integer in $FLAGOS_SHM_EMULATE_DEVICES, else 8. Fixed by the first
            successful call; later calls do not change it.

    Returns:
        True when the emulated device is enabled (now or by an earlier call);
        False, changing nothing, when a real flagos device is already
        registered (PrivateUse1 is named "flagos" and ``torch.flagos`` or the
        PrivateUse1 kernels belong to someone else).

    Raises:
        TypeError / ValueError: bad ``device_count`` or environment value.
        RuntimeError: PrivateUse1 is already taken by another backend name or
            extension, or the C++ part failed to compile (no compiler,
            unsupported torch).

    Not thread-safe against other code renaming PrivateUse1 concurrently;
    safe to call from several threads.
    """
    global _enabled, _loaded
    count = _resolve_device_count(device_count)
    with _lock:
        if _enabled:
            return True
        from . import _device

        name = torch._C._get_privateuse1_backend_name()
        module = getattr(torch, _NAME, None)
        if name == _NAME:
            if module is not None and not getattr(module, "_FLAGOS_SHM_EMULATED", False):
                return False
            if module is None and _privateuse1_taken_by_others():
                return False
        elif name != "privateuseone":
            raise RuntimeError(
                f"flagos emulation: PrivateUse1 is already registered as {name!r}; "
                "cannot emulate flagos in this process"
            )
        elif _privateuse1_taken_by_others():
            raise RuntimeError(
                "flagos emulation: another extension already registered PrivateUse1 kernels"
            )
        library = build()
        if name != _NAME:
            torch.utils.rename_privateuse1_backend(_NAME)
        if not _loaded:
            torch.ops.load_library(library)
            _loaded = True
        torch.ops.flagos_emu.set_device_count(count)
        if module is None:
            torch._register_device_module(_NAME, _device)
        _generate_methods()
        _enabled = True
        return True
