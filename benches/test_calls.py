"""pytest-benchmark suite: what one ``torch.distributed`` call through flagos_shm costs, beside
torch's floor for a Python backend and Gloo, and what staging a device tensor costs.

One process, world size 1 (a ``HashStore``): the collectives move no data between processes,
so these are the per-call costs a user pays in every call (torch's dispatch, the c10d
adapter, the Python side, the core's synchronisation, staging), the part that dominates
small messages; ``python -m flagos_shm.bench`` measures data movement between ranks.

* ``test_call``: ``dist.all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
  ``broadcast`` and ``all_to_all_single`` on CPU tensors at 4 B, 64 KiB and 1 MiB;
* ``test_floor``: ``dist.all_reduce`` of 4 B through the same adapter over a group that does
  nothing (torch's floor for a Python backend), and through Gloo;
* ``test_staged`` / ``test_device_copies``: ``dist.all_reduce`` of a tensor on the emulated
  ``flagos`` device, and the device copies alone (out to pinned memory, synchronise, back).

Run and compare::

    python -m pytest benches/test_calls.py --benchmark-enable --benchmark-save=before
    ... change something ...
    python -m pytest benches/test_calls.py --benchmark-enable --benchmark-compare

The README's test command collects this file with ``--benchmark-disable`` (pyproject's
``addopts``): each case runs once, checked against its expected values, as a smoke test.
Every call's result is checked after the timing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

SIZES = {"4B": 4, "64KiB": 64 << 10, "1MiB": 1 << 20}
NOOP = "flagos_shm_pytest_bench_noop"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def groups():
    """The default group (flagos_shm, world size 1), a no-op group behind the same adapter,
    and a Gloo group; destroyed after the module."""
    import flagos_shm  # noqa: F401  (registers the backend)
    from flagos_shm.backend import native
    from flagos_shm.bench.overhead import NoopGroup

    from flagos_shm import emulation

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    torch.set_num_threads(1)
    # The emulated flagos device (unless a real one is registered), before the group, so that
    # the group serves it. This file runs after the test suite, whose own process has none.
    emulation.enable()
    if NOOP not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            NOOP, lambda o, pg_options=None: native().ShmBackend(NoopGroup(), o.group_rank, o.group_size),
            extended_api=True, devices=["cpu"])
    dist.init_process_group("flagos_shm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield {"flagos_shm": dist.group.WORLD, "noop": dist.new_group([0], backend=NOOP),
               "gloo": dist.new_group([0], backend="gloo")}
    finally:
        dist.destroy_process_group()


def _case(op: str, nbytes: int, device="cpu"):
    """``(call, check)`` for ``op`` on float32 tensors of ``nbytes`` (world size 1)."""
    numel = max(nbytes // 4, 1)
    x = torch.arange(numel, dtype=torch.float32, device=device)
    if op == "all_reduce":
        return (lambda: dist.all_reduce(x)), (lambda: torch.equal(x.cpu(), torch.arange(numel, dtype=torch.float32)))
    if op == "all_gather_into_tensor":
        out = torch.empty(numel, device=device)
        return (lambda: dist.all_gather_into_tensor(out, x)), (lambda: torch.equal(out, x))
    if op == "reduce_scatter_tensor":
        out = torch.empty(numel, device=device)
        return (lambda: dist.reduce_scatter_tensor(out, x)), (lambda: torch.equal(out, x))
    if op == "broadcast":
        return (lambda: dist.broadcast(x, src=0)), (lambda: torch.equal(x.cpu(), torch.arange(numel,
                                                                                             dtype=torch.float32)))
    out = torch.empty(numel, device=device)
    return (lambda: dist.all_to_all_single(out, x)), (lambda: torch.equal(out, x))


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("op", ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                                "all_to_all_single"])
def test_call(benchmark, groups, op, size):
    benchmark.group = f"{op} {size}"
    call, check = _case(op, SIZES[size])
    benchmark(call)
    assert check()


@pytest.mark.parametrize("backend", ["noop", "gloo"])
def test_floor(benchmark, groups, backend):
    benchmark.group = "all_reduce 4B"
    x = torch.ones(1)
    benchmark(lambda: dist.all_reduce(x, group=groups[backend]))
    if backend == "gloo":
        assert x.item() == 1.0


@pytest.fixture(scope="module")
def flagos(groups):
    """Device 0 of the flagos device (the emulator, or a real one)."""
    return torch.device("flagos", 0)


@pytest.mark.parametrize("size", list(SIZES))
def test_staged(benchmark, flagos, size):
    benchmark.group = f"all_reduce {size}"
    call, check = _case("all_reduce", SIZES[size], flagos)
    benchmark(call)
    assert check()


@pytest.mark.parametrize("size", list(SIZES))
def test_device_copies(benchmark, flagos, size):
    benchmark.group = f"all_reduce {size}"
    nbytes = SIZES[size]
    src = torch.arange(nbytes, dtype=torch.uint8, device=flagos)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.flagos.current_stream(flagos)

    def copies():
        host.copy_(src, non_blocking=True)
        stream.synchronize()
        src.copy_(host, non_blocking=True)

    benchmark(copies)
    stream.synchronize()
    assert torch.equal(src.cpu(), torch.arange(nbytes, dtype=torch.uint8))

