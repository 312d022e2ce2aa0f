"""flagos_shm on the (emulated) ``flagos`` device: DDP on ``flagos:<rank>`` against one process
on the concatenated batches, and a buffer reused before ``wait`` seeing earlier results.

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

from support.flagos import CALL_TIMEOUT_S, check_device, setup_device

pytestmark = pytest.mark.timeout(240)


# ==== 11. DDP on flagos:<rank> vs one process on the concatenated batches ========================

DDP_STEPS, DDP_BATCH, DDP_IN, DDP_OUT = 4, 6, 8, 3


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DDP_IN, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, DDP_OUT))


def _ddp_batch(step: int, n: int):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(n * DDP_BATCH, DDP_IN, generator=g), torch.randint(0, DDP_OUT, (n * DDP_BATCH,), generator=g)


def rank_ddp_matches_single_process(compiler=None) -> dict:
    """DDP(device_ids=[rank]) on flagos:<rank>, ranks starting from different parameters
    (the constructor broadcasts rank 0's), against one CPU process training rank 0's
    initial model on the full batches. Returns max |difference| per parameter.

    ``compiler``: train ``torch.compile(DDP(model), backend=compiler)`` instead. Its first
    step rebuilds DDP's buckets (a broadcast, staged in Python on this device) inside the
    compiled call, where Dynamo once traced flagos_shm's staging code and failed."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = setup_device()
    model = _mlp(100 + rank).to(dev)
    # Tiny buckets (several allreduces), except compiled: Dynamo's DDP optimizer requires the
    # first bucket (1 MiB) to be no larger than the others.
    ddp = DDP(model, device_ids=[rank], bucket_cap_mb=None if compiler else 0.001)
    try:
        return _train_against_single_process(model, torch.compile(ddp, backend=compiler) if compiler else ddp, rank,
                                             n, dev)
    finally:
        if compiler:
            torch._dynamo.reset()  # the harness's rank processes are reused by later tests


def _train_against_single_process(model, ddp, rank: int, n: int, dev) -> dict:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref = _mlp(100)
    ref_init = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rows = slice(rank * DDP_BATCH, (rank + 1) * DDP_BATCH)
    for step in range(DDP_STEPS):
        x, y = _ddp_batch(step, n)
        opt.zero_grad()
        out = ddp(x[rows].to(dev))
        check_device(out, dev, "DDP output")
        torch.nn.functional.cross_entropy(out, y[rows].to(dev)).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    diffs = {}
    for (name, p), (_, q) in zip(model.state_dict().items(), ref.state_dict().items()):
        check_device(p, dev, f"DDP parameter {name}")
        if torch.allclose(q, ref_init[name]):
            raise AssertionError(f"{name}: the reference did not train (the test could not fail)")
        if not torch.allclose(p.cpu(), q, rtol=1e-5, atol=1e-6):
            raise AssertionError(f"{name}: DDP {p.cpu()} vs single process {q}")
        diffs[name] = (p.cpu() - q).abs().max().item()
    return diffs


def rank_reuse_before_wait() -> dict:
    """A tensor reused by a later call before the earlier async call was waited for: the
    later call must see the earlier result (calls of a group behave as if on one stream).
    For flagos tensors (contiguous and strided) and strided CPU tensors, three patterns
    (issue 11): two async allreduces, async then sync allreduce, async broadcast then async
    allreduce. x = rank + 1 on every rank; expected values from the sum formula."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = setup_device()
    s = float(sum(range(1, n + 1)))
    got = {}

    def tensors():
        base_dev = torch.full((16, 2), float(rank + 1), device=dev)
        base_cpu = torch.full((16, 2), float(rank + 1))
        return {"flagos": torch.full((16,), float(rank + 1), device=dev), "flagos_strided": base_dev[:, 0],
                "cpu_strided": base_cpu[:, 1]}

    for kind, x in tensors().items():
        w1 = dist.all_reduce(x, async_op=True)
        w2 = dist.all_reduce(x, async_op=True)
        w1.wait()
        w2.wait()
        got[f"{kind}/async,async"] = (x.cpu().tolist(), [n * s] * 16)
    for kind, x in tensors().items():
        w1 = dist.all_reduce(x, async_op=True)
        dist.all_reduce(x)
        w1.wait()
        got[f"{kind}/async,sync"] = (x.cpu().tolist(), [n * s] * 16)
    for kind, x in tensors().items():
        w1 = dist.broadcast(x, 0, async_op=True)
        w2 = dist.all_reduce(x, async_op=True)
        w1.wait()
        w2.wait()
        got[f"{kind}/bcast,allreduce"] = (x.cpu().tolist(), [float(n)] * 16)  # rank 0's 1.0, summed
    return {k: v[0] == v[1] for k, v in got.items()} | {"values": {k: v[0][:2] for k, v in got.items()}}


@pytest.mark.parametrize("world_size", [2, 3])
def test_reuse_before_wait_sees_earlier_results(flagos_world, world_size):
    for res in flagos_world(world_size).run(rank_reuse_before_wait, timeout=CALL_TIMEOUT_S):
        bad = {k: res["values"][k] for k, ok in res.items() if ok is False}
        assert not bad, bad
        assert len(res) == 1 + 9, res


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
def test_ddp_matches_single_process(flagos_world, compiler):
    results = flagos_world(2).run(rank_ddp_matches_single_process, compiler, timeout=CALL_TIMEOUT_S)
    assert results[0] == results[1]  # both ranks hold the same parameters
    assert len(results[0]) == 6
