"""The emulated flagos device under frameworks: Torch-FL's device spec file, an MLP trained
like on CPU, FSDP2's device plumbing, and ``torch.distributed`` seeing the flagos device type.

Each test runs its device code in a fresh interpreter and asserts here against references
computed on CPU in the same child (how and why: ``support/emulation_child.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from support.emulation_child import CHILD_TIMEOUT, PRELUDE, child_env, run_child

pytestmark = pytest.mark.timeout(600)


DEVICE_SPEC = """\
# A transformers device-spec file written for torch_fl (TRANSFORMERS_TEST_DEVICE_SPEC).
import torch

DEVICE_NAME = "flagos"
MANUAL_SEED_FN = torch.flagos.manual_seed
EMPTY_CACHE_FN = torch.flagos.empty_cache
DEVICE_COUNT_FN = torch.flagos.device_count
RESET_MAX_MEMORY_ALLOCATED_FN = torch.flagos.reset_max_memory_allocated
MAX_MEMORY_ALLOCATED_FN = torch.flagos.max_memory_allocated
MEMORY_ALLOCATED_FN = torch.flagos.memory_allocated
RESET_PEAK_MEMORY_STATS_FN = torch.flagos.reset_peak_memory_stats
SYNCHRONIZE_FN = torch.flagos.synchronize
"""


def test_torch_fl_device_spec_file_loads(built, tmp_path):
    """The README's order (``import flagos_shm``, then ``flagos_shm.emulation.enable()``), then
    a torch_fl device-spec file loaded unchanged, as transformers loads it (importlib by the
    path without ``.py``, from its directory) and by file location; its functions work."""
    (tmp_path / "flagos_spec.py").write_text(DEVICE_SPEC)
    code = PRELUDE + textwrap.dedent("""
    import importlib, importlib.util
    import flagos_shm
    enabled = flagos_shm.emulation.enable()
    spec = importlib.import_module("flagos_spec")              # transformers' way
    loc = importlib.util.spec_from_file_location("spec2", os.path.abspath("flagos_spec.py"))
    spec2 = importlib.util.module_from_spec(loc); loc.loader.exec_module(spec2)
    spec.MANUAL_SEED_FN(7); a = torch.randn(5, device=spec.DEVICE_NAME).cpu()
    spec.MANUAL_SEED_FN(7); b = torch.randn(5, device=spec.DEVICE_NAME).cpu()
    spec.RESET_PEAK_MEMORY_STATS_FN()
    base = spec.MEMORY_ALLOCATED_FN()
    t = torch.empty(100, dtype=torch.float64, device="flagos")
    grown = spec.MEMORY_ALLOCATED_FN() - base
    peak = spec.MAX_MEMORY_ALLOCATED_FN() - base
    del t
    spec.RESET_MAX_MEMORY_ALLOCATED_FN()
    emit({"enabled": enabled, "name": spec.DEVICE_NAME, "count": spec.DEVICE_COUNT_FN(),
          "same_fns": spec2.DEVICE_COUNT_FN is spec.DEVICE_COUNT_FN,
          "seeded": torch.equal(a, b), "empty_cache": spec.EMPTY_CACHE_FN(),
          "sync": spec.SYNCHRONIZE_FN(), "memory": [grown, peak, spec.MEMORY_ALLOCATED_FN() - base,
          spec.MAX_MEMORY_ALLOCATED_FN() - base],
          "available": torch.flagos.is_available(), "kind": type(torch.flagos.Stream()).__name__,
          "stream_ctx": type(torch.flagos.stream(torch.flagos.Stream())).__name__,
          "event": type(torch.flagos.Event()).__name__})
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT, env=child_env(), cwd=str(tmp_path))
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")][-1]
    out = json.loads(line[len("RESULT:"):])
    assert out == {"enabled": True, "name": "flagos", "count": 8, "same_fns": True,
                   "seeded": True, "empty_cache": None, "sync": None,
                   "memory": [800, 800, 0, 0], "available": True, "kind": "Stream",
                   "stream_ctx": "StreamContext", "event": "Event"}


