"""Pipeline parallelism over flagos_shm: ``torch.distributed.pipelining`` (``ScheduleGPipe``
and ``Schedule1F1B`` with ``PipelineStage``) trains a small MLP split into 2 or 4 stages, on
CPU and on the emulated flagos device, and matches one process training the whole model
(per-microbatch losses, gradients after the first step, parameters after the last).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.flagos import EMU_ENV

pytestmark = pytest.mark.timeout(300)

CALL_TIMEOUT_S = 150.0
N_MICRO, BATCH, STEPS, LR = 4, 8, 2, 0.1


def _blocks() -> list:
    """The model: four blocks, the same on every rank (fixed seed)."""
    torch.manual_seed(1234)
    return [torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh()),
            torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.Tanh()),
            torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.Tanh()),
            torch.nn.Linear(12, 3)]


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def _loss(out, target):
    return torch.nn.functional.mse_loss(out, target)


def _reference(num_stages: int) -> dict:
    """One process: the whole model, microbatch losses summed then scaled like the
    schedule's ``scale_grads`` (so gradients are those of the mean microbatch loss)."""
    blocks = _blocks()
    model = torch.nn.Sequential(*blocks)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        step_losses = [_loss(model(xm), ym) for xm, ym in zip(x.chunk(N_MICRO), y.chunk(N_MICRO))]
        (sum(step_losses) / N_MICRO).backward()
        losses.append([v.item() for v in step_losses])
        if step == 0:
            grads = [[p.grad.clone() for p in b.parameters()] for b in blocks]
        opt.step()
    params = [[p.detach().clone() for p in b.parameters()] for b in blocks]
    return {"losses": losses, "grads": grads, "params": params}


def rank_pipeline(schedule_name: str) -> dict:
    """This rank is stage ``rank`` of ``world_size`` (blocks split evenly); trains with the
    schedule and compares with :func:`_reference`. Returns the max differences."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, n = dist.get_rank(), dist.get_world_size()
    emulated = os.environ.get("FLAGOS_SHM_EMULATE") == "1"
    if emulated:
        torch.flagos.set_device(rank)
        dev = torch.device("flagos", rank)
    else:
        dev = torch.device("cpu")
    per = 4 // n
    mine = list(range(rank * per, (rank + 1) * per))
    blocks = _blocks()
    module = torch.nn.Sequential(*[blocks[i] for i in mine]).to(dev)
    stage = PipelineStage(module, rank, n, dev)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = cls(stage, N_MICRO, loss_fn=_loss)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    ref = _reference(n)
    losses, grad_diff = [], 0.0
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        step_losses: list = []
        if rank == 0:
            schedule.step(x.to(dev))
        elif rank == n - 1:
            schedule.step(target=y.to(dev), losses=step_losses)
        else:
            schedule.step()
        if rank == n - 1:
            losses.append([v.item() for v in step_losses])
        if step == 0:
            got = [p.grad.cpu() for p in module.parameters()]
            want = [g for i in mine for g in ref["grads"][i]]
            if any(g.abs().max() == 0 for g in want):
                raise AssertionError("reference gradient is zero (the test could not fail)")
            grad_diff = max((a - b).abs().max().item() for a, b in zip(got, want))
        opt.step()
    got = [p.detach().cpu() for p in module.parameters()]
    want = [p for i in mine for p in ref["params"][i]]
    param_diff = max((a - b).abs().max().item() for a, b in zip(got, want))
    loss_diff = (max(abs(a - b) for la, lb in zip(losses, ref["losses"]) for a, b in zip(la, lb))
                 if rank == n - 1 else 0.0)
    if rank == n - 1 and len(losses) != STEPS:
        raise AssertionError(f"losses: {losses}")
    return {"grad": grad_diff, "param": param_diff, "loss": loss_diff}


def _check(results) -> None:
    for rank, res in enumerate(results):
        assert res["grad"] < 1e-5 and res["param"] < 1e-5 and res["loss"] < 1e-5, (rank, res)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_cpu_matches_single_process(worlds, backend, schedule, world_size):
    _check(worlds(world_size).run(rank_pipeline, schedule, timeout=CALL_TIMEOUT_S))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_flagos_matches_single_process(worlds, backend, emulator_built,  # noqa: F811  (the fixture)
                                                schedule, world_size):
    if backend != "flagos_shm":
        pytest.skip("flagos tensors need the flagos_shm backend")
    _check(worlds(world_size, **EMU_ENV).run(rank_pipeline, schedule, timeout=CALL_TIMEOUT_S))
