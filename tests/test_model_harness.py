"""What model test suites do on a flagos machine (issue 10, item 7), with flagos_shm imported.

Hugging Face transformers' distributed tests pick the backend from a map of known
accelerators and fall back to ``"gloo"`` for any other, spawn the ranks, and train under DDP
(``device_ids=[rank]``) and FSDP2 (with a DCP checkpoint save and reload). This test does the
same on the emulated ``flagos`` device: a small causal decoder, losses and gradient norms
compared at 1e-5 with one process training on the whole batch. A CPU-only ``new_group(
backend="gloo")`` in the same job must still be plain ``ProcessGroupGloo``.

Needs the per-device route (torch >= 2.14): on older torch a ``"gloo"`` group is left exactly
as torch makes it, and flagos tensors fail there as they do without flagos_shm.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.flagos import EMU_ENV  # noqa: E402
from support.spawn import spawn  # noqa: E402

# transformers' testing_utils: {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "hpu": "hccl"}, else "gloo".
BACKEND_BY_ACCELERATOR = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "hpu": "hccl"}
VOCAB, DIM, HEADS, LAYERS, SEQ = 32, 16, 2, 2, 8
BATCH_PER_RANK, STEPS, LR = 2, 3, 0.05
TOL = dict(rtol=1e-5, atol=1e-5)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _needs_per_device_route(backend):

    if backend != "flagos_shm":
        pytest.skip("this test picks its backend like a model test suite does")
    from flagos_shm import emulation

    emulation.build()


class Decoder(torch.nn.Module):
    """A two-layer causal transformer language model (dropout 0: deterministic)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=True) for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x)


def _decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder()


def _batch(step: int, world_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (world_size * BATCH_PER_RANK, SEQ + 1), generator=g)


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _grad_norm(params) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in params))


def reference(world_size: int) -> dict:
    """One process, the whole batch: losses and gradient norms per step."""
    model = _decoder()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = _loss(model, _batch(step, world_size))
        loss.backward()
        losses.append(loss.item())
        norms.append(_grad_norm(p.grad for p in model.parameters()))
        opt.step()
    return {"losses": losses, "norms": norms}


def _train(model, dev, rank: int, world_size: int, full_grads) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        rows = _batch(step, world_size)[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK].to(dev)
        loss = _loss(model, rows)
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)  # the full batch's mean loss
        losses.append(float(mean.cpu()))
        norms.append(_grad_norm(full_grads(model)))
        opt.step()
    return {"losses": losses, "norms": norms}


def child_harness(rank: int, world_size: int, tmp: str) -> dict:
    import flagos_shm  # noqa: F401  (what the user adds; FLAGOS_SHM_EMULATE=1 stands in for torch_fl)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    accelerator = torch.accelerator.current_accelerator().type
    backend = BACKEND_BY_ACCELERATOR.get(accelerator, "gloo")
    torch.accelerator.set_device_index(rank)
    dev = torch.device(accelerator, rank)
    dist.init_process_group(backend, init_method="file://" + os.path.join(tmp, "store"), rank=rank,
                            world_size=world_size)
    try:
        res = {"accelerator": accelerator, "backend": backend}
        ddp = DDP(_decoder().to(dev), device_ids=[rank])
        res["ddp"] = _train(ddp, dev, rank, world_size, lambda m: [p.grad.cpu() for p in m.parameters()])

        model = _decoder().to(dev)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        res["fsdp2"] = _train(model, dev, rank, world_size,
                              lambda m: [p.grad.full_tensor().cpu() for p in m.parameters()])
        trained = [p.full_tensor().detach().cpu() for p in model.parameters()]
        path = os.path.join(tmp, "ckpt")
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
        reloaded = _decoder().to(dev)
        for layer in reloaded.layers:
            fully_shard(layer)
        fully_shard(reloaded)
        state = {"model": get_model_state_dict(reloaded)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(reloaded, state["model"])
        res["reload_equal"] = all(torch.equal(a, p.full_tensor().detach().cpu())
                                  for a, p in zip(trained, reloaded.parameters()))
        cpu_group = dist.new_group(backend="gloo")
        res["cpu_group_backend"] = type(cpu_group._get_backend(torch.device("cpu"))).__name__
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t, group=cpu_group)
        res["cpu_group_sum"] = t.tolist()
        return res
    finally:
        dist.destroy_process_group()


def test_transformers_style_harness_on_flagos():
    world_size = 2
    expected = reference(world_size)
    for res in spawn(child_harness, world_size, env=EMU_ENV, timeout=200):
        assert res["accelerator"] == "flagos" and res["backend"] == "gloo", res
        for mode in ("ddp", "fsdp2"):
            for key in ("losses", "norms"):
                got, want = torch.tensor(res[mode][key]), torch.tensor(expected[key])
                assert torch.allclose(got, want, **TOL), (mode, key, res)
        assert res["reload_equal"], res
        assert res["cpu_group_backend"] == "ProcessGroupGloo", res
        assert res["cpu_group_sum"] == [3.0, 3.0], res
