"""Tests of the emulated flagos device (flagos_shm.emulation): the build and its cache, the
device count, tensors and copies, CPU fallback ops, pinned memory, storage resizing, and
what enabling does (idempotent, yields to a real flagos device, refuses a PrivateUse1 taken
by another backend). Runtime APIs: ``test_emulation_runtime.py``; models and frameworks on
the device: ``test_emulation_integration.py``.

Each test runs its device code in a fresh interpreter and asserts here against references
computed on CPU in the same child (how and why: ``support/emulation_child.py``).
"""

from __future__ import annotations

import pytest

from support.emulation_child import run_child

pytestmark = pytest.mark.timeout(600)


def test_build_is_cached_and_does_not_enable(built):
    from flagos_shm import emulation
    import torch

    assert emulation.build() == built
    assert not emulation.is_enabled()
    # Building must not have touched this process's PrivateUse1.
    assert torch._C._get_privateuse1_backend_name() == "privateuseone"


@pytest.mark.parametrize("value, error", [
    (0, ValueError), (65, ValueError), (-1, ValueError),
    ("2", TypeError), (2.0, TypeError), (True, TypeError),
])
def test_device_count_argument_validated(value, error):
    from flagos_shm import emulation

    with pytest.raises(error, match="device_count"):
        emulation._resolve_device_count(value)


def test_device_count_from_environment(monkeypatch):
    from flagos_shm import emulation

    monkeypatch.delenv("FLAGOS_SHM_EMULATE_DEVICES", raising=False)
    assert emulation._resolve_device_count(None) == emulation.DEFAULT_DEVICE_COUNT == 8
    monkeypatch.setenv("FLAGOS_SHM_EMULATE_DEVICES", "3")
    assert emulation._resolve_device_count(None) == 3
    assert emulation._resolve_device_count(5) == 5  # the argument wins
    for bad in ("x", "0", "100", "2.5"):
        monkeypatch.setenv("FLAGOS_SHM_EMULATE_DEVICES", bad)
        with pytest.raises(ValueError, match="FLAGOS_SHM_EMULATE_DEVICES"):
            emulation._resolve_device_count(None)


