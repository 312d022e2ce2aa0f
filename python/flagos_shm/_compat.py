"""Differences between the torch versions flagos_shm supports (2.10 to 2.15), in one place.

Every version-dependent decision of the package reads a name from here instead of checking
``torch.__version__`` or probing torch on its own. Tested on 2.10 (``.ci/compat``) and on the
torch the README installs (``.ci/run``).

=================  =====  =====  ==========================================================
name               2.10   2.15   what differs
=================  =====  =====  ==========================================================
TORCH_VERSION      (2,10) (2,15) ``(major, minor, patch)`` of the running torch
HAS_PY_BACKEND     False  True   a Python subclass of ``c10d.Backend`` can be constructed
                                 (the ``PyBackend`` trampoline, torch >= 2.14)
premul_factor(op)  state  attr   PREMUL_SUM's factor: ``ReduceOp.factor`` (newer than 2.10),
                                 else the pickled state ``(RedOpType, factor)``
=================  =====  =====  ==========================================================

The emulated device's C++ part (``emulation/csrc/flagos_emu.cpp``) compiles unchanged on 2.10
and 2.15; a version guard there would use ``TORCH_VERSION_MAJOR``/``TORCH_VERSION_MINOR``
(``torch/version.h``) and be listed here too.
"""

from __future__ import annotations

import torch

__all__ = ["TORCH_VERSION", "MIN_TORCH_VERSION", "HAS_PY_BACKEND", "premul_factor"]


def _version(text: str) -> tuple:
    """``"2.10.0+cu128"`` -> ``(2, 10, 0)``; pre-release tags keep their leading digits."""
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)


#: ``(major, minor, patch)`` of the running torch.
TORCH_VERSION: tuple = _version(torch.__version__)

#: Lowest torch tested (pyproject's ``torch>=`` floor).
MIN_TORCH_VERSION: tuple = (2, 10, 0)


def _can_subclass_backend() -> bool:
    """Whether a Python subclass of ``torch._C._distributed_c10d.Backend`` can be constructed
    (torch >= 2.14; older torch raises ``TypeError: No constructor defined!``). Tested by
    feature, not by version, so a backport or a build without distributed answers truly."""
    try:
        from torch._C import _distributed_c10d as c10d

        class _Probe(c10d.Backend):
            def getBackendName(self) -> str:
                return "flagos_shm_probe"

        _Probe(0, 1)
    except (ImportError, AttributeError, TypeError, RuntimeError):
        return False
    return True


#: True where ``import flagos_shm`` can register a per-device Python ``c10d.Backend``.
HAS_PY_BACKEND: bool = _can_subclass_backend()


def premul_factor(op):
    """PREMUL_SUM's factor (a float or a 1-element tensor) of a ``ReduceOp``.

    ``ReduceOp.factor`` is newer than torch 2.10; there the factor is read from the op's
    pickled state ``(RedOpType, factor)`` (``ReduceOp.__getstate__``), which both versions
    have.

    Raises:
        AttributeError: ``op`` carries no factor (a bare ``RedOpType``, an int, a ReduceOp
            that is not PREMUL_SUM).
    """
    try:
        return op.factor
    except (AttributeError, RuntimeError):
        pass
    getstate = getattr(op, "__getstate__", None)
    state = getstate() if callable(getstate) else None
    if isinstance(state, tuple) and len(state) == 2 and state[1] is not None:
        return state[1]
    raise AttributeError(f"{op!r} carries no PREMUL_SUM factor")
