"""Differences between the torch versions flagos_shm supports (2.10 to the newest), in one place.

Every version-dependent decision of the package reads a name from here instead of checking
``torch.__version__`` on its own.
"""

from __future__ import annotations

import torch
from torch._C import _distributed_c10d as _c10d

__all__ = ["TORCH_VERSION", "HAS_PY_BACKEND", "premul_factor"]


def _version(text: str) -> tuple:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


#: (major, minor, patch) of the running torch.
TORCH_VERSION: tuple = _version(torch.__version__)


def _can_subclass_backend() -> bool:
    """Whether a Python subclass of ``torch._C._distributed_c10d.Backend`` can be built
    (the ``PyBackend`` trampoline of torch >= 2.14; older torch: "No constructor defined")."""
    try:
        class _Probe(_c10d.Backend):
            def getBackendName(self):
                return "probe"

        _Probe(0, 1)
    except (TypeError, RuntimeError):
        return False
    return True


#: torch >= 2.14: a Python ``c10d.Backend`` subclass can be registered per device.
HAS_PY_BACKEND: bool = _can_subclass_backend()


def premul_factor(op):
    """PREMUL_SUM's factor (float or 1-element tensor) of a ``ReduceOp``.

    ``ReduceOp.factor`` is newer than torch 2.10; there the factor is read from the op's
    pickled state ``(RedOpType, factor)``.

    Raises:
        AttributeError: ``op`` carries no factor.
    """
    try:
        return op.factor
    except AttributeError:
        state = op.__getstate__() if hasattr(op, "__getstate__") else None
        if isinstance(state, tuple) and len(state) == 2 and state[1] is not None:
            return state[1]
        raise