def test_mlp_training_matches_cpu(built):
    out = run_child("""
    import copy
    import torch.nn as nn
    import flagos_shm.emulation as emu
    emu.enable(2)

    def train(device, model, seed):
        model = copy.deepcopy(model).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(seed)              # dropout draws from the shared host RNG
        losses = []
        for _ in range(5):
            x = torch.randn(16, 10, generator=g).to(device)
            y = torch.randint(0, 3, (16,), generator=g).to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()], model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.LayerNorm(32), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 3))
    cpu_losses, cpu_params, _ = train("cpu", model, 123)
    dev_losses, dev_params, dev_model = train("flagos:1", model, 123)
    emit({
        "cpu_losses": cpu_losses, "dev_losses": dev_losses,
        "params_equal": [torch.equal(a, b) for a, b in zip(cpu_params, dev_params)],
        "param_devices": sorted({str(p.device) for p in dev_model.parameters()}),
        "grad_devices": sorted({str(p.grad.device) for p in dev_model.parameters()}),
        "changed": not torch.equal(cpu_params[0], next(model.parameters()).detach()),
    })
    """)
    assert out["dev_losses"] == out["cpu_losses"]
    assert len(out["params_equal"]) == 8 and all(out["params_equal"])
    assert out["param_devices"] == ["flagos:1"] and out["grad_devices"] == ["flagos:1"]
    assert out["changed"] is True


def test_fsdp2_device_plumbing_matches_cpu(built):
    """FSDP2 on flagos (streams, events, set_data, storage resize) with torch's
    fake process group, world size 1: same losses and weights as plain CPU."""
    out = run_child("""
    import copy
    import torch.nn as nn
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import flagos_shm.emulation as emu
    emu.enable(2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        model = copy.deepcopy(ref).to("flagos:0")
        mesh = init_device_mesh("flagos", (1,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        losses, ref_losses = [], []
        for _ in range(3):
            x = torch.randn(4, 8, generator=g)
            loss = model(x.to("flagos:0")).square().mean()
            loss.backward(); opt.step(); opt.zero_grad()
            ref_loss = ref(x).square().mean()
            ref_loss.backward(); ref_opt.step(); ref_opt.zero_grad()
            losses.append(loss.item()); ref_losses.append(ref_loss.item())
        params = [p.full_tensor().cpu() for p in model.parameters()]
        emit({"losses": losses, "ref_losses": ref_losses,
              "params_equal": [torch.equal(a, b.detach()) for a, b in zip(params, ref.parameters())],
              "types": sorted({type(p).__name__ for p in model.parameters()}),
              "devices": sorted({str(p.device) for p in model.parameters()})})
    finally:
        dist.destroy_process_group()
    """)
    assert out["losses"] == out["ref_losses"]
    assert out["params_equal"] == [True] * 4
    assert out["types"] == ["DTensor"] and out["devices"] == ["flagos:0"]


DIST_RANK = """
import torch.distributed as dist
import flagos_shm.emulation as emu
rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
emu.enable(world)
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
try:
    t = torch.full((3,), float(rank + 1), device=f"flagos:{rank}")
    res = {"device_type": t.device.type, "index": t.device.index}
    try:
        dist.all_reduce(t)
        res["flagos_error"] = None
    except RuntimeError as exc:
        res["flagos_error"] = str(exc)
    host = t.cpu()
    dist.all_reduce(host)                    # staged through the CPU: still works
    t.copy_(host)
    res["staged"] = t.cpu().tolist()
    emit(res)
finally:
    dist.destroy_process_group()
"""


def test_distributed_sees_flagos_device_type(built, tmp_path):
    world = 2
    store = str(tmp_path / "store")
    script = PRELUDE + DIST_RANK
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(world), store],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              # Gloo as torch has it: importing flagos_shm (through its emulation
                              # module) would otherwise let the "gloo" group serve flagos tensors.
                              env=child_env({"FLAGOS_SHM_EXTEND_GLOO": "0"}))
             for r in range(world)]
    outputs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=CHILD_TIMEOUT)
            outputs.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (rc, stdout, stderr) in enumerate(outputs):
        assert rc == 0, f"rank {rank} failed:\n{stdout}\n{stderr}"
        line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT:")][-1]
        res = json.loads(line[len("RESULT:"):])
        assert res["device_type"] == "flagos" and res["index"] == rank
        # gloo has no flagos backend: the error names the device type it saw.
        assert res["flagos_error"] is not None and "flagos" in res["flagos_error"]
        assert res["staged"] == [3.0, 3.0, 3.0]
