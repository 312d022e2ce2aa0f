"""Every change flagos_shm makes to torch's own functions, classes and tables, in one place.

``import flagos_shm`` calls :func:`install` once (from ``flagos_shm.register``, after
``Backend.register_backend``); a second call changes nothing. What differs between torch
versions is decided in :mod:`flagos_shm._compat` (from what the installed function does, not
from its version number); what a backend string gives flagos_shm is decided in
:mod:`flagos_shm.backend.device_map`. This module only applies those decisions to torch.

Each patch, what it changes, why, on which torch, and how it is undone:

* **device default** (:func:`_map_devices`): ``Backend.default_device_backend_map`` maps
  ``flagos`` to ``flagos_shm``, also where a vendor plugin registered ``flagos`` first
  (``register_backend`` fills only missing entries). Every torch. Not undone (a plugin
  imported later that remaps it on purpose wins).
* **BackendConfig** (:func:`_patch_backend_config`): ``distributed_c10d.BackendConfig`` is
  replaced by a subclass that adjusts the device map after torch's parsing
  (:func:`.device_map.extend`): ``"flagos_shm"`` serves every device type torch knows now,
  and ``"gloo"`` groups also serve the PrivateUse1 device, which Gloo rejects. Every torch.
  Not undone; ``FLAGOS_SHM_EXTEND_GLOO=0`` leaves ``"gloo"`` groups as torch makes them.
* **flight recorder** (:func:`_opt_out_of_flight_recorder`): ``flagos_shm`` is added to
  ``distributed_c10d._FR_SELF_RECORDING_BACKENDS``, since torch's generic Python hook costs
  several microseconds per call. torch >= 2.15 (where the set exists). Not applied with
  ``FLAGOS_SHM_FLIGHT_RECORDER=1``.
* **split_group** (:func:`_patch_split_group`): wrapped where torch looks the parent's
  backend up on ``cuda`` only (:data:`flagos_shm._compat.SPLIT_GROUP_ON_CUDA`, torch 2.10),
  which fails for a ``flagos`` group: during a call on a parent bound to a device flagos_shm
  serves, those lookups go to the bound device. The ``_get_backend`` swap is undone at the
  end of each such call; the wrapper stays.
* **monitored_barrier** (:func:`_patch_monitored_barrier`): wrapped where torch refuses
  every group whose backend string is not ``"gloo"``
  (:data:`flagos_shm._compat.MONITORED_BARRIER_GLOO`, torch 2.10): groups whose CPU backend
  is flagos_shm's or Gloo's are let through to their own ``monitored_barrier``. Not undone.
* **default backend type** (:func:`_patch_default_backend_type`): ``_new_process_group_helper``
  wrapped where it gives a group made without a backend name the default backend type GLOO
  (:data:`flagos_shm._compat.UNDEFINED_DEFAULT_GLOO`, torch 2.10): when flagos_shm serves
  every device of such a group (a machine whose accelerator is ``flagos``), the type is set
  to CUSTOM, flagos_shm's, afterwards. Before, DDP's constructor raised ``Could not find
  backend type 1 for Process Group with name gloo`` (it asks the default backend for its
  logging data), on CPU and ``flagos`` models alike. Not undone.

Each wrapper sends every call that is not about a flagos_shm group to torch's function
unchanged, and is marked (``_flagos_shm``) so that it is never wrapped twice.
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

from .. import _compat, config
from . import device_map
from .adapter import shm_part

__all__ = ["install", "installed"]

#: torch's own ``BackendConfig``, which :func:`_patch_backend_config` subclasses.
_ORIGINAL_BACKEND_CONFIG = c10d.BackendConfig


def install(backend_name: str, devices) -> None:
    """Apply every patch of the module docstring's table that this torch needs (idempotent).

    Args:
        backend_name: the name flagos_shm is registered under (``"flagos_shm"``).
        devices: the device types registered for it; each but ``cpu`` (which stays with
            gloo) is mapped to it by default.
    """
    _map_devices(backend_name, devices)
    _patch_backend_config(backend_name)
    if _compat.SPLIT_GROUP_ON_CUDA:
        _patch_split_group()
    if _compat.MONITORED_BARRIER_GLOO:
        _patch_monitored_barrier()
    if _compat.UNDEFINED_DEFAULT_GLOO:
        _patch_default_backend_type(backend_name)


def installed() -> bool:
    """Whether :func:`install` has replaced torch's ``BackendConfig``."""
    return c10d.BackendConfig is not _ORIGINAL_BACKEND_CONFIG


