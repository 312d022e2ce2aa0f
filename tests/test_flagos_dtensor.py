"""flagos_shm on the (emulated) ``flagos`` device: DTensor redistribution on a flagos mesh.

The set-up these files share (the emulated device on ``flagos:<rank>``, references computed
another way in the same rank, skipped under ``--backend gloo``): ``support/flagos.py``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.flagos import CALL_TIMEOUT_S, check_close, check_device, check_equal, setup_device

pytestmark = pytest.mark.timeout(240)


# ==== 13. DTensor redistribution on a flagos mesh ===============================================

def rank_dtensor_redistribute() -> list:
    """Shard(0)->Replicate, Partial(sum/avg)->Replicate, Partial->Shard(0), and
    distribute_tensor's scatter from rank 0, on ``init_device_mesh("flagos", (n,))``;
    values against local references built from every rank's inputs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = setup_device()
    mesh = init_device_mesh("flagos", (n,))
    if mesh.device_type != "flagos":
        raise AssertionError(f"mesh device type {mesh.device_type}")
    inputs = [torch.Generator().manual_seed(31 + r) for r in range(n)]
    local = [torch.randn(3 * n, 5, generator=g) for g in inputs]  # every rank's local tensor
    done = []

    full = local[0]
    dt = DTensor.from_local(full.chunk(n)[rank].to(dev), mesh, [Shard(0)])
    out = dt.redistribute(mesh, [Replicate()]).to_local()
    check_device(out, dev, "Shard(0)->Replicate")
    check_equal(out, full, "Shard(0)->Replicate")
    done.append("shard->replicate")

    stacked = torch.stack(local).double()
    for reduce_op, ref in (("sum", stacked.sum(0)), ("avg", stacked.mean(0))):
        dt = DTensor.from_local(local[rank].to(dev), mesh, [Partial(reduce_op)])
        out = dt.redistribute(mesh, [Replicate()]).to_local()
        check_device(out, dev, f"Partial({reduce_op})->Replicate")
        check_close(out, ref, f"Partial({reduce_op})->Replicate", tol=1e-5)
        done.append(f"partial_{reduce_op}->replicate")

    dt = DTensor.from_local(local[rank].to(dev), mesh, [Partial("sum")])
    out = dt.redistribute(mesh, [Shard(0)]).to_local()
    check_device(out, dev, "Partial->Shard(0)")
    check_close(out, stacked.sum(0).chunk(n)[rank], "Partial->Shard(0)", tol=1e-5)
    done.append("partial->shard")

    dt = distribute_tensor(local[rank].to(dev), mesh, [Shard(0)])  # rank 0's values are scattered
    check_device(dt.to_local(), dev, "distribute_tensor")
    check_equal(dt.to_local(), local[0].chunk(n)[rank], "distribute_tensor shard")
    check_equal(dt.full_tensor(), local[0], "full_tensor")
    done.append("distribute_tensor")
    return done


def test_dtensor_redistribute(flagos_world):
    results = flagos_world(2).run(rank_dtensor_redistribute, timeout=CALL_TIMEOUT_S)
    assert all(len(r) == 5 for r in results), results