def test_tensors_and_copies(built):
    out = run_child("""
    import flagos_shm.emulation as emu
    enabled = emu.enable(2)
    res = {"enabled": enabled, "cases": []}
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
              torch.int8, torch.int64, torch.bool, torch.complex64]
    for dtype in dtypes:
        for shape in [(0,), (1,), (7, 13), (3, 0, 2), (5, 4, 3)]:
            ref = (torch.randn(shape, generator=g) * 10).to(dtype)
            on0 = ref.to("flagos:0")
            on1 = on0.to("flagos:1")                  # flagos -> flagos
            back = on1.cpu()                          # flagos -> cpu
            dst = torch.zeros(shape, dtype=dtype, device="flagos:1")
            dst.copy_(ref)                            # cpu -> flagos, copy_
            res["cases"].append({
                "dtype": str(dtype), "shape": list(shape),
                "devices": [str(on0.device), str(on1.device), str(back.device)],
                "roundtrip": torch.equal(back, ref),
                "copy_": torch.equal(dst.cpu(), ref),
            })
    x = torch.arange(35, dtype=torch.float32).reshape(5, 7)
    d = x.to("flagos:1")
    res["noncontig_to"] = torch.equal(x.t().to("flagos:0").cpu(), x.t())
    res["noncontig_from"] = torch.equal(d.t()[::2].cpu(), x.t()[::2])
    res["to_dtype"] = torch.equal(d.to(torch.float64).cpu(), x.double())
    res["cross_dtype_copy"] = torch.equal(
        torch.zeros(5, 7, dtype=torch.int32, device="flagos:0").copy_(d).cpu(), x.int())
    part = torch.zeros(5, 7, device="flagos:1")
    part[1:3, ::2] = torch.ones(2, 4)
    ref = torch.zeros(5, 7); ref[1:3, ::2] = 1
    res["slice_assign"] = torch.equal(part.cpu(), ref)
    res["broadcast_copy"] = torch.equal(
        torch.zeros(3, 4, device="flagos:0").copy_(torch.arange(4.)).cpu(),
        torch.arange(4.).expand(3, 4))
    shifted = torch.arange(6.).to("flagos:0")
    shifted[1:].copy_(shifted[:-1])          # overlapping source and destination
    flipped = torch.arange(6.).to("flagos:0")
    flipped.copy_(flipped.flip(0))
    res["overlap"] = [shifted.cpu().tolist(), flipped.cpu().tolist()]
    z = torch.tensor([1 + 2j, -3 - 4j], dtype=torch.complex64)
    res["conj"] = torch.equal(z.to("flagos:0").conj().cpu(), z.conj())
    res["neg_view"] = torch.equal(torch._neg_view(z.to("flagos:0")).cpu(), -z)
    res["item"] = torch.tensor(2.5, device="flagos:1").item()
    res["is_flagos"] = [d.is_flagos, x.is_flagos, torch.ones(1).flagos(1).device.index]
    res["factory"] = [str(torch.ones(2, device="flagos:1").device),
                      torch.ones(2, device="flagos:1").cpu().tolist(),
                      str(torch.empty(2, device="flagos").device)]
    try:
        torch.empty(1, device="flagos:2")
        res["out_of_range"] = None
    except RuntimeError as exc:
        res["out_of_range"] = str(exc)
    emit(res)
    """)
    assert out["enabled"] is True
    assert len(out["cases"]) == 40
    for case in out["cases"]:
        assert case["devices"] == ["flagos:0", "flagos:1", "cpu"], case
        assert case["roundtrip"] and case["copy_"], case
    for key in ("noncontig_to", "noncontig_from", "to_dtype", "cross_dtype_copy",
                "slice_assign", "broadcast_copy", "conj", "neg_view"):
        assert out[key] is True, key
    assert out["overlap"] == [[0.0, 0.0, 1.0, 2.0, 3.0, 4.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]]
    assert out["item"] == 2.5
    assert out["is_flagos"] == [True, False, 1]
    assert out["factory"] == ["flagos:1", [1.0, 1.0], "flagos:0"]
    assert "device index 2 is out of range" in out["out_of_range"]


def test_cpu_fallback_ops_match_cpu(built):
    out = run_child("""
    import torch.nn.functional as F
    import flagos_shm.emulation as emu
    emu.enable(2)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(6, 5, generator=g); b = torch.randn(5, 3, generator=g)
    img = torch.randn(2, 3, 9, 7, generator=g); w = torch.randn(4, 3, 3, 3, generator=g)
    q = torch.randn(2, 2, 5, 8, generator=g)
    ops = {
        "add": lambda a, b, img, w, q: a + 1.5 * a,
        "mul_div": lambda a, b, img, w, q: (a * a) / (a.abs() + 1),
        "matmul": lambda a, b, img, w, q: a @ b,
        "sum_dim": lambda a, b, img, w, q: a.sum(dim=1),
        "softmax": lambda a, b, img, w, q: F.softmax(a, dim=-1),
        "cumsum_odd": lambda a, b, img, w, q: a[:, 1::2].cumsum(0),
        "mask": lambda a, b, img, w, q: a[a > 0],
        "argmax": lambda a, b, img, w, q: a.argmax(dim=0),
        "conv2d": lambda a, b, img, w, q: F.conv2d(img, w, padding=1, stride=2),
        "sdpa_causal": lambda a, b, img, w, q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
        "sdpa_mask": lambda a, b, img, w, q: F.scaled_dot_product_attention(
            q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.bool, device=q.device).tril()),
        "layer_norm": lambda a, b, img, w, q: F.layer_norm(a, (5,)),
        "group_norm": lambda a, b, img, w, q: F.group_norm(img, 3),
        "cat_t": lambda a, b, img, w, q: torch.cat([a.t(), b], dim=1),
        "empty_sum": lambda a, b, img, w, q: a[:0].sum(),
    }
    res = {}
    for name, fn in ops.items():
        ref = fn(a, b, img, w, q)
        dev = fn(*(t.to("flagos:1") for t in (a, b, img, w, q)))
        res[name] = [str(dev.device), torch.equal(dev.cpu(), ref)]
    emit(res)
    """)
    assert set(out) >= {"add", "matmul", "conv2d", "sdpa_causal", "sdpa_mask"}
    for name, (device, equal) in out.items():
        assert device == "flagos:1", name
        assert equal, name


