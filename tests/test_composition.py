"""flagos_shm beside Gloo in one process group, and the torch features that ask a group for
its backend of a device (issue 10). Needs the per-device route (torch >= 2.14).

Every test starts fresh ranks (:func:`spawn.spawn`) with the emulated ``flagos`` device
(``FLAGOS_SHM_EMULATE=1``), rank r on ``flagos:r``. References are computed in each rank
from every rank's inputs (each rank can regenerate them), on CPU, or by one process
training on the whole batch.

* ``"cpu:gloo,flagos:flagos_shm"`` and ``backend="gloo"``: CPU tensors go to real Gloo
  (``ProcessGroupGloo``), flagos tensors to flagos_shm (``ShmBackend``); every collective
  on both devices against references; ``get_backend`` / ``get_backend_config`` /
  ``_get_backend`` tell the truth; ``FLAGOS_SHM_EXTEND_GLOO=0`` leaves "gloo" as torch has it.
* per-device features: ``device_id=`` eager init, ``split_group``, ``new_group`` from a
  bound parent, ``_coalescing_manager(device=...)``, ``monitored_barrier`` naming the rank
  that did not arrive, DCP ``async_save``, ``set_model_state_dict(broadcast_from_rank0=
  True)``, DDP and FSDP2 over the mixed group, ``init_device_mesh("flagos", (2, 2))`` with
  a per-dimension ``backend_override``.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.flagos import EMU_ENV  # noqa: E402
from support.spawn import spawn  # noqa: E402

MIXED = "cpu:gloo,flagos:flagos_shm"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _per_device_route(backend):

    if backend != "flagos_shm":
        pytest.skip("composition tests run flagos_shm beside gloo themselves")
    from flagos_shm import emulation

    emulation.build()


# ==== helpers used in the ranks =================================================================

def _init(rank: int, world_size: int, tmp: str, backend: str, device_id: bool = False) -> torch.device:
    import flagos_shm  # noqa: F401  (registers the backend, enables the emulator: FLAGOS_SHM_EMULATE)

    dev = torch.device("flagos", rank)
    torch.flagos.set_device(rank)
    dist.init_process_group(backend, init_method="file://" + os.path.join(tmp, "store"), rank=rank,
                            world_size=world_size, device_id=dev if device_id else None)
    return dev


def _kinds(group=None) -> dict:
    pg = group or dist.distributed_c10d._get_default_group()
    kinds = {}
    for device in ("cpu", "flagos"):
        try:
            kinds[device] = type(pg._get_backend(torch.device(device))).__name__
        except RuntimeError as exc:
            kinds[device] = f"RuntimeError: {exc}"
    return {"backend": str(dist.get_backend(pg)), "config": dist.get_backend_config(pg), "kinds": kinds}


def _inputs(rank: int, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    return torch.randint(-50, 50, (numel,), generator=g).to(torch.float32)


def _collectives(dev: torch.device, group=None) -> dict:
    """Every collective on ``dev`` tensors against references built from every rank's
    inputs; returns {name: bool}."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    ok = {}
    ins = [_inputs(r, 12 * n, 1) for r in range(n)]  # every rank's input (regenerated)

    t = ins[rank].to(dev, copy=True)
    dist.all_reduce(t, group=group)
    ok["all_reduce"] = torch.equal(t.cpu(), sum(ins))
    t = ins[rank].to(dev, copy=True)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    ok["all_reduce_max"] = torch.equal(t.cpu(), torch.stack(ins).max(0).values)

    t = ins[rank].to(dev, copy=True)
    dist.broadcast(t, src=dist.get_global_rank(group, n - 1) if group else n - 1, group=group)
    ok["broadcast"] = torch.equal(t.cpu(), ins[n - 1])

    out = torch.empty(n * ins[0].numel(), device=dev)
    dist.all_gather_into_tensor(out, ins[rank].to(dev, copy=True), group=group)
    ok["all_gather_into_tensor"] = torch.equal(out.cpu(), torch.cat(ins))
    outs = [torch.empty_like(ins[0], device=dev) for _ in range(n)]
    dist.all_gather(outs, ins[rank].to(dev, copy=True), group=group)
    ok["all_gather"] = all(torch.equal(o.cpu(), i) for o, i in zip(outs, ins))

    out = torch.empty(ins[0].numel() // n, device=dev)
    dist.reduce_scatter_tensor(out, ins[rank].to(dev, copy=True), group=group)
    ok["reduce_scatter_tensor"] = torch.equal(out.cpu(), sum(ins).chunk(n)[rank])

    out = torch.empty_like(ins[0], device=dev)
    dist.all_to_all_single(out, ins[rank].to(dev, copy=True), group=group)
    ok["all_to_all_single"] = torch.equal(out.cpu(), torch.cat([i.chunk(n)[rank] for i in ins]))

    t = ins[rank].to(dev, copy=True)
    root = dist.get_global_rank(group, 0) if group else 0
    dist.reduce(t, dst=root, group=group)
    if rank == 0:
        ok["reduce"] = torch.equal(t.cpu(), sum(ins))
    gathered = [torch.empty_like(ins[0], device=dev) for _ in range(n)] if rank == 0 else None
    dist.gather(ins[rank].to(dev, copy=True), gathered, dst=root, group=group)
    if rank == 0:
        ok["gather"] = all(torch.equal(o.cpu(), i) for o, i in zip(gathered, ins))
    out = torch.empty_like(ins[0], device=dev)
    dist.scatter(out, [i.to(dev, copy=True) for i in ins] if rank == 0 else None, src=root, group=group)
    ok["scatter"] = torch.equal(out.cpu(), ins[rank])
    dist.barrier(group=group)
    return ok


# ==== children ==================================================================================

def child_compose(rank: int, world_size: int, tmp: str, backend: str) -> dict:
    dev = _init(rank, world_size, tmp, backend)
    try:
        res = {**_kinds(), "flagos": _collectives(dev), "cpu": _collectives(torch.device("cpu"))}
        # A CPU-only group that says "gloo" in the same job is still plain Gloo.
        sub = dist.new_group(ranks=list(range(world_size)), backend="gloo")
        res["cpu_gloo_group"] = _kinds(sub)
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=sub)
        res["cpu_gloo_sum"] = t.tolist()
        dist.destroy_process_group(sub)
        return res
    finally:
        dist.destroy_process_group()


