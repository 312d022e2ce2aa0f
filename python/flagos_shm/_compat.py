"""Differences between the torch versions flagos_shm supports (2.10 to 2.15), in one place,
and the only module that changes torch's own functions.

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
======================  =====  =====  ========================================================

:func:`install` (called by ``import flagos_shm``) patches the two functions where the installed
torch behaves the old way, for flagos_shm's groups only; every other call goes to torch's
function unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["TORCH_VERSION", "MIN_TORCH_VERSION", "MAX_TESTED_TORCH_VERSION", "SPLIT_GROUP_ON_CUDA",
           "MONITORED_BARRIER_GLOO", "premul_factor", "install"]


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


# ---- patches of torch's functions --------------------------------------------------------


def _serves(pg, device: str) -> bool:
    """Whether flagos_shm serves ``device`` tensors of process group ``pg``."""
    from .backend.adapter import shm_part

    return shm_part(pg, device) is not None


def _patch_split_group() -> None:
    """torch's ``split_group`` on a parent bound to a device that flagos_shm serves: look the
    backends up on that device where torch says ``cuda``.

    torch 2.10 finds the parent's backend (and the child's, to set its sequence number) with
    ``_get_backend(torch.device("cuda"))``; for a parent without a CUDA backend (a ``flagos``
    group) that raises "No backend type associated with device type cuda" before anything
    happens. During a call whose parent is bound to a device flagos_shm serves, such lookups
    on a group without a CUDA backend return the backend of the bound device instead; the rest
    is torch's own function.
    """
    original = c10d.split_group
    if getattr(original, "_flagos_shm", False):
        return
    cls = torch._C._distributed_c10d.ProcessGroup
    lock = threading.Lock()

    @functools.wraps(original)
    def split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, **kwargs):
        parent = parent_pg if parent_pg is not None else (c10d._get_default_group() if dist.is_initialized() else None)
        bound = c10d._get_default_group().bound_device_id if dist.is_initialized() else None
        if parent is None or bound is None or not _serves(parent, bound.type):
            return original(parent_pg, split_ranks, timeout, pg_options, group_desc, **kwargs)
        if pg_options is None:  # torch would deepcopy the parent's options (not copyable on 2.10)
            options = parent._get_backend(bound).options
            pg_options = torch._C._distributed_c10d.Backend.Options(options.backend, options._timeout)
        redirect = torch.device(bound.type)
        with lock:  # one split at a time swaps the lookup
            method = cls.__dict__["_get_backend"]  # the descriptor itself, to put back as it was
            get_backend = cls._get_backend

            def _get_backend(self, device):
                if getattr(device, "type", device) == "cuda":
                    with contextlib.suppress(RuntimeError):
                        return get_backend(self, device)
                    return get_backend(self, redirect)
                return get_backend(self, device)

            cls._get_backend = _get_backend
            try:
                return original(parent_pg, split_ranks, timeout, pg_options, group_desc, **kwargs)
            finally:
                setattr(cls, "_get_backend", method)

    split_group._flagos_shm = True
    c10d.split_group = split_group
    dist.split_group = split_group


def _patch_monitored_barrier() -> None:
    """torch's ``monitored_barrier`` for groups whose CPU tensors flagos_shm or Gloo serves.

    torch 2.10 refuses every group whose backend string is not exactly ``"gloo"`` before
    calling the group's ``monitored_barrier``, which runs on the group's CPU backend. For a
    group whose CPU backend is flagos_shm's (``"flagos_shm"``) or Gloo's under another string
    (``"cpu:gloo,flagos:flagos_shm"``), the replacement does what torch does after that check
    (the not-a-member warning, the default timeout, a float timeout taken as seconds, the
    timeout check) and calls the group's ``monitored_barrier``; every other call goes to torch's
    function unchanged. Raises what the CPU backend raises (``RuntimeError`` naming the ranks
    that did not arrive).
    """
    original = c10d.monitored_barrier
    if getattr(original, "_flagos_shm", False):
        return

    def cpu_backend_ok(pg) -> bool:
        try:
            backend = pg._get_backend(torch.device("cpu"))
        except RuntimeError:
            return False
        return _serves(pg, "cpu") or isinstance(backend, torch._C._distributed_c10d.ProcessGroupGloo)

    @functools.wraps(original)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        pg = group if group is not None else (c10d._get_default_group() if dist.is_initialized() else None)
        if pg is None or c10d._rank_not_in_group(group) or dist.get_backend(group) == dist.Backend.GLOO \
                or not cpu_backend_ok(pg):
            return original(group, timeout, wait_all_ranks)
        if timeout is None:
            timeout = c10d._get_default_timeout(dist.get_backend(group))
        elif isinstance(timeout, float):
            warnings.warn(f"Please specify timeout arg as a timedelta. Converting current value of {timeout} "
                          "assuming it represents seconds", stacklevel=2)
            timeout = timedelta(seconds=timeout)
        c10d._check_valid_timeout(timeout)
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier._flagos_shm = True
    c10d.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier


def install() -> None:
    """Patch the torch functions that behave the old way on this torch (see the module
    docstring); idempotent."""
    if SPLIT_GROUP_ON_CUDA:
        _patch_split_group()
    if MONITORED_BARRIER_GLOO:
        _patch_monitored_barrier()