# ---- device defaults and the device map --------------------------------------------------


def _map_devices(backend_name: str, devices) -> None:
    """``flagos`` (every registered device type but ``cpu``) -> flagos_shm in torch's
    defaults, set explicitly: ``register_backend`` fills only missing entries, so whether a
    vendor plugin (torch_fl) or the emulator is imported before or after flagos_shm,
    ``flagos`` maps to flagos_shm. Re-asserted on every :func:`install`."""
    for device in devices:
        if device != "cpu":
            dist.Backend.default_device_backend_map[device] = backend_name


def _patch_backend_config(backend_name: str) -> None:
    """Make torch's ``BackendConfig`` adjust its map (:func:`.device_map.extend`), and keep
    torch's generic flight-recorder hook off flagos_shm's groups.

    ``distributed_c10d`` looks ``BackendConfig`` up as a module global at group creation
    (``_new_process_group_helper``, ``split_group``), so a subclass there is seen by every
    group made from then on; the subclass only changes the map, after torch's own parsing.
    """
    if installed():
        return
    _opt_out_of_flight_recorder(backend_name)

    class BackendConfig(_ORIGINAL_BACKEND_CONFIG):
        __doc__ = _ORIGINAL_BACKEND_CONFIG.__doc__

        def __init__(self, backend) -> None:
            super().__init__(backend)
            device_map.extend(self, backend, backend_name)

    BackendConfig.__qualname__ = _ORIGINAL_BACKEND_CONFIG.__qualname__
    BackendConfig.__module__ = _ORIGINAL_BACKEND_CONFIG.__module__
    c10d.BackendConfig = BackendConfig


def _opt_out_of_flight_recorder(backend_name: str) -> None:
    """torch >= 2.15 attaches a Python flight-recorder hook to every group with a backend
    that does not record itself; it costs several microseconds per call (a 4-byte allreduce:
    27 against 37 us on our loaded 2-vCPU VM). flagos_shm opts out unless
    ``FLAGOS_SHM_FLIGHT_RECORDER=1``."""
    self_recording = getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(self_recording, set) and not config.flight_recorder():
        self_recording.add(backend_name)


# ---- torch 2.10's split_group and monitored_barrier ---------------------------------------


def _serves(pg, device: str) -> bool:
    """Whether flagos_shm serves ``device`` tensors of process group ``pg``."""
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


def _patch_default_backend_type(backend_name: str) -> None:
    """torch's ``_new_process_group_helper`` for groups made without a backend name that
    flagos_shm serves on every device: their default backend type becomes CUSTOM.

    torch 2.10 sets the default backend type of such a group to GLOO (NCCL where its map
    names NCCL) before it registers the group's backends; where the map (extended by
    :func:`.device_map.extend`) names flagos_shm only, no GLOO backend is ever registered,
    and everything that asks the group for its default backend (DDP's constructor, through
    its logger) raised ``RuntimeError: Could not find backend type 1``. After torch's
    function returns, such a group's default type is set to CUSTOM, the type torch registers
    flagos_shm's backends under; every other group is left as torch made it.
    """
    original = c10d._new_process_group_helper
    if getattr(original, "_flagos_shm", False):
        return
    signature = inspect.signature(original)
    custom = torch._C._distributed_c10d.ProcessGroup.BackendType.CUSTOM

    @functools.wraps(original)
    def _new_process_group_helper(*args, **kwargs):
        result = original(*args, **kwargs)
        backend = signature.bind_partial(*args, **kwargs).arguments.get("backend")
        pg = result[0] if isinstance(result, tuple) else result
        if str(backend).lower() == dist.Backend.UNDEFINED and isinstance(pg, torch._C._distributed_c10d.ProcessGroup):
            mapped = {str(b).lower() for b in c10d.BackendConfig(backend).get_device_backend_map().values()}
            if mapped == {backend_name}:
                pg._set_default_backend(custom)
        return result

    _new_process_group_helper._flagos_shm = True
    c10d._new_process_group_helper = _new_process_group_helper
