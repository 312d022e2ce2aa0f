"""The emulated flagos device's runtime APIs: streams, events and the device module,
``torch.accelerator``, memory statistics following allocations, ``manual_seed``.

Each test runs its device code in a fresh interpreter and asserts here against references
computed on CPU in the same child (how and why: ``support/emulation_child.py``).
"""

from __future__ import annotations

import pytest

from support.emulation_child import run_child

pytestmark = pytest.mark.timeout(600)


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
