"""Which device types a group's backend string gives flagos_shm.

torch registers a backend for each device type of the group's
``BackendConfig`` map. :func:`extend` makes two adjustments to that map, after torch's own
parsing (:mod:`flagos_shm.backend.torch_patches` has torch's ``BackendConfig`` call it):

1. ``backend="flagos_shm"`` (or no backend name where the accelerator's default is
   flagos_shm): the map names the device types this torch knows: ``cpu``,
   ``cuda`` where CUDA is available, and the PrivateUse1 device type once torch has a name
   for it (``flagos`` from torch_fl or the emulator, or any other name), instead of the
   fixed list given at registration (``torch.device("flagos")`` fails until the device is
   named).
2. ``backend="gloo"``: see below.

Groups that say ``"gloo"`` also serve the device types Gloo cannot.

Test harnesses pick ``backend="gloo"`` for any accelerator they do not know (Hugging Face
transformers' distributed tests do), and Gloo rejects a PrivateUse1 device such as
``flagos`` ("No backend type associated with device type flagos"). With flagos_shm
imported, the device map of a ``"gloo"`` group (``BackendConfig``) gains one entry: the
PrivateUse1 device type (when torch has been given a name for it, e.g. by torch_fl or
:func:`flagos_shm.emulation.enable`) maps to flagos_shm. torch then creates the group's
Gloo backend for ``cpu`` (and ``cuda``) exactly as before and a flagos_shm backend for the
device, in one process group.

* CPU (and CUDA) tensors stay on real Gloo; what Gloo does is not changed. Where CUDA is
  not available the map names only ``cpu`` for Gloo (torch names ``cuda`` too), so the
  group has one Gloo backend; where it is, torch makes one Gloo backend per device type,
  as it does for ``"cpu:gloo,cuda:gloo"``.
* ``dist.get_backend(group)`` still answers ``"gloo"``; ``dist.get_backend_config(group)``
  and ``group._get_backend(device)`` tell the truth (``cpu:gloo,flagos:flagos_shm``).
* ``FLAGOS_SHM_EXTEND_GLOO=0`` turns this off. Logged once at INFO.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed.distributed_c10d as c10d_py

from .. import config

__all__ = ["extend", "shm_devices"]

_log = logging.getLogger("flagos_shm")
_logged = False


def _device_type() -> str | None:
    """The PrivateUse1 device type's name, if torch has been given one."""
    name = torch._C._get_privateuse1_backend_name()
    return None if name == "privateuseone" else name


def shm_devices() -> list:
    """The device types ``backend="flagos_shm"`` serves on this torch, now."""
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
    if (device := _device_type()) is not None:
        devices.append(device)
    return devices


def extend(cfg, backend, backend_name: str) -> None:
    """Adjust a :class:`BackendConfig`'s map for ``backend`` (see the module docstring)."""
    global _logged
    name = str(backend).lower()
    mapped = set(map(str, cfg.device_backend_map.values()))
    if name == backend_name or (":" not in name and mapped == {backend_name}):
        # "flagos_shm", or no backend name on a machine whose accelerator maps to flagos_shm
        cfg.device_backend_map = dict.fromkeys(shm_devices(), c10d_py.Backend(backend_name))
        return
    if name != "gloo" or not config.extend_gloo():
        return
    device = _device_type()
    if device is None or device in cfg.device_backend_map:
        return
    if "cuda" in cfg.device_backend_map and not torch.cuda.is_available():
        del cfg.device_backend_map["cuda"]  # no CUDA tensor can reach it; one Gloo backend
    cfg.device_backend_map[device] = c10d_py.Backend(backend_name)
    if not _logged:
        _logged = True
        _log.info("flagos_shm: backend='gloo' groups serve %s tensors through flagos_shm "
                  "(CPU tensors stay on Gloo); set %s=0 to turn this off", device, config.ENV_EXTEND_GLOO)