def test_batch_norm_running_statistics_match_cpu(built):
    """BatchNorm in training updates its running statistics in place (an op whose schema
    does not mark them as written: the CPU fallback used to drop the updates, so they
    stayed 0 and 1 on flagos); outputs, gradients, statistics and an eval-mode output after
    three steps are bitwise equal to CPU's, also for a channels-last 4-D input."""
    out = run_child("""
    import flagos_shm.emulation as emu
    emu.enable(2)
    res = {}
    for name, shape, make in (("1d", (8, 3), lambda: torch.nn.BatchNorm1d(3)),
                              ("2d_channels_last", (4, 3, 5, 5), lambda: torch.nn.BatchNorm2d(3))):
        got = {}
        for dev in ("cpu", "flagos:1"):
            torch.manual_seed(0)
            bn = make().to(dev)
            g = torch.Generator().manual_seed(1)
            for _ in range(3):
                x = torch.randn(*shape, generator=g).to(dev)
                if len(shape) == 4:
                    x = x.contiguous(memory_format=torch.channels_last)
                x.requires_grad_(True)
                y = bn(x)
                (y * y).sum().backward()
            bn.eval()
            z = bn(torch.randn(*shape, generator=g).to(dev))
            got[dev] = [t.detach().cpu() for t in (y, x.grad, bn.weight.grad, bn.running_mean, bn.running_var, z)]
        res[name] = [torch.equal(c, f) for c, f in zip(got["cpu"], got["flagos:1"])]
        res[name + "_trained"] = not torch.equal(got["cpu"][3], torch.zeros(3))
    emit(res)
    """)
    for name in ("1d", "2d_channels_last"):
        assert out[name + "_trained"], out  # the reference's statistics moved: the test can fail
        assert out[name] == [True] * 6, (name, "output, input grad, weight grad, running mean, running var, eval")


def test_pinned_memory(built):
    out = run_child("""
    import flagos_shm.emulation as emu
    emu.enable(2)
    res = {}
    p = torch.empty(4, pin_memory=True)
    res["empty_pinned"] = [p.is_pinned(), str(p.device)]
    plain = torch.arange(10.)
    pinned = plain.pin_memory()
    res["pin_memory"] = [plain.is_pinned(), pinned.is_pinned(), pinned[3:].is_pinned(),
                         torch.equal(pinned, plain)]
    res["pin_zero_size"] = torch.empty(0).pin_memory().numel()
    d = pinned.to("flagos:1", non_blocking=True)
    torch.flagos.synchronize(1)
    host = torch.empty(10, pin_memory=True)
    host.copy_(d * 2, non_blocking=True)
    torch.accelerator.synchronize()
    res["non_blocking"] = [torch.equal(d.cpu(), plain), torch.equal(host, plain * 2)]
    res["device_tensor_pinned"] = d.is_pinned()
    try:
        torch.empty(2, device="flagos:0", pin_memory=True)
        res["pin_device"] = None
    except RuntimeError as exc:
        res["pin_device"] = str(exc)
    emit(res)
    """)
    assert out["empty_pinned"] == [True, "cpu"]
    assert out["pin_memory"] == [False, True, True, True]
    assert out["pin_zero_size"] == 0
    assert out["non_blocking"] == [True, True]
    assert out["device_tensor_pinned"] is False
    assert "only CPU tensors can be pinned" in out["pin_device"]