def child_gloo_unextended(rank: int, world_size: int, tmp: str) -> dict:
    dev = _init(rank, world_size, tmp, "gloo")
    try:
        res = _kinds()
        try:
            dist.all_reduce(torch.ones(2, device=dev))
            res["flagos_error"] = None
        except RuntimeError as exc:
            res["flagos_error"] = str(exc)
        # A CPU collective before the destroy: Gloo's init is no barrier. A rank whose flagos
        # call fails locally would otherwise close its sockets while the other is still in
        # connectFullMesh ("Connection closed by peer", seen once in CI on torch 2.10).
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        res["cpu_sum"] = t.tolist()
        return res
    finally:
        dist.destroy_process_group()


def child_features(rank: int, world_size: int, tmp: str) -> dict:
    """Eager init with device_id, split_group, new_group from the bound parent, the
    coalescing manager with a device, DDP and FSDP2 over the mixed group."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    dev = _init(rank, world_size, tmp, MIXED, device_id=True)
    try:
        res = {"bound": str(dist.group.WORLD.bound_device_id), **_kinds()}
        split = dist.split_group(split_ranks=[list(range(world_size))])
        res["split"] = _collectives(dev, split)
        res["split_kinds"] = _kinds(split)
        sub = dist.new_group(ranks=list(range(world_size)))
        res["new_group"] = _collectives(dev, sub)
        ts = [torch.full((k + 1,), float(rank + k), device=dev) for k in range(4)]
        with _coalescing_manager(device=dev):
            for t in ts:
                dist.all_reduce(t)
        res["coalesced"] = all(torch.equal(t.cpu(), torch.full((k + 1,), float(sum(r + k for r in range(world_size)))))
                               for k, t in enumerate(ts))
        with _coalescing_manager(device=dev, async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t)
        cm.wait()
        res["coalesced_async"] = all(
            torch.equal(t.cpu(), torch.full((k + 1,), float(world_size * sum(r + k for r in range(world_size)))))
            for k, t in enumerate(ts))
        res["ddp"] = _ddp_vs_local(dev)
        res["fsdp2"] = _fsdp2_vs_local(dev)
        for g in (split, sub):
            dist.destroy_process_group(g)
        return res
    finally:
        dist.destroy_process_group()


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(step: int, world_size: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(world_size * 4, 8, generator=g), torch.randn(world_size * 4, 4, generator=g)


def _local_params(world_size: int, steps: int = 3) -> list:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(step, world_size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train(model: torch.nn.Module, dev: torch.device, steps: int) -> None:
    """``steps`` SGD steps (lr 0.1) of ``model`` on this rank's 4 rows of each batch."""
    rank, n = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(step, n)
        opt.zero_grad()
        rows = slice(rank * 4, (rank + 1) * 4)
        torch.nn.functional.mse_loss(model(x[rows].to(dev)), y[rows].to(dev)).backward()
        opt.step()


