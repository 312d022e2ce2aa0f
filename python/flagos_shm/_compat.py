"""Differences between the torch versions flagos_shm supports (2.10 to 2.15), in one place.

Every version-dependent decision of the package is made here. The c10d adapter itself
(``backend/csrc/c10d_adapter.cpp``) is one source for every torch: it overrides only the
``c10d::Backend`` virtuals torch 2.10 has, under their 2.10 names, which newer torch forwards
its renamed ones to. What differs in torch's Python layer is decided from what the installed
function does (its code), not from its version number, since the changes landed between
releases that were not all tested:

======================  =====  =====  ========================================================
name                    2.10   2.15   what differs
======================  =====  =====  ========================================================
TORCH_VERSION           (2,10) (2,15) ``(major, minor, patch)`` of the running torch
premul_factor(op)       state  attr   PREMUL_SUM's factor: ``ReduceOp.factor`` (newer than
                                      2.10), else the pickled state ``(RedOpType, factor)``
SPLIT_GROUP_ON_CUDA     True   False  ``dist.split_group`` looks the parent's backend up on
                                      ``cuda`` only (newer: the current accelerator, or CPU)
MONITORED_BARRIER_GLOO  True   False  ``dist.monitored_barrier`` refuses every group whose
                                      backend string is not ``"gloo"`` (newer: every group
                                      with a CPU backend)
UNDEFINED_DEFAULT_GLOO  True   False  a group made without a backend name gets the default
                                      backend type GLOO (NCCL where mapped) whatever its
                                      device map holds (newer: the type of a backend the
                                      map names)
======================  =====  =====  ========================================================

:mod:`flagos_shm.backend.torch_patches` patches the three functions where the installed torch
behaves the old way, for flagos_shm's groups only.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed.distributed_c10d as c10d

__all__ = ["TORCH_VERSION", "MIN_TORCH_VERSION", "MAX_TESTED_TORCH_VERSION", "SPLIT_GROUP_ON_CUDA",
           "MONITORED_BARRIER_GLOO", "UNDEFINED_DEFAULT_GLOO", "premul_factor"]


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
#: Lowest torch tested (pyproject's ``torch>=`` floor; ``.ci/run`` runs the suite on it).
MIN_TORCH_VERSION: tuple = (2, 10, 0)
#: Newest torch minor release tested (``.ci/run`` runs the suite on the newest torch).
MAX_TESTED_TORCH_VERSION: tuple = (2, 15)


def _names(fn) -> tuple:
    """The global and attribute names a function's code uses (under torch's logging
    decorators, which wrap it with ``functools.wraps``)."""
    return getattr(getattr(inspect.unwrap(fn), "__code__", None), "co_names", ())


#: torch's ``split_group`` picks the parent's backend with ``_get_backend(torch.device("cuda"))``
#: (2.10; later torch asks for the current accelerator, then CPU).
SPLIT_GROUP_ON_CUDA: bool = hasattr(c10d, "split_group") and "current_accelerator" not in _names(c10d.split_group)
#: torch's ``monitored_barrier`` compares the group's backend name with ``"gloo"`` (2.10;
#: later torch accepts any group with a CPU backend).
MONITORED_BARRIER_GLOO: bool = "GLOO" in _names(c10d.monitored_barrier)
#: torch's ``_new_process_group_helper`` sets the default backend type of a group made
#: without a backend name to GLOO (or NCCL), not from its device map (2.10; later torch asks
#: ``_get_default_backend_type_for_backend_config``).
UNDEFINED_DEFAULT_GLOO: bool = "_get_default_backend_type_for_backend_config" not in _names(
    c10d._new_process_group_helper)


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
