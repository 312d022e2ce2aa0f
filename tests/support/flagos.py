"""Shared by the tests of flagos_shm on the emulated ``flagos`` device (``test_flagos_*.py``):
the ranks' environment and deadlines, and rank-side helpers that select ``flagos:<rank>`` and
compare results bitwise or within a tolerance. The fixtures ``emulator_built``,
``flagos_world`` and ``fresh`` are in ``conftest.py``.

Every rank uses ``flagos:<rank>`` of the emulated PrivateUse1 device
(:mod:`flagos_shm.emulation`), enabled by ``FLAGOS_SHM_EMULATE=1`` before ``import
flagos_shm`` (:data:`EMU_ENV`). References are computed another way in the same rank. The
tests are skipped under ``--backend gloo`` (gloo has no flagos backend). Together the
``test_flagos_*.py`` files cover issue 3's "what must work" list.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: Environment of the pools and spawned ranks: the emulated device, enabled at import.
EMU_ENV = {"FLAGOS_SHM_EMULATE": "1", "FLAGOS_SHM_EMULATE_DEVICES": "4"}
#: Deadline of one pool call or one spawned group of ranks, seconds.
CALL_TIMEOUT_S = 120.0
SPAWN_TIMEOUT_S = 90.0


def setup_device() -> torch.device:
    """Select ``flagos:<rank>`` as this rank's current device and return it."""
    rank = dist.get_rank()
    torch.flagos.set_device(rank)
    return torch.device("flagos", rank)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values (on CPU), for bitwise comparison."""
    t = t.detach().cpu()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().reshape(-1).view(torch.uint8)


def check_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Raise AssertionError unless ``actual`` and ``expected`` have the same shape and bytes."""
    if actual.shape != expected.shape or not torch.equal(bits(actual), bits(expected)):
        raise AssertionError(f"{what}: values differ\nactual   {actual.cpu()}\nexpected {expected.cpu()}")


def check_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = 1e-6) -> None:
    """Raise AssertionError unless ``actual`` is within ``tol`` (relative and absolute) of ``expected``."""
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    if a.shape != e.shape or not torch.allclose(a, e, rtol=tol, atol=tol):
        raise AssertionError(f"{what}: values differ beyond {tol}\nactual   {a}\nexpected {e}")


def check_device(t: torch.Tensor, device: torch.device, what: str) -> None:
    """Raise AssertionError unless ``t`` is on ``device``."""
    if t.device != device:
        raise AssertionError(f"{what}: result on {t.device}, expected {device}")

