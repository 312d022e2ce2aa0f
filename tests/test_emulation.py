"""Tests of the emulated flagos device (flagos_shm.emulation).

Enabling the device renames PrivateUse1 for the whole process and cannot be
undone, so every test that enables it runs a fresh interpreter
(``subprocess.run([sys.executable, "-c", ...])``). The child prints one line
``RESULT:<json>``; the assertions run here, against references computed on
CPU in the same child (or constants).

The C++ part is compiled once per session by the ``built`` fixture (cached in
the user cache, see ``flagos_shm.emulation.build``); children then only load
it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(600)

CHILD_TIMEOUT = 240  # seconds; a child imports torch (~3 s) and runs small models

PRELUDE = """
import json, os, sys
import torch

def emit(value):
    print("RESULT:" + json.dumps(value), flush=True)
"""


def _child_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLAGOS_SHM_EMULATE", "FLAGOS_SHM_EMULATE_DEVICES")}
    env.update(extra or {})
    return env


def run_child(code: str, env: dict | None = None, timeout: float = CHILD_TIMEOUT):
    """Run ``code`` in a new interpreter; return the value it emitted."""
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, env=_child_env(env),
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    assert len(lines) == 1, f"expected one RESULT line:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[0][len("RESULT:"):])


@pytest.fixture(scope="module")
def built():
    """Compile (or find cached) the extension once, without loading it here."""
    compiler = os.environ.get("CXX", "c++").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler {compiler!r} to build the flagos emulator")
    from flagos_shm import emulation
    path = emulation.build()
    assert os.path.isfile(path)
    return path


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


def test_streams_events_and_device_module(built):
    out = run_child("""
    import flagos_shm.emulation as emu
    emu.enable(3)
    M = torch.flagos
    res = {}
    M.set_device(0)
    s = M.Stream(priority=-1)
    s2 = M.Stream(device="flagos:2")
    res["stream"] = [isinstance(s, torch.Stream), s.priority, s.device_index, s2.device_index,
                     s.stream_id != s2.stream_id, s.stream_id != 0]
    res["default"] = [M.current_stream().stream_id, M.default_stream(1).stream_id,
                      M.current_stream() == M.default_stream()]
    with M.stream(s):
        inside = [M.current_stream() == s, M.current_device()]
        y = torch.ones(3, device="flagos") * 2
    with M.stream(s2):                       # a stream on another device switches device
        inside2 = [M.current_stream(2) == s2, M.current_device()]
    with s2:
        inside3 = M.current_stream(2) == s2
    with M.stream(None):
        pass
    res["contexts"] = [inside, inside2, inside3, M.current_stream().stream_id,
                       M.current_stream(2).stream_id, M.current_device(), y.cpu().tolist()]
    start, end = M.Event(enable_timing=True), M.Event(enable_timing=True)
    start.record()
    s.wait_event(start)
    s.wait_stream(M.current_stream())
    end.record(s)
    end.wait()
    end.synchronize()
    ev = s.record_event()
    res["events"] = [start.query(), end.query(), s.query(), isinstance(ev, M.Event),
                     start.elapsed_time(end) >= 0.0, M.synchronize() is None]
    try:
        M.Event().elapsed_time(M.Event())
        res["unrecorded"] = None
    except RuntimeError as exc:
        res["unrecorded"] = str(exc)
    generic = torch.Stream(device="flagos:1")
    gev = torch.Event(device="flagos:1", enable_timing=True)
    gev.record(generic)
    res["generic"] = [generic.device_type == s.device_type, generic.query(), gev.query()]
    with M.device(2):
        in_dev = [M.current_device(), str(torch.empty(1, device="flagos").device)]
    with M.device("flagos:1"):
        in_dev.append(M.current_device())
    res["device_ctx"] = [in_dev, M.current_device()]
    errors = []
    for bad in (5, "cpu", "flagos:9"):
        try:
            M.set_device(bad)
        except ValueError as exc:
            errors.append(type(exc).__name__)
    try:
        M.set_device(1.0)
    except TypeError as exc:
        errors.append(type(exc).__name__)
    res["set_device_errors"] = errors
    res["module"] = [M.device_count(), M.is_available(), M.is_initialized(),
                     [str(d) for d in M.get_amp_supported_dtype()]]
    M.manual_seed(7); a = torch.randn(4, device="flagos:1").cpu()
    torch.manual_seed(7); b = torch.randn(4)
    state = M.get_rng_state(); c = torch.randn(3, device="flagos:0").cpu()
    M.set_rng_state(state); d = torch.randn(3, device="flagos:0").cpu()
    res["rng"] = [torch.equal(a, b), torch.equal(c, d), M.initial_seed()]
    emit(res)
    """)
    assert out["stream"] == [True, -1, 0, 2, True, True]
    assert out["default"] == [0, 0, True]
    assert out["contexts"] == [[True, 0], [True, 2], True, 0, 0, 0, [2.0, 2.0, 2.0]]
    assert out["events"] == [True, True, True, True, True, True]
    assert "must be recorded" in out["unrecorded"]
    assert out["generic"] == [True, True, True]
    assert out["device_ctx"] == [[2, "flagos:2", 1], 0]
    assert out["set_device_errors"] == ["ValueError", "ValueError", "ValueError", "TypeError"]
    assert out["module"] == [3, True, True, ["torch.float16", "torch.bfloat16", "torch.float32"]]
    assert out["rng"] == [True, True, 7]


def test_torch_accelerator_api(built):
    out = run_child("""
    import flagos_shm.emulation as emu
    res = {"enabled": emu.enable()}          # count from FLAGOS_SHM_EMULATE_DEVICES
    acc = torch.accelerator
    res["basic"] = [str(acc.current_accelerator()), acc.device_count(), acc.is_available()]
    acc.set_device_index(2)
    res["index"] = [acc.current_device_index(), torch.flagos.current_device(),
                    str(torch.empty(1, device="flagos").device)]
    acc.set_device_index(0)
    stream = acc.current_stream(1)
    res["stream"] = [stream.device_index, stream.stream_id, acc.synchronize(1) is None]
    base = acc.memory_allocated(1)
    t = torch.empty(256, dtype=torch.float32, device="flagos:1")
    grown = acc.memory_allocated(1)
    peak = acc.max_memory_allocated(1)
    del t
    res["memory"] = [grown - base, acc.memory_allocated(1) - base, peak >= grown,
                     acc.memory_allocated(0)]
    acc.reset_peak_memory_stats(1)
    res["peak_reset"] = acc.max_memory_allocated(1) == acc.memory_allocated(1)
    emit(res)
    """, env={"FLAGOS_SHM_EMULATE_DEVICES": "4"})
    assert out["enabled"] is True
    assert out["basic"] == ["flagos", 4, True]
    assert out["index"] == [2, 2, "flagos:2"]
    assert out["stream"] == [1, 0, True]
    assert out["memory"] == [1024, 0, True, 0]
    assert out["peak_reset"] is True


def test_memory_stats_follow_allocations(built):
    """torch.flagos.memory_allocated & co. are the allocator's real numbers: a tensor raises
    them by its bytes (numel * element_size; the allocator does not round), its free lowers
    them again, each device counts on its own, and the peak resets to the current value."""
    out = run_child("""
    import flagos_shm.emulation as emu
    emu.enable(2)
    M = torch.flagos
    M.set_device(1)
    cases = []
    for dtype, shape in [(torch.float32, (256,)), (torch.float16, (7, 13)),
                         (torch.int64, (3, 5, 2)), (torch.bool, (1001,)),
                         (torch.complex64, (9,)), (torch.float32, (0,))]:
        base, base0 = M.memory_allocated(), M.memory_allocated(0)
        t = torch.empty(shape, dtype=dtype, device="flagos")
        expected = t.numel() * torch.empty((), dtype=dtype).element_size()
        grown = M.memory_allocated()
        peak = M.max_memory_allocated(1)
        reserved = M.memory_reserved("flagos:1")
        del t
        cases.append([grown - base, expected, M.memory_allocated(1) - base,
                      M.memory_allocated(0) - base0, peak >= grown, reserved == grown])
    big = torch.empty(4096, device="flagos:1")
    small = torch.empty(16, device="flagos:1")
    del big
    before_reset = M.max_memory_allocated()
    M.reset_peak_memory_stats()
    after_reset = [M.max_memory_allocated(), M.memory_allocated()]
    M.reset_max_memory_allocated(1)
    M.empty_cache()                          # nothing cached: nothing changes
    stats = M.memory_stats(1)
    acc = getattr(torch.accelerator, "memory_allocated", None)   # another path to the stats
    free, total = M.mem_get_info()
    emit({"cases": cases, "before_reset_ge": before_reset - after_reset[1] >= 4096 * 4,
          "after_reset": after_reset[0] == after_reset[1],
          "after_empty_cache": M.memory_allocated() == after_reset[1],
          "stats": [stats["allocated_bytes.all.current"] == M.memory_allocated(1),
                    stats["num_device_alloc"] - stats["num_device_free"]
                    == stats["allocation.all.current"]],
          "accelerator": None if acc is None else acc(1) == M.memory_allocated(1),
          "mem_info": 0 < free <= total, "empty_cache": M.empty_cache() is None})
    """)
    for grown, expected, left, other_device, peak_ok, reserved_ok in out["cases"]:
        assert grown == expected and left == 0 and other_device == 0
        assert peak_ok and reserved_ok
    assert out["before_reset_ge"] and out["after_reset"] and out["after_empty_cache"]
    assert out["stats"] == [True, True]
    assert out["accelerator"] in (True, None)
    assert out["mem_info"] and out["empty_cache"]


def test_manual_seed_reproducible(built):
    """manual_seed/manual_seed_all make flagos draws repeat; a second seed differs; the draws
    equal the CPU generator's (the emulated devices share it)."""
    out = run_child("""
    import flagos_shm.emulation as emu
    emu.enable(2)
    M = torch.flagos
    def draw():
        return torch.randn(8, device="flagos:1").cpu().tolist() + \\
               torch.rand(3, device="flagos:0").cpu().tolist()
    M.manual_seed(1234); a = draw()
    M.manual_seed(1234); b = draw()
    M.manual_seed_all(1234); c = draw()
    M.manual_seed(4321); d = draw()
    g = torch.Generator().manual_seed(1234)
    ref = torch.randn(8, generator=g).tolist() + torch.rand(3, generator=g).tolist()
    emit({"same": a == b == c, "other_seed_differs": a != d, "cpu_reference": a == ref,
          "initial_seed": M.initial_seed()})
    """)
    assert out == {"same": True, "other_seed_differs": True, "cpu_reference": True,
                   "initial_seed": 4321}


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
                          timeout=CHILD_TIMEOUT, env=_child_env(), cwd=str(tmp_path))
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
                              env=_child_env({"FLAGOS_SHM_EXTEND_GLOO": "0"}))
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
