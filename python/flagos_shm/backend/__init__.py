"""The ``flagos_shm`` c10d backend: one collectives layer, two c10d adapters.

* :mod:`.config`: every ``FLAGOS_SHM_*`` setting, read in one place;
* :mod:`.rendezvous`: how a group's ranks meet through the store and find the segment;
* :mod:`.options`: c10d options and argument checks;
* :mod:`.collectives`: every collective, written once (a mixin of both adapters);
* :mod:`.process_group`: the ``dist.ProcessGroup`` adapter, ``ProcessGroupShm`` (every torch);
* :mod:`.per_device`: the per-device ``c10d.Backend`` adapter, ``ShmBackend`` (torch >= 2.14);
* :mod:`.device_map`: the device types a backend string gives flagos_shm, and ``backend="gloo"``
  groups that also serve the PrivateUse1 device (torch >= 2.14).

:func:`create_backend` is the creator ``import flagos_shm`` registers: it returns a
``ShmBackend`` where torch can take one (registered per device, so mixed strings such as
``"cpu:gloo,flagos:flagos_shm"`` compose) and a ``ProcessGroupShm`` otherwise.
"""

from __future__ import annotations

import sys

import torch

from .. import _compat
from . import config
from .config import segment_config
from .per_device import ShmBackend
from .process_group import BACKEND_NAME, ProcessGroupShm

__all__ = ["BACKEND_NAME", "ProcessGroupShm", "ShmBackend", "create_backend", "create_process_group",
           "segment_config", "shm_part", "uses_backend_route"]


def uses_backend_route() -> bool:
    """Whether groups are made as per-device ``ShmBackend`` (torch >= 2.14, unless
    ``FLAGOS_SHM_ROUTE=process_group``) rather than as a whole-group ``ProcessGroupShm``.

    Raises:
        ValueError: ``FLAGOS_SHM_ROUTE=backend`` on a torch older than 2.14, or an unknown value.
    """
    route = config.route()
    if route == "backend" and not _compat.HAS_PY_BACKEND:
        raise ValueError(f"{config.ENV_ROUTE}=backend: torch {'.'.join(map(str, _compat.TORCH_VERSION))} "
                         "cannot take a Python c10d.Backend (torch >= 2.14 can); unset it or use process_group")
    return _compat.HAS_PY_BACKEND and route != "process_group"


def _requested_device_backends() -> dict:
    """The ``device -> backend`` map of the ``init_process_group``/``new_group`` call that is
    creating a group right now, read from torch's ``_new_process_group_helper`` frame
    (``backend_config``); empty when it cannot be found (another torch layout)."""
    frame = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            break
        config = frame.f_locals.get("backend_config")
        if config is not None and hasattr(config, "get_device_backend_map"):
            return {str(d): str(b) for d, b in config.get_device_backend_map().items()}
        frame = frame.f_back
    return {}


def shm_part(group, device: str = "cpu"):
    """The flagos_shm object that serves ``device`` tensors of ``group``: the group itself
    (a :class:`ProcessGroupShm`), or its per-device :class:`ShmBackend`; ``None`` when
    another backend serves that device (or none does).

    Args:
        group: a process group (``dist.group.WORLD``, a ``new_group`` result).
        device: a device type (``"cpu"``, ``"flagos"``).
    """
    from .collectives import Collectives

    if isinstance(group, Collectives):
        return group
    try:
        part = group._get_backend(torch.device(device))
    except (RuntimeError, ValueError):
        return None
    return part if isinstance(part, Collectives) else None


def create_backend(backend_opts, pg_options=None):
    """The creator registered with ``torch.distributed.Backend.register_backend(...,
    extended_api=True)``: build this rank's part of a new group from
    ``_DistributedBackendOptions`` (``store``, ``group_rank``, ``group_size``, ``timeout``,
    ``group_id``). ``pg_options`` is unused.

    Returns:
        a :class:`ShmBackend` (torch >= 2.14: registered for the devices the group's
        backend string gives flagos_shm), else a :class:`ProcessGroupShm` (the whole group).

    On the ``ProcessGroupShm`` route torch gives the returned group every device, so a
    backend string that maps another device to another backend (``"cpu:gloo,flagos:
    flagos_shm"``) would silently send that device's tensors through flagos_shm as well;
    this is refused there.

    Raises:
        ValueError: on the ``ProcessGroupShm`` route, the backend string maps some device to
            another backend; ``FLAGOS_SHM_ROUTE`` is invalid.
        RuntimeError, OSError: setting the group up failed (see ``ProcessGroupShm``).
    """
    name = str(getattr(backend_opts, "group_id", "") or "")
    args = (backend_opts.store, backend_opts.group_rank, backend_opts.group_size, backend_opts.timeout)
    if uses_backend_route():
        return ShmBackend(*args, group_name=name)
    others = {d: b for d, b in _requested_device_backends().items() if b.lower() != BACKEND_NAME}
    if others:
        pairs = ",".join(f"{d}:{b}" for d, b in others.items())
        why = ("this torch cannot take a per-device Python backend (torch >= 2.14 can)" if not _compat.HAS_PY_BACKEND
               else f"{config.ENV_ROUTE}=process_group is set")
        raise ValueError(
            f"backend: flagos_shm cannot share a process group with other backends ({pairs}): {why}, so torch "
            f"gives flagos_shm's process group every device of the group and those tensors would go through "
            f"flagos_shm instead. Use backend='{BACKEND_NAME}' (serves CPU and device tensors alike), or "
            f"create a separate group with dist.new_group(backend=...) for the other backend.")
    return ProcessGroupShm(*args, group_name=name)


#: The creator's older name.
create_process_group = create_backend
