"""Shared by the tests of groups that span nodes simulated on one machine
(``test_multinode*.py``): the group timeout, the spawn deadline, Gloo over loopback, a
rank's set-up, every rank's inputs and the references computed from them, digests for
bitwise comparison across ranks, and the names of Gloo's threads.
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist

#: The groups' timeout, seconds.
GROUP_TIMEOUT_S = 60.0
#: Deadline of one spawned set of ranks, seconds.
SPAWN_DEADLINE_S = 150.0
#: Gloo (between the nodes' leaders) over loopback.
GLOO_ENV = {"GLOO_SOCKET_IFNAME": "lo"}


def init_group(rank: int, world_size: int, timeout_s: float = GROUP_TIMEOUT_S):
    """Join the default ``flagos_shm`` group (env:// rendezvous, ``timeout_s`` seconds);
    return its flagos_shm part."""
    import flagos_shm

    dist.init_process_group("flagos_shm", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return flagos_shm.backend.shm_part(dist.group.WORLD)


def digest(t: torch.Tensor) -> str:
    """A short hash of ``t``'s bytes (on CPU), to compare results bitwise across ranks."""
    t = t.detach().contiguous().cpu()
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    return hashlib.sha1(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


# ---- references: every rank's inputs, regenerated, reduced in float64 / exact integers ----------

OPS = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "PRODUCT": dist.ReduceOp.PRODUCT,
        "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX, "BAND": dist.ReduceOp.BAND,
        "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR}
FACTOR = 0.5


def input_of(r: int, numel: int, dtype: torch.dtype, op: str = "SUM", seed: int = 0) -> torch.Tensor:
    """Rank ``r``'s input of ``numel`` elements of ``dtype`` (values suited to ``op``), the same
    on every rank that generates it."""
    g = torch.Generator().manual_seed(1000 * seed + 17 * r + numel)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) < 0.5
    if dtype.is_complex:
        return torch.complex(torch.randn(numel, generator=g), torch.randn(numel, generator=g)).to(dtype)
    if dtype.is_floating_point:
        x = torch.randn(numel, generator=g)
        if op == "PRODUCT":
            x = 0.5 + torch.rand(numel, generator=g)
        return x.to(dtype)
    lo, hi = (1, 3) if op == "PRODUCT" else (-50, 50)
    if dtype == torch.uint8:
        lo, hi = (1, 3) if op == "PRODUCT" else (0, 60)
    return torch.randint(lo, hi, (numel,), generator=g).to(dtype)


def reference_of(op: str, inputs: list) -> torch.Tensor:
    """The reduction ``op`` (a ReduceOp name) of ``inputs``, computed in float64 / complex128 /
    int64 and cast back to their dtype."""
    dtype = inputs[0].dtype
    n = len(inputs)
    if dtype == torch.bool:
        stack = torch.stack(inputs)
        if op in ("SUM", "MAX", "BOR"):
            return stack.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return stack.all(0)
        return (stack.to(torch.int64).sum(0) % 2).bool()
    if dtype.is_complex:
        s = torch.stack([x.to(torch.complex128) for x in inputs]).sum(0)
        return (s / n if op == "AVG" else s * FACTOR if op == "PREMUL_SUM" else s).to(dtype)
    if dtype.is_floating_point:
        s = torch.stack([x.double() for x in inputs])
        out = {"SUM": lambda: s.sum(0), "AVG": lambda: s.sum(0) / n, "PRODUCT": lambda: s.prod(0),
               "MIN": lambda: s.min(0).values, "MAX": lambda: s.max(0).values,
               "PREMUL_SUM": lambda: (s * FACTOR).sum(0)}[op]()
        return out.to(dtype)
    s = torch.stack([x.to(torch.int64) for x in inputs])
    out = {"SUM": lambda: s.sum(0), "AVG": lambda: torch.div(s.sum(0), n, rounding_mode="trunc"),
           "PRODUCT": lambda: s.prod(0), "MIN": lambda: s.min(0).values, "MAX": lambda: s.max(0).values}
    if op in out:
        return out[op]().to(dtype)
    acc = inputs[0].clone()
    f = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    for x in inputs[1:]:
        acc = f(acc, x)
    return acc


def close_enough(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same dtype and shape, and equal (integers, bool) or close by the dtype's tolerance."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype.is_floating_point or got.is_complex():
        tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(got.dtype, 1e-5)
        return torch.allclose(got.to(torch.complex128 if got.is_complex() else torch.float64),
                              want.to(torch.complex128 if want.is_complex() else torch.float64), rtol=tol, atol=tol)
    return torch.equal(got, want)


REDUCE_CASES = [(d, op) for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
                for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM")]
REDUCE_CASES += [(d, op) for d in (torch.int8, torch.uint8, torch.int32, torch.int64)
                 for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")]
REDUCE_CASES += [(torch.bool, op) for op in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")]
REDUCE_CASES += [(torch.complex64, op) for op in ("SUM", "AVG", "PREMUL_SUM")]


def op_of(name: str):
    """The ``dist.ReduceOp`` named ``name`` (PREMUL_SUM with :data:`FACTOR`)."""
    return dist._make_nccl_premul_sum(FACTOR) if name == "PREMUL_SUM" else OPS[name]


def gloo_threads() -> list:
    """Names of this process's threads that belong to Gloo (its process groups' workers,
    ``pt_gloo_runloop``, and its devices' event loops, ``gloo_tcp_loop``)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread has just exited
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)