def _ddp_vs_local(dev: torch.device, steps: int = 3) -> bool:
    from torch.nn.parallel import DistributedDataParallel as DDP

    n = dist.get_world_size()
    # Different starts on each rank: DDP broadcasts rank 0's.
    model = DDP(_model(seed=dist.get_rank()).to(dev), device_ids=[dev.index])
    _train(model, dev, steps)
    return all(torch.allclose(p.detach().cpu(), q, rtol=1e-5, atol=1e-5)
               for p, q in zip(model.parameters(), _local_params(n, steps)))


def _fsdp2_vs_local(dev: torch.device, steps: int = 3) -> bool:
    from torch.distributed.fsdp import fully_shard

    n = dist.get_world_size()
    model = _model().to(dev)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    _train(model, dev, steps)
    full = [p.full_tensor().detach().cpu() for p in model.parameters()]
    return all(torch.allclose(p, q, rtol=1e-5, atol=1e-5) for p, q in zip(full, _local_params(n, steps)))


def child_monitored_barrier(rank: int, world_size: int, tmp: str) -> dict:
    """Rank 1 skips a monitored_barrier of a flagos_shm group: rank 0 names it."""
    from datetime import timedelta

    _init(rank, world_size, tmp, "flagos_shm")
    try:
        res = {}
        dist.monitored_barrier(timeout=timedelta(seconds=30))  # everybody arrives
        res["all_arrived"] = True
        store = dist.distributed_c10d._get_default_store()
        if rank != 1:
            t0 = time.monotonic()
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=2), wait_all_ranks=True)
                res["error"] = None
            except RuntimeError as exc:
                res["error"] = str(exc)
            res["seconds"] = time.monotonic() - t0
            store.set(f"mb_done_{rank}", "1")
        else:
            store.wait([f"mb_done_{r}" for r in range(world_size) if r != 1], timedelta(seconds=60))
        return res
    finally:
        dist.destroy_process_group()


def child_monitored_barrier_dead(rank: int, world_size: int, tmp: str, victim: int) -> dict:
    """Rank ``victim`` exits after a first monitored_barrier; the others call a second one
    with a 120 s timeout and report their error and how long it took."""
    from datetime import timedelta

    _init(rank, world_size, tmp, "flagos_shm")
    dist.monitored_barrier(timeout=timedelta(seconds=60))  # everybody arrives
    if rank == victim:
        os._exit(0)
    t0 = time.monotonic()
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=120))
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - t0}


