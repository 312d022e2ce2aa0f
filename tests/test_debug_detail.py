"""``TORCH_DISTRIBUTED_DEBUG=DETAIL``: torch wraps every plugin backend in its
``_ProcessGroupWrapper``, which checks each collective's fingerprint (op, shapes, sequence
number) across ranks through a Gloo helper before calling the backend.

On the per-device route the wrapper used to hold only the C++ side of ``ShmBackend``: the
Python object was freed, so every call ended in c10d's "getBackendName is not implemented"
assert, and the wrapper then needed the group's sequence number, which flagos_shm did not
give. (PyTorch's conformance suite runs its object-collective tests under DETAIL.)
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.spawn import spawn  # noqa: E402

pytestmark = pytest.mark.timeout(150)


def child_detail(rank: int, world_size: int, tmp: str) -> dict:
    import flagos_shm  # noqa: F401  (registers the backend)

    dist.init_process_group("flagos_shm", init_method="file://" + os.path.join(tmp, "store"), rank=rank,
                            world_size=world_size)
    res = {"wrapped": type(dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))).__name__}
    try:
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        res["allreduce"] = t.tolist()
        works = [dist.all_reduce(torch.full((1000,), float(rank + 1)), async_op=True) for _ in range(4)]
        for w in works:
            w.wait()
        objects = [None] * world_size
        dist.all_gather_object(objects, {"rank": rank}, group=dist.new_group(list(range(world_size))))
        res["objects"] = objects
        if rank == 0:
            dist.send(torch.arange(4.0), 1)
        elif rank == 1:
            x = torch.zeros(4)
            dist.recv(x, 0)
            res["p2p"] = x.tolist()
        t = torch.ones(2)
        dist.all_reduce(t)  # sequence numbers still agree after point-to-point
        res["after_p2p"] = t.tolist()
        try:
            dist.all_reduce(torch.ones(3 + rank))
            res["mismatch"] = None
        except RuntimeError as exc:
            res["mismatch"] = str(exc)
        return res
    finally:
        dist.destroy_process_group()


def test_collectives_under_debug_detail():

    n = 3
    results = spawn(child_detail, n, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    total = float(sum(range(1, n + 1)))
    for rank, res in enumerate(results):
        assert res["wrapped"] == "_ProcessGroupWrapper", res
        assert res["allreduce"] == [total] * 3, res
        assert res["objects"] == [{"rank": r} for r in range(n)], res
        assert res["after_p2p"] == [float(n)] * 2, res
        # The wrapper's own check names the mismatch (shapes differ) instead of a hang.
        assert "Detected mismatch between collectives on ranks" in res["mismatch"], res
    assert results[1]["p2p"] == [0.0, 1.0, 2.0, 3.0]
