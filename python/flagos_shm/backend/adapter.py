"""The c10d adapter: how torch reaches flagos_shm, the same on every torch (2.10 to 2.15).

torch registers a backend per device type of a process group only when the backend is a C++
``c10d::Backend``; a Python object that is not one either takes over the whole group (a
``dist.ProcessGroup``: mixed strings such as ``"cpu:gloo,flagos:flagos_shm"`` then cannot
work) or cannot be made at all (a Python ``c10d.Backend`` before torch 2.14). So the backend
torch holds is the small C++ class in ``csrc/c10d_adapter.cpp``, ``ShmBackend``: it forwards
each call to the group's :class:`~flagos_shm.backend.group.ShmGroup` and returns works that
report their completion (``is_completed()``, ``get_future()``, errors from ``wait()``).

It is compiled against the installed torch on first use (about 30 s on 2 cores; cached per
torch build, compiler command and Python under ``$FLAGOS_SHM_CACHE_DIR``, see
:mod:`flagos_shm._cxx`). :func:`create_backend` is the creator ``import flagos_shm`` registers.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading

import torch
import torch.distributed.distributed_c10d as c10d

from .. import _cxx, staging
from . import dynamo, exiting, rendezvous
from .group import ShmGroup

__all__ = ["create_backend", "known_peers", "native", "process_group", "shm_part"]

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCE = os.path.join(_CSRC, "c10d_adapter.cpp")
_DEPENDS = (os.path.join(_CSRC, "staging.hpp"),)
_MODULE = "flagos_shm_c10d"
#: The torch headers the adapter includes (checked before compiling, for a clear error).
_HEADERS = ("torch/csrc/distributed/c10d/Backend.hpp", "torch/csrc/utils/pybind.h", "pybind11/pybind11.h")
_WHAT = "flagos_shm's c10d adapter"

_lock = threading.Lock()
_module = None


def native():
    """The compiled adapter module (``ShmBackend``), built on first use.

    Raises:
        flagos_shm._cxx.BuildError: it cannot be built (no C++ compiler, a torch without
            headers, a torch whose C++ API differs); the message says what is missing.
    """
    global _module
    if _module is None:
        with _lock:
            if _module is None:
                path = _cxx.build(_SOURCE, _MODULE, what=_WHAT, python_module=True, headers=_HEADERS,
                                  depends=_DEPENDS)
                spec = importlib.util.spec_from_file_location(_MODULE, path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                # the adapter's own staging pool keeps what the Python one does
                module.set_pinned_pool_limit(staging.pinned_pool().limit_bytes)
                exiting.tell_when_exit_begins(module.exit_handler_begins)
                sys.modules.setdefault(_MODULE, module)
                _module = module
    return _module


def create_backend(backend_opts, pg_options=None):
    """The creator registered with ``torch.distributed.Backend.register_backend(...,
    extended_api=True)``: this rank's flagos_shm part of a new group, from
    ``_DistributedBackendOptions`` (``store``, ``group_rank``, ``group_size``, ``timeout``,
    ``group_id``, ``global_ranks_in_group``). ``pg_options`` is unused.

    Returns:
        a C++ ``ShmBackend`` holding a new :class:`ShmGroup`; torch registers it for the
        device types the group's backend string gives flagos_shm.

    Raises:
        flagos_shm._cxx.BuildError: the adapter cannot be built (see :func:`native`); the
            group's other ranks then raise RuntimeError naming this rank and the cause.
        ValueError, OSError, RuntimeError: setting the group up failed (see :class:`ShmGroup`).
    """
    try:
        adapter = native()  # before the rendezvous: a rank that cannot build fails at once
    except Exception as exc:  # and tells its peers, which then raise at once too
        rendezvous.give_up(backend_opts.store, backend_opts.group_rank, backend_opts.group_size, exc)
        raise
    dynamo.hide()  # modules loaded since import flagos_shm (the first group's plan, hierarchy)
    name = str(getattr(backend_opts, "group_id", "") or "")
    # c10d's global_ranks_in_group: the default group's ranks of the group's ranks, empty
    # for the default group itself
    global_ranks = [int(r) for r in getattr(backend_opts, "global_ranks_in_group", None) or []]
    global_ranks = global_ranks or list(range(backend_opts.group_size))
    group = ShmGroup(backend_opts.store, backend_opts.group_rank, backend_opts.group_size, backend_opts.timeout,
                     group_name=name, global_ranks=global_ranks, known_peers=known_peers(global_ranks))
    return adapter.ShmBackend(group, backend_opts.group_rank, backend_opts.group_size)


def shm_part(group, device: str = "cpu"):
    """The :class:`ShmGroup` that serves ``device`` tensors of ``group``, or ``None`` when
    another backend serves that device (or none does).

    Args:
        group: a process group (``dist.group.WORLD``, a ``new_group`` result).
        device: a device type (``"cpu"``, ``"flagos"``).
    """
    if isinstance(group, ShmGroup):
        return group
    try:
        part = group._get_backend(torch.device(device))
    except (RuntimeError, ValueError):
        return None
    inner = getattr(part, "group", None)
    return inner if isinstance(inner, ShmGroup) else None


def known_peers(global_ranks) -> dict:
    """For a group being set up whose ranks are ``global_ranks`` (default-group ranks, by
    group rank): group rank -> identity (:func:`flagos_shm.backend.rendezvous.identity`) of
    the process that is that rank in a flagos_shm part of a process group torch holds now
    (c10d's group map: the default group, earlier subgroups). The rendezvous watches these
    processes until they publish their own identity, so that one that exited before calling
    ``new_group`` fails the set-up at once. A group torch has let go of
    (``_abort_process_group``, an in-process restart) may live on while something references
    it, with ranks whose processes are gone: it is not asked. Empty when ``global_ranks`` is
    empty or None."""
    if not global_ranks:
        return {}
    by_global: dict = {}
    for pg in list(getattr(c10d._world, "pg_map", {})):
        for device in getattr(pg, "_device_types", ()):
            part = shm_part(pg, getattr(device, "type", device))
            if part is not None:
                for g, peer in part.identities_by_global_rank().items():
                    by_global.setdefault(g, peer)
    return {r: by_global[g] for r, g in enumerate(global_ranks) if g in by_global}


def process_group(store, rank: int, world_size: int, timeout=None, group_name: str = "",
                  devices=("cpu",)):
    """A ``torch.distributed`` process group served by flagos_shm, made directly on ``store``
    without ``init_process_group`` (not registered with ``torch.distributed``: pass it to
    nothing that looks groups up, call its methods: ``pg.allreduce([t], opts).wait()``).

    For tests and tools that need a group of any subset of processes, on a store of their
    own. Collective over the ranks of the group, like its set-up.

    Args:
        store: the group's store (private to it).
        rank, world_size: this process's group rank and the group's size.
        timeout: the group's timeout (``timedelta`` or seconds; None: c10d's default).
        group_name: the group's name (error messages).
        devices: device types whose tensors the group serves.

    Raises:
        as :class:`ShmGroup` and :func:`native`.
    """
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    if timeout is None:
        timeout = default_pg_timeout
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=timeout)
    adapter = native()
    backend = adapter.ShmBackend(ShmGroup(store, rank, world_size, timeout, group_name=group_name), rank,
                                 world_size)
    pg = dist.ProcessGroup(store, rank, world_size)
    custom = dist.ProcessGroup.BackendType.CUSTOM
    pg._set_default_backend(custom)
    for device in devices:
        pg._register_backend(torch.device(device), custom, backend)
    return pg