def child_checkpoint(rank: int, world_size: int, tmp: str) -> dict:
    """DCP async_save / load of a sharded model, and set_model_state_dict(
    broadcast_from_rank0=True), over the mixed group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    dev = _init(rank, world_size, tmp, MIXED)
    try:
        model = _model(seed=7).to(dev)
        fully_shard(model)
        before = [p.full_tensor().detach().cpu() for p in model.parameters()]
        path = os.path.join(tmp, "ckpt")
        future = dcp.async_save({"model": get_model_state_dict(model)}, checkpoint_id=path)
        future.result()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        loaded = [p.full_tensor().detach().cpu() for p in model.parameters()]
        # broadcast_from_rank0: only rank 0 has the full state dict.
        fresh = _model(seed=99).to(dev)
        fully_shard(fresh)
        full = {k: v.to(dev) for k, v in _model(seed=7).state_dict().items()} if rank == 0 else {}
        set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        broadcast = [p.full_tensor().detach().cpu() for p in fresh.parameters()]
        return {"dcp": all(torch.equal(a, b) for a, b in zip(before, loaded)),
                "broadcast_from_rank0": all(torch.equal(a, b) for a, b in zip(before, broadcast))}
    finally:
        dist.destroy_process_group()


def child_device_mesh(rank: int, world_size: int, tmp: str) -> dict:
    """init_device_mesh("flagos", (2, 2)) over the mixed default group, the "tp" dimension
    overridden to flagos_shm alone, the "dp" dimension to "gloo" (extended)."""
    from torch.distributed.device_mesh import init_device_mesh

    dev = _init(rank, world_size, tmp, MIXED)
    try:
        mesh = init_device_mesh("flagos", (2, 2), mesh_dim_names=("dp", "tp"),
                                backend_override={"tp": "flagos_shm", "dp": "gloo"})
        res = {}
        for dim in ("dp", "tp"):
            group = mesh.get_group(dim)
            res[dim] = {**_kinds(group), "ok": _collectives(dev, group)}
        return res
    finally:
        dist.destroy_process_group()


# ==== tests =====================================================================================

def _all_ok(res: dict, key: str) -> None:
    bad = {name: v for name, v in res[key].items() if v is not True}
    assert not bad, (key, bad)


@pytest.mark.parametrize("spec", [MIXED, "gloo", "flagos_shm"])
def test_collectives_on_both_devices(spec):
    results = spawn(child_compose, 2, env=EMU_ENV, args=(spec,))
    for res in results:
        _all_ok(res, "flagos")
        _all_ok(res, "cpu")
        assert res["kinds"]["flagos"] == "ShmBackend", res
        if spec == "flagos_shm":
            assert res["kinds"]["cpu"] == "ShmBackend", res
            assert res["config"] == "cpu:flagos_shm,flagos:flagos_shm", res
        else:
            assert res["kinds"]["cpu"] == "ProcessGroupGloo", res
            assert res["config"] == MIXED, res
        assert res["backend"] == spec, res  # what was asked for; the config tells the truth
        assert res["cpu_gloo_group"]["kinds"]["cpu"] == "ProcessGroupGloo", res
        assert res["cpu_gloo_sum"] == [3.0] * 3, res


def test_gloo_left_alone_when_switched_off():
    results = spawn(child_gloo_unextended, 2, env={**EMU_ENV, "FLAGOS_SHM_EXTEND_GLOO": "0"})
    for res in results:
        assert res["config"] == "cpu:gloo,cuda:gloo", res
        assert res["kinds"]["cpu"] == "ProcessGroupGloo", res
        assert "No backend type associated with device type flagos" in res["flagos_error"], res
        assert res["cpu_sum"] == [float(sum(range(1, 3)))] * 3, res


def test_per_device_features():
    results = spawn(child_features, 2, env=EMU_ENV, timeout=150)
    for res in results:
        assert res["bound"].startswith("flagos:"), res
        _all_ok(res, "split")
        _all_ok(res, "new_group")
        assert res["split_kinds"]["kinds"]["flagos"] == "ShmBackend", res
        assert res["coalesced"] and res["coalesced_async"], res
        assert res["ddp"] and res["fsdp2"], res


def test_monitored_barrier_names_the_missing_rank():
    results = spawn(child_monitored_barrier, 3, env=EMU_ENV)
    assert all(r["all_arrived"] for r in results)
    assert "Rank 1 failed to pass monitoredBarrier" in results[0]["error"], results[0]
    assert results[0]["seconds"] < 20, results[0]


def test_monitored_barrier_fails_at_once_when_a_rank_has_exited():
    """A rank whose process has exited is not waited for (Gloo's closed connection fails
    its monitored barrier within a second): with rank 1 of 3 gone, rank 0 names it as
    exited and rank 2 hears that rank 0 reported missing ranks; with rank 0 of 2 gone, rank
    1 says rank 0's process exited. Each well before the 120 s timeout, which they waited
    out before."""
    results = spawn(child_monitored_barrier_dead, 3, env=EMU_ENV, args=(1,), may_die=(1,), timeout=240)
    assert results[1] is None, results
    assert all(r["seconds"] < 60 for r in (results[0], results[2])), results
    assert "Rank 1 failed to pass monitoredBarrier" in results[0]["error"], results[0]
    assert "exited: rank 1 (pid " in results[0]["error"], results[0]
    assert "rank 0 reported missing ranks" in results[2]["error"], results[2]
    results = spawn(child_monitored_barrier_dead, 2, env=EMU_ENV, args=(0,), may_die=(0,), timeout=240)
    assert results[0] is None, results
    assert "rank 0's process" in results[1]["error"] and "exited" in results[1]["error"], results[1]
    assert results[1]["seconds"] < 60, results


def test_checkpoint_save_load_and_broadcast_from_rank0():
    for res in spawn(child_checkpoint, 2, env=EMU_ENV):
        assert res["dcp"] and res["broadcast_from_rank0"], res


def test_device_mesh_with_backend_override():
    results = spawn(child_device_mesh, 4, env=EMU_ENV, timeout=150)
    for res in results:
        _all_ok(res["dp"], "ok")
        _all_ok(res["tp"], "ok")
        assert res["tp"]["kinds"]["flagos"] == "ShmBackend" and res["dp"]["kinds"]["flagos"] == "ShmBackend", res
        assert res["dp"]["kinds"]["cpu"] == "ProcessGroupGloo", res