def test_storage_resize_like_fsdp2(built):
    out = run_child("""
    import flagos_shm.emulation as emu
    emu.enable(2)
    acc = torch.accelerator
    res = {}
    t = torch.arange(1000, dtype=torch.float32, device="flagos:1")
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    before = acc.memory_allocated(1)
    storage.resize_(0)                       # FSDP2: free the unsharded parameter
    freed = acc.memory_allocated(1)
    storage.resize_(nbytes)                  # ... and re-allocate it before all-gather
    regrown = acc.memory_allocated(1)
    with torch.no_grad():
        t.copy_(torch.arange(1000, dtype=torch.float32) * 3)
    res["sizes"] = [nbytes, before - freed, regrown - freed, storage.nbytes()]
    res["values"] = torch.equal(t.cpu(), torch.arange(1000, dtype=torch.float32) * 3)
    res["device"] = [str(storage.device), str(t.device)]
    # Growing keeps the prefix (tensor resize_ and storage resize_).
    u = torch.arange(5., device="flagos:0")
    u.resize_(8)
    res["resize_prefix"] = u[:5].cpu().tolist()
    s2 = torch.arange(4., device="flagos:0").untyped_storage()
    s2.resize_(32)
    res["storage_prefix"] = torch.tensor([], dtype=torch.float32, device="flagos:0").set_(
        s2, 0, (4,), (1,)).cpu().tolist()
    emit(res)
    """)
    assert out["sizes"] == [4000, 4000, 4000, 4000]
    assert out["values"] is True
    assert out["device"] == ["flagos:1", "flagos:1"]
    assert out["resize_prefix"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert out["storage_prefix"] == [0.0, 1.0, 2.0, 3.0]


def test_enable_idempotent(built):
    out = run_child("""
    import flagos_shm.emulation as emu
    first = emu.enable(2)
    module = torch.flagos
    second = emu.enable(5)                   # no-op: the count stays 2
    errors = []
    for bad in (0, "2"):
        try:
            emu.enable(bad)
        except (ValueError, TypeError) as exc:
            errors.append(type(exc).__name__)
    emit({"results": [first, second], "same_module": torch.flagos is module,
          "count": torch.flagos.device_count(), "enabled": emu.is_enabled(),
          "name": torch._C._get_privateuse1_backend_name(), "errors": errors})
    """)
    assert out == {"results": [True, True], "same_module": True, "count": 2, "enabled": True,
                   "name": "flagos", "errors": ["ValueError", "TypeError"]}


def test_enable_yields_to_a_real_flagos_device(built):
    out = run_child("""
    import types
    # A "real" vendor plugin got there first: renamed PrivateUse1, own module.
    torch.utils.rename_privateuse1_backend("flagos")
    vendor = types.ModuleType("torch_fl_flagos")
    vendor.device_count = lambda: 1
    vendor.is_available = lambda: True
    torch._register_device_module("flagos", vendor)
    import flagos_shm.emulation as emu
    result = emu.enable(2)
    emit({"result": result, "again": emu.enable(2), "enabled": emu.is_enabled(),
          "module_kept": torch.flagos is vendor,
          "kernels": torch._C._dispatch_has_kernel_for_dispatch_key(
              "aten::empty.memory_format", "PrivateUse1"),
          "tensor_methods": hasattr(torch.Tensor, "is_flagos")})
    """)
    assert out == {"result": False, "again": False, "enabled": False, "module_kept": True,
                   "kernels": False, "tensor_methods": False}


def test_enable_refuses_privateuse1_taken_by_another_backend(built):
    out = run_child("""
    torch.utils.rename_privateuse1_backend("npu")
    import flagos_shm.emulation as emu
    try:
        emu.enable(2)
        emit({"error": None})
    except RuntimeError as exc:
        emit({"error": str(exc), "name": torch._C._get_privateuse1_backend_name()})
    """)
    assert "already registered as 'npu'" in out["error"]
    assert out["name"] == "npu"
