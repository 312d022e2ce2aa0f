"""flagos_shm on the (emulated) ``flagos`` device: the "what must work" list of issue 3.

Every rank uses ``flagos:<rank>`` of the emulated PrivateUse1 device
(:mod:`flagos_shm.emulation`), enabled by ``FLAGOS_SHM_EMULATE=1`` before ``import
flagos_shm``. Two kinds of tests:

* **pool tests** run in the session's rank pools of ``conftest.worlds`` started with
  ``FLAGOS_SHM_EMULATE=1`` (default process group ``flagos_shm``): the issue's reproducer
  at world sizes 2 and 3, every collective on flagos tensors against the same collective on
  CPU copies (bitwise), DDP, FSDP2 against DDP with a DCP checkpoint, DTensor
  redistribution;
* **fresh-process tests** need a process without a default process group or with a
  particular import order, so they start their own ranks (:func:`spawn`): the reproducer at
  world size 1 with a ``HashStore``, ``init_process_group()`` with no backend name (for
  each order of enabling the emulator and importing flagos_shm), ``init_device_mesh``
  without a process group, and the refused ``"cpu:gloo,flagos:flagos_shm"`` string.

References are computed another way in the same rank: from every rank's inputs, which each
rank can regenerate (deterministic generators), on CPU; by the CPU path of the same
collective; or by a differently parallelised run (single process vs DDP, DDP vs FSDP2).
The file is skipped under ``--backend gloo`` (gloo has no flagos backend).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import warnings
import zlib

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.spawn import spawn  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
#: Environment of the pools and spawned ranks: the emulated device, enabled at import.
EMU_ENV = {"FLAGOS_SHM_EMULATE": "1", "FLAGOS_SHM_EMULATE_DEVICES": "4"}
#: Deadline of one pool call or one spawned group of ranks, seconds.
CALL_TIMEOUT_S = 120.0
SPAWN_TIMEOUT_S = 90.0
SEGMENT_GLOB = "flagos_shm-*"

pytestmark = pytest.mark.timeout(240)


# ==== fixtures ==================================================================================

@pytest.fixture(scope="module")
def emulator_built():
    """Compile (or find cached) the emulator's C++ part once, without enabling it here."""
    compiler = os.environ.get("CXX", "c++").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler {compiler!r} to build the flagos emulator")
    from flagos_shm import emulation

    return emulation.build()


@pytest.fixture
def flagos_world(worlds, backend, emulator_built):
    """``flagos_world(n)``: the session's pool of ``n`` flagos_shm ranks with the emulator."""
    if backend != "flagos_shm":
        pytest.skip("flagos tensors need the flagos_shm backend")
    return lambda world_size: worlds(world_size, **EMU_ENV)


@pytest.fixture
def fresh(backend, emulator_built):
    if backend != "flagos_shm":
        pytest.skip("flagos tensors need the flagos_shm backend")
    return spawn


# ==== helpers used in the ranks =================================================================

def _setup() -> torch.device:
    """Select ``flagos:<rank>`` as this rank's current device and return it."""
    rank = dist.get_rank()
    torch.flagos.set_device(rank)
    return torch.device("flagos", rank)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values (on CPU), for bitwise comparison."""
    t = t.detach().cpu()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().reshape(-1).view(torch.uint8)


def _check_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if actual.shape != expected.shape or not torch.equal(_bits(actual), _bits(expected)):
        raise AssertionError(f"{what}: values differ\nactual   {actual.cpu()}\nexpected {expected.cpu()}")


def _check_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = 1e-6) -> None:
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    if a.shape != e.shape or not torch.allclose(a, e, rtol=tol, atol=tol):
        raise AssertionError(f"{what}: values differ beyond {tol}\nactual   {a}\nexpected {e}")


def _check_device(t: torch.Tensor, device: torch.device, what: str) -> None:
    if t.device != device:
        raise AssertionError(f"{what}: result on {t.device}, expected {device}")


# ==== 9. the reproducer =================================================================

REPRO_SEED = 4242


def _repro_input(rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``x`` of the reproducer, regenerated on CPU."""
    torch.manual_seed(REPRO_SEED + rank)
    return torch.randn(10)


def rank_reproducer() -> dict:
    """The issue's reproducer on ``x = torch.randn(10, device="flagos")``: every collective
    with its values checked against references built from every rank's ``x`` on CPU.
    Returns the names of the checks that ran."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = _setup()
    done = []
    torch.manual_seed(REPRO_SEED + rank)
    x = torch.randn(10, device="flagos")
    xs = [_repro_input(r) for r in range(n)]
    _check_device(x, dev, "randn")
    _check_equal(x, xs[rank], "randn on flagos vs CPU (premise of the references)")
    stacked = torch.stack(xs).double()
    last = n - 1  # root of the rooted collectives: the last rank, so not always 0

    expected = {
        dist.ReduceOp.SUM: stacked.sum(0), dist.ReduceOp.AVG: stacked.mean(0),
        dist.ReduceOp.PRODUCT: stacked.prod(0), dist.ReduceOp.MIN: stacked.amin(0),
        dist.ReduceOp.MAX: stacked.amax(0),
    }
    for op, ref in expected.items():
        y = x.clone()
        dist.all_reduce(y, op=op)
        _check_device(y, dev, f"all_reduce {op}")
        _check_close(y, ref, f"all_reduce {op}")
        done.append(f"all_reduce_{op}")
    y = x.clone()
    dist.all_reduce(y, op=dist._make_nccl_premul_sum(0.5))
    _check_close(y, 0.5 * stacked.sum(0), "all_reduce PREMUL_SUM(0.5)")
    done.append("all_reduce_PREMUL_SUM")
    xi = (x * 100).to(torch.int64)
    ints = [(t * 100).to(torch.int64) for t in xs]
    for op, fn in ((dist.ReduceOp.BAND, torch.bitwise_and), (dist.ReduceOp.BOR, torch.bitwise_or),
                   (dist.ReduceOp.BXOR, torch.bitwise_xor)):
        y = xi.clone()
        dist.all_reduce(y, op=op)
        ref = ints[0]
        for t in ints[1:]:
            ref = fn(ref, t)
        _check_device(y, dev, f"all_reduce {op}")
        _check_equal(y, ref, f"all_reduce {op}")
        done.append(f"all_reduce_{op}")

    outs = [torch.full_like(x, -7.0) for _ in range(n)]
    dist.all_gather(outs, x)
    for r in range(n):
        _check_device(outs[r], dev, "all_gather")
        _check_equal(outs[r], xs[r], f"all_gather [{r}]")
    done.append("all_gather")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 2.13 renamed these two
        out = torch.full((n * 10,), -7.0, device=dev)
        dist.all_gather_into_tensor(out, x)
        _check_device(out, dev, "all_gather_into_tensor")
        _check_equal(out, torch.cat(xs), "all_gather_into_tensor")
        done.append("all_gather_into_tensor")

        # Rank r's input chunk j is x_r + j, so rank j receives sum_r(x_r) + n * j.
        big = torch.cat([x + j for j in range(n)])
        out = torch.full_like(x, -7.0)
        dist.reduce_scatter_tensor(out, big)
        _check_device(out, dev, "reduce_scatter_tensor")
        _check_close(out, stacked.sum(0) + n * rank, "reduce_scatter_tensor")
        done.append("reduce_scatter_tensor")

    out = torch.full_like(x, -7.0)
    dist.reduce_scatter(out, [x + j for j in range(n)], op=dist.ReduceOp.MAX)
    _check_device(out, dev, "reduce_scatter")
    _check_close(out, stacked.amax(0) + rank, "reduce_scatter MAX")
    done.append("reduce_scatter")

    y = x.clone()
    dist.broadcast(y, src=last)
    _check_device(y, dev, "broadcast")
    _check_equal(y, xs[last], "broadcast")
    done.append("broadcast")

    y = x.clone()
    dist.reduce(y, dst=last, op=dist.ReduceOp.SUM)
    _check_device(y, dev, "reduce")
    if rank == last:
        _check_close(y, stacked.sum(0), "reduce (root)")
    else:
        _check_equal(y, xs[rank], "reduce (non-root input unchanged)")
    done.append("reduce")

    glist = [torch.full_like(x, -7.0) for _ in range(n)] if rank == last else None
    dist.gather(x, glist, dst=last)
    if rank == last:
        for r in range(n):
            _check_device(glist[r], dev, "gather")
            _check_equal(glist[r], xs[r], f"gather [{r}]")
    done.append("gather")

    out = torch.full_like(x, -7.0)
    dist.scatter(out, [x + j for j in range(n)] if rank == last else None, src=last)
    _check_device(out, dev, "scatter")
    _check_equal(out, xs[last] + rank, "scatter")
    done.append("scatter")

    # all_to_all_single, equal splits: rank r's row j is x_r + j; rank r receives x_j + r.
    inp = torch.stack([x + j for j in range(n)])
    out = torch.full_like(inp, -7.0)
    dist.all_to_all_single(out, inp)
    _check_device(out, dev, "all_to_all_single")
    _check_equal(out, torch.stack([xs[j] + rank for j in range(n)]), "all_to_all_single")
    # Uneven splits: rank r sends r + j + 1 rows (all x_r + j) to rank j.
    in_splits = [rank + j + 1 for j in range(n)]
    inp = torch.cat([(x + j).expand(k, 10) for j, k in enumerate(in_splits)])
    out = torch.full((sum(in_splits), 10), -7.0, device=dev)  # receives j + rank + 1 rows from j
    dist.all_to_all_single(out, inp, output_split_sizes=in_splits, input_split_sizes=in_splits)
    _check_device(out, dev, "all_to_all_single (splits)")
    _check_equal(out, torch.cat([(xs[j] + rank).expand(k, 10) for j, k in enumerate(in_splits)]),
                 "all_to_all_single (splits)")
    done.append("all_to_all_single")

    outs = [torch.full_like(x, -7.0) for _ in range(n)]
    dist.all_to_all(outs, [x + j for j in range(n)])
    for j in range(n):
        _check_device(outs[j], dev, "all_to_all")
        _check_equal(outs[j], xs[j] + rank, f"all_to_all [{j}]")
    done.append("all_to_all")

    dist.barrier()
    done.append("barrier")

    objs = [{"from": rank, "x": x.cpu().tolist()}]
    dist.broadcast_object_list(objs, src=last)
    if objs != [{"from": last, "x": xs[last].tolist()}]:
        raise AssertionError(f"broadcast_object_list: got {objs}")
    gathered = [None] * n
    dist.all_gather_object(gathered, ("rank", rank, xs[rank].tolist()))
    if gathered != [("rank", r, xs[r].tolist()) for r in range(n)]:
        raise AssertionError(f"all_gather_object: got {gathered}")
    glist = [None] * n if rank == last else None
    dist.gather_object({"r": rank}, glist, dst=last)
    if rank == last and glist != [{"r": r} for r in range(n)]:
        raise AssertionError(f"gather_object: got {glist}")
    received = [None]
    dist.scatter_object_list(received, [f"to {r}" for r in range(n)] if rank == last else None, src=last)
    if received != [f"to {rank}"]:
        raise AssertionError(f"scatter_object_list: got {received}")
    done.append("object_collectives")
    return {"device": str(dev), "checks": done}


REPRO_CHECKS = 21  # entries of rank_reproducer's "checks" (9 all_reduce ops + 12 collectives)


@pytest.mark.parametrize("world_size", [2, 3])
def test_reproducer(flagos_world, world_size):
    results = flagos_world(world_size).run(rank_reproducer, timeout=CALL_TIMEOUT_S)
    for rank, res in enumerate(results):
        assert res["device"] == f"flagos:{rank}"
        assert len(res["checks"]) == REPRO_CHECKS, res["checks"]


def child_reproducer_world1(rank: int, world_size: int, tmp: str) -> dict:
    """The reproducer verbatim: world size 1, a HashStore, device "flagos"."""
    import flagos_shm  # noqa: F401  (FLAGOS_SHM_EMULATE=1: enables the emulator)

    dist.init_process_group(backend="flagos_shm", world_size=1, rank=0, store=dist.HashStore())
    try:
        return rank_reproducer()
    finally:
        dist.destroy_process_group()


def test_reproducer_world_size_1(fresh):
    (res,) = fresh(child_reproducer_world1, 1, env=EMU_ENV)
    assert res["device"] == "flagos:0"
    assert len(res["checks"]) == REPRO_CHECKS, res["checks"]


# ==== 10. every collective: flagos vs the CPU path, bitwise =====================================

_OPS_BY_KIND = {
    "float": ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"),
    "int": ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
    "complex": ("SUM", "AVG"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "complex64": torch.complex64}


def _kind(dtype: torch.dtype) -> str:
    return "complex" if dtype.is_complex else "float" if dtype.is_floating_point else "int"


def _redop(name: str):
    return dist._make_nccl_premul_sum(0.5) if name == "PREMUL_SUM" else getattr(dist.ReduceOp, name)


def _data(tag: str, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s deterministic CPU input for case ``tag``."""
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()) + 7919 * rank)
    if dtype.is_complex:
        return torch.randn(numel, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-9, 10, (numel,), generator=g).to(dtype)


class _Placer:
    """Puts CPU values on the device a run wants, in the layout the test wants.

    ``device``: where tensors go (CPU for the reference run). ``layout``: "contiguous",
    "noncontig" (every other element of a buffer twice as long), "empty" (callers pass 0
    elements), or "mixed" (list items alternate between CPU and ``device``).
    """

    def __init__(self, device: torch.device, layout: str):
        self.device, self.layout = device, layout

    def device_of(self, item: int) -> torch.device:
        return torch.device("cpu") if self.layout == "mixed" and item % 2 else self.device

    def __call__(self, values: torch.Tensor, item: int = 0) -> torch.Tensor:
        device = self.device_of(item)
        if self.layout != "noncontig":
            return values.clone().to(device)
        base = torch.zeros(*values.shape, 2, dtype=values.dtype, device=device)
        view = base[..., 1]
        view.copy_(values)
        if values.numel() > 1 and view.is_contiguous():
            raise AssertionError("noncontig placement produced a contiguous tensor")
        return view

    def sentinel(self, numel: int, dtype: torch.dtype, item: int = 0) -> torch.Tensor:
        return self(torch.full((numel,), -7, dtype=dtype), item)


def _collective_cases(n: int, rank: int, m: int, dtype: torch.dtype) -> dict:
    """name -> fn(place) running one collective on tensors made by ``place`` (a
    :class:`_Placer`) and returning the tensors it wrote (outputs, and in-place inputs)."""
    last = n - 1
    D = lambda tag, numel: _data(tag, rank, numel, dtype)  # noqa: E731
    cases = {}

    for name in _OPS_BY_KIND[_kind(dtype)]:
        def all_reduce(place, name=name):
            t = place(D("all_reduce", m))
            dist.all_reduce(t, op=_redop(name))
            return [t]
        cases[f"all_reduce_{name}"] = all_reduce

    def all_gather(place):
        outs = [place.sentinel(m, dtype, i) for i in range(n)]
        dist.all_gather(outs, place(D("all_gather", m)))
        return outs

    def all_gather_into_tensor(place):
        out = place.sentinel(n * m, dtype)
        dist.all_gather_into_tensor(out, place(D("all_gather_into_tensor", m)))
        return [out]

    def reduce_scatter_tensor(place, op="SUM"):
        out = place.sentinel(m, dtype)
        dist.reduce_scatter_tensor(out, place(D("reduce_scatter_tensor", n * m)), op=_redop(op))
        return [out]

    def reduce_scatter(place):
        out = place.sentinel(m, dtype)
        dist.reduce_scatter(out, [place(D(f"reduce_scatter{j}", m), j) for j in range(n)])
        return [out]

    def broadcast(place):
        t = place(D("broadcast", m))
        dist.broadcast(t, src=last)
        return [t]

    def reduce(place):
        t = place(D("reduce", m))
        dist.reduce(t, dst=last)
        return [t]

    def gather(place):
        inp = place(D("gather", m))
        outs = [place.sentinel(m, dtype, i) for i in range(n)] if rank == last else None
        dist.gather(inp, outs, dst=last)
        return (outs or []) + [inp]

    def scatter(place):
        out = place.sentinel(m, dtype)
        ins = [place(D(f"scatter{j}", m), j) for j in range(n)] if rank == last else None
        dist.scatter(out, ins, src=last)
        return [out]

    def all_to_all_single(place):
        out = place.sentinel(n * m, dtype)
        dist.all_to_all_single(out, place(D("all_to_all_single", n * m)))
        return [out]

    def all_to_all_single_splits(place):
        unit = 1 if m else 0
        splits = [(rank + j + 1) * unit for j in range(n)]  # symmetric: send == receive sizes
        out = place.sentinel(sum(splits), dtype)
        dist.all_to_all_single(out, place(D("all_to_all_single_splits", sum(splits))),
                               output_split_sizes=splits, input_split_sizes=splits)
        return [out]

    def all_to_all(place):
        outs = [place.sentinel(m, dtype, j) for j in range(n)]
        dist.all_to_all(outs, [place(D(f"all_to_all{j}", m), j) for j in range(n)])
        return outs

    def all_gather_single(place):  # 2.13's name for all_gather_into_tensor
        out = place.sentinel(n * m, dtype)
        dist.all_gather_single(out, place(D("all_gather_single", m)))
        return [out]

    def reduce_scatter_single(place):  # 2.13's name for reduce_scatter_tensor
        out = place.sentinel(m, dtype)
        dist.reduce_scatter_single(out, place(D("reduce_scatter_single", n * m)), op=dist.ReduceOp.MAX
                                   if not dtype.is_complex else dist.ReduceOp.SUM)
        return [out]

    if hasattr(dist, "all_gather_single"):
        cases.update(all_gather_single=all_gather_single, reduce_scatter_single=reduce_scatter_single)
    cases.update(all_gather=all_gather, all_gather_into_tensor=all_gather_into_tensor,
                 reduce_scatter_tensor=reduce_scatter_tensor, reduce_scatter=reduce_scatter,
                 broadcast=broadcast, reduce=reduce, gather=gather, scatter=scatter,
                 all_to_all_single=all_to_all_single, all_to_all_single_splits=all_to_all_single_splits,
                 all_to_all=all_to_all)
    cases["reduce_scatter_tensor_AVG"] = lambda place: reduce_scatter_tensor(place, "AVG")
    return cases


#: Cases whose tensors are lists (the only ones run with layout "mixed").
LIST_CASES = ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all")


def rank_flagos_vs_cpu(layout: str, dtype_name: str) -> list:
    """Run every collective twice, on CPU tensors and on flagos (or mixed) tensors with the
    same values, and compare the results bitwise; check each result's device. The CPU run of
    all_gather and all_reduce SUM is checked against values built from every rank's inputs.
    Returns the names of the cases that ran."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = _setup()
    dtype = DTYPES[dtype_name]
    m = 0 if layout == "empty" else 5
    cases = _collective_cases(n, rank, m, dtype)
    ran = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for name, case in cases.items():
            if layout == "mixed" and name not in LIST_CASES:
                continue
            cpu_place = _Placer(torch.device("cpu"), "noncontig" if layout == "noncontig" else "contiguous")
            dev_place = _Placer(dev, layout)
            reference = case(cpu_place)
            results = case(dev_place)
            if len(reference) != len(results):
                raise AssertionError(f"{name}: {len(results)} results, CPU path gave {len(reference)}")
            for i, (ref, res) in enumerate(zip(reference, results)):
                # In "mixed" runs the placer decides per list item: check against its choice.
                expected_device = dev_place.device_of(_item_index(name, i, n, rank))
                _check_device(res, expected_device, f"{name} result {i}")
                _check_equal(res, ref, f"{name} result {i} ({layout}, {dtype_name}) vs the CPU path")
            if name == "all_gather":
                for r in range(n):
                    _check_equal(reference[r], _data("all_gather", r, m, dtype), f"all_gather CPU path [{r}]")
            if name == "all_reduce_SUM" and m:
                wide = torch.complex128 if dtype.is_complex else torch.float64
                expected = sum(_data("all_reduce", r, m, dtype).to(wide) for r in range(n))
                as_real = lambda t: torch.view_as_real(t) if t.is_complex() else t  # noqa: E731
                _check_close(as_real(reference[0]), as_real(expected), "all_reduce SUM CPU path",
                             tol=1e-2 if dtype == torch.bfloat16 else 1e-5)
            ran.append(name)
    return ran


def _item_index(name: str, i: int, n: int, rank: int) -> int:
    """The placer item index of result ``i`` of case ``name`` (see :func:`_collective_cases`)."""
    if name in ("all_gather", "all_to_all"):
        return i
    if name == "gather" and rank == n - 1:
        return i if i < n else 0
    return 0


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ["contiguous", "noncontig", "empty", "mixed"])
def test_collectives_match_cpu_path(flagos_world, layout, dtype):
    ran = flagos_world(2).run(rank_flagos_vs_cpu, layout, dtype, timeout=CALL_TIMEOUT_S)
    singles = 2 if hasattr(dist, "all_gather_single") else 0
    expected = len(LIST_CASES) if layout == "mixed" else 12 + singles + len(_OPS_BY_KIND[_kind(DTYPES[dtype])])
    assert all(len(r) == expected for r in ran), ran


# ==== 11. DDP on flagos:<rank> vs one process on the concatenated batches ========================

DDP_STEPS, DDP_BATCH, DDP_IN, DDP_OUT = 4, 6, 8, 3


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DDP_IN, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, DDP_OUT))


def _ddp_batch(step: int, n: int):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(n * DDP_BATCH, DDP_IN, generator=g), torch.randint(0, DDP_OUT, (n * DDP_BATCH,), generator=g)


def rank_ddp_matches_single_process() -> dict:
    """DDP(device_ids=[rank]) on flagos:<rank>, ranks starting from different parameters
    (the constructor broadcasts rank 0's), against one CPU process training rank 0's
    initial model on the full batches. Returns max |difference| per parameter."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = _setup()
    model = _mlp(100 + rank).to(dev)
    ddp = DDP(model, device_ids=[rank], bucket_cap_mb=0.001)  # tiny buckets: several allreduces
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref = _mlp(100)
    ref_init = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rows = slice(rank * DDP_BATCH, (rank + 1) * DDP_BATCH)
    for step in range(DDP_STEPS):
        x, y = _ddp_batch(step, n)
        opt.zero_grad()
        out = ddp(x[rows].to(dev))
        _check_device(out, dev, "DDP output")
        torch.nn.functional.cross_entropy(out, y[rows].to(dev)).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    diffs = {}
    for (name, p), (_, q) in zip(model.state_dict().items(), ref.state_dict().items()):
        _check_device(p, dev, f"DDP parameter {name}")
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
    dev = _setup()
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


def test_ddp_matches_single_process(flagos_world):
    results = flagos_world(2).run(rank_ddp_matches_single_process, timeout=CALL_TIMEOUT_S)
    assert results[0] == results[1]  # both ranks hold the same parameters
    assert len(results[0]) == 6


# ==== 12. FSDP2 vs DDP on a small decoder-only transformer, with a DCP round trip ================

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 2, 16, 4
TF_STEPS, TF_CKPT_STEP = 20, 10
TF_TOL = dict(rtol=1e-5, atol=1e-5)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        # No qkv bias (as in Llama): the key bias's exact gradient is 0 (softmax ignores a
        # per-query shift), so AdamW would amplify its rounding noise into O(lr) updates.
        self.qkv, self.proj = torch.nn.Linear(DIM, 3 * DIM, bias=False), torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class _Decoder(torch.nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        torch.nn.init.normal_(self.tok.weight, std=0.02)  # GPT-2's init; N(0, 1) makes tied logits huge
        self.pos = torch.nn.Parameter(0.02 * torch.randn(SEQ, DIM))
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _decoder(tied: bool, seed: int) -> _Decoder:
    torch.manual_seed(seed)
    return _Decoder(tied)


def _tokens(step: int, rank: int, dev) -> torch.Tensor:
    """Rank ``rank``'s batch of step ``step``: two batches per rank, alternating, so that
    the loss falls within 20 steps."""
    g = torch.Generator().manual_seed(10_000 + 100 * (step % 2) + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(dev)


def _train_step(model, opt, tokens) -> tuple:
    """One AdamW step; returns (local loss, total gradient norm before clipping)."""
    opt.zero_grad()
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    opt.step()
    return loss.item(), norm.item()


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _full_state(model, opt) -> tuple:
    """Full (unsharded) model and optimizer state dicts on CPU, keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # cpu_offload=True would keep the result on rank 0 only; every rank compares here.
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    to_cpu = lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
    msd = {k: to_cpu(v) for k, v in msd.items()}
    osd = {"state": {k: {n: to_cpu(v) for n, v in s.items()} for k, s in osd["state"].items()},
           "param_groups": osd["param_groups"]}
    return msd, osd


def _fully_shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def rank_fsdp2_vs_ddp(tied: bool, ckpt_dir: str) -> dict:
    """20 AdamW steps under DDP and under FSDP2 (``fully_shard`` per block and root on
    ``init_device_mesh("flagos", (n,))``) from the same initial parameters and batches; the
    FSDP2 run saves model and optimizer with DCP after step 10 and continues in a *new*
    model and optimizer (different initial parameters) loaded from the checkpoint. Compares
    per-step losses, gradient norms and the final full state dicts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = _setup()

    model = _decoder(tied, seed=7).to(dev)
    if tied and model.head.weight is not model.tok.weight:
        raise AssertionError("tying lost by .to()")
    ddp = DDP(model, device_ids=[rank])
    opt = _adamw(ddp)
    ddp_log = [_train_step(ddp, opt, _tokens(s, rank, dev)) for s in range(TF_STEPS)]
    ddp_msd, ddp_osd = _full_state(ddp, opt)
    del ddp, model, opt

    mesh = init_device_mesh("flagos", (n,))
    model = _fully_shard(_decoder(tied, seed=7).to(dev), mesh)
    opt = _adamw(model)
    fsdp_log = [_train_step(model, opt, _tokens(s, rank, dev)) for s in range(TF_CKPT_STEP)]
    for p in model.parameters():
        if not isinstance(p, DTensor) or p.to_local().device != dev:
            raise AssertionError(f"FSDP2 parameter not a flagos DTensor: {type(p).__name__}")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    del model, opt, msd, osd

    model = _fully_shard(_decoder(tied, seed=99).to(dev), mesh)  # other parameters: load must overwrite
    opt = _adamw(model)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    fsdp_log += [_train_step(model, opt, _tokens(s, rank, dev)) for s in range(TF_CKPT_STEP, TF_STEPS)]
    fsdp_msd, fsdp_osd = _full_state(model, opt)

    for step, ((l1, g1), (l2, g2)) in enumerate(zip(ddp_log, fsdp_log)):
        if not (math.isclose(l1, l2, rel_tol=1e-5, abs_tol=1e-5) and math.isclose(g1, g2, rel_tol=1e-5, abs_tol=1e-5)):
            raise AssertionError(f"step {step}: DDP loss/grad norm {l1}/{g1} vs FSDP2 {l2}/{g2}")
    if set(ddp_msd) != set(fsdp_msd):
        raise AssertionError(f"model state keys differ: {sorted(set(ddp_msd) ^ set(fsdp_msd))}")
    initial = _decoder(tied, seed=7).state_dict()
    for key, value in ddp_msd.items():
        if not torch.allclose(fsdp_msd[key], value, **TF_TOL):
            raise AssertionError(f"model {key}: max |DDP - FSDP2| = {(fsdp_msd[key] - value).abs().max()}")
        if torch.equal(value, initial[key]):
            raise AssertionError(f"model {key} did not train")
    _compare_optim(ddp_osd, fsdp_osd)
    margin = {"loss": max(abs(a[0] - b[0]) for a, b in zip(ddp_log, fsdp_log)),
              "grad_norm": max(abs(a[1] - b[1]) for a, b in zip(ddp_log, fsdp_log)),
              "param": max((fsdp_msd[k] - v).abs().max().item() for k, v in ddp_msd.items())}
    return {"losses": [loss for loss, _ in fsdp_log], "grad_norms": [g for _, g in fsdp_log], "max_abs_diff": margin,
            "keys": sorted(ddp_msd), "ckpt_files": sorted(os.listdir(ckpt_dir)) if rank == 0 else None}


def _compare_optim(a: dict, b: dict) -> None:
    """Full optimizer state dicts (``state`` keyed by parameter name) agree within TF_TOL."""
    if set(a["state"]) != set(b["state"]):
        raise AssertionError(f"optimizer state keys differ: {sorted(set(a['state']) ^ set(b['state']))}")
    for name, sa in a["state"].items():
        for key, va in sa.items():
            vb = b["state"][name][key]
            if not torch.allclose(torch.as_tensor(vb).double(), torch.as_tensor(va).double(), **TF_TOL):
                raise AssertionError(f"optimizer {name}.{key}: DDP {va} vs FSDP2 {vb}")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fsdp2_matches_ddp_with_dcp_round_trip(flagos_world, tied, tmp_path):
    results = flagos_world(2).run(rank_fsdp2_vs_ddp, tied, str(tmp_path / "ckpt"), timeout=CALL_TIMEOUT_S)
    losses = results[0]["losses"]
    assert len(losses) == TF_STEPS and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses  # it trained
    assert results[0]["keys"] == results[1]["keys"]
    assert ("head.weight" in results[0]["keys"]) and ("tok.weight" in results[0]["keys"])
    assert any(f.endswith(".distcp") for f in results[0]["ckpt_files"]), results[0]["ckpt_files"]


# ==== 13. DTensor redistribution on a flagos mesh ===============================================

def rank_dtensor_redistribute() -> list:
    """Shard(0)->Replicate, Partial(sum/avg)->Replicate, Partial->Shard(0), and
    distribute_tensor's scatter from rank 0, on ``init_device_mesh("flagos", (n,))``;
    values against local references built from every rank's inputs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = _setup()
    mesh = init_device_mesh("flagos", (n,))
    if mesh.device_type != "flagos":
        raise AssertionError(f"mesh device type {mesh.device_type}")
    inputs = [torch.Generator().manual_seed(31 + r) for r in range(n)]
    local = [torch.randn(3 * n, 5, generator=g) for g in inputs]  # every rank's local tensor
    done = []

    full = local[0]
    dt = DTensor.from_local(full.chunk(n)[rank].to(dev), mesh, [Shard(0)])
    out = dt.redistribute(mesh, [Replicate()]).to_local()
    _check_device(out, dev, "Shard(0)->Replicate")
    _check_equal(out, full, "Shard(0)->Replicate")
    done.append("shard->replicate")

    stacked = torch.stack(local).double()
    for reduce_op, ref in (("sum", stacked.sum(0)), ("avg", stacked.mean(0))):
        dt = DTensor.from_local(local[rank].to(dev), mesh, [Partial(reduce_op)])
        out = dt.redistribute(mesh, [Replicate()]).to_local()
        _check_device(out, dev, f"Partial({reduce_op})->Replicate")
        _check_close(out, ref, f"Partial({reduce_op})->Replicate", tol=1e-5)
        done.append(f"partial_{reduce_op}->replicate")

    dt = DTensor.from_local(local[rank].to(dev), mesh, [Partial("sum")])
    out = dt.redistribute(mesh, [Shard(0)]).to_local()
    _check_device(out, dev, "Partial->Shard(0)")
    _check_close(out, stacked.sum(0).chunk(n)[rank], "Partial->Shard(0)", tol=1e-5)
    done.append("partial->shard")

    dt = distribute_tensor(local[rank].to(dev), mesh, [Shard(0)])  # rank 0's values are scattered
    _check_device(dt.to_local(), dev, "distribute_tensor")
    _check_equal(dt.to_local(), local[0].chunk(n)[rank], "distribute_tensor shard")
    _check_equal(dt.full_tensor(), local[0], "full_tensor")
    done.append("distribute_tensor")
    return done


def test_dtensor_redistribute(flagos_world):
    results = flagos_world(2).run(rank_dtensor_redistribute, timeout=CALL_TIMEOUT_S)
    assert all(len(r) == 5 for r in results), results


# ==== fresh processes: init without a backend name, import order, device mesh, refusal ==========

def child_default_backend(rank: int, world_size: int, tmp: str, order: str) -> dict:
    """``init_process_group()`` with no backend name, after enabling the emulator ``order``:
    "env" (FLAGOS_SHM_EMULATE=1 at import), "after" (``emulation.enable()`` after
    ``import flagos_shm``) or "before" (enabled before flagos_shm is imported)."""
    if order == "before":
        _enable_emulator_without_flagos_shm()
        if "flagos_shm.backend" in sys.modules:
            raise AssertionError("flagos_shm was imported before the emulator was enabled")
        if torch._C._get_privateuse1_backend_name() != "flagos":
            raise AssertionError("the emulator did not rename PrivateUse1")
        import flagos_shm  # noqa: F401
    elif order == "after":
        import flagos_shm

        if torch._C._get_privateuse1_backend_name() != "privateuseone":
            raise AssertionError("the emulator was enabled by import (FLAGOS_SHM_EMULATE set?)")
        from flagos_shm import emulation

        emulation.enable()
    else:
        import flagos_shm  # noqa: F401
    mapped = dist.Backend.default_device_backend_map.get("flagos")
    dist.init_process_group(init_method="file://" + os.path.join(tmp, "store"), rank=rank, world_size=world_size)
    try:
        dev = _setup()
        t = torch.full((5,), float(rank + 1), device=dev)
        dist.all_reduce(t)
        _check_device(t, dev, "all_reduce")
        host = torch.arange(4.0) * (rank + 1)
        dist.all_reduce(host)
        return {**_backend_report(), "mapped": mapped, "flagos": t.cpu().tolist(),
                "cpu": host.tolist(), "accelerator": str(torch.accelerator.current_accelerator())}
    finally:
        dist.destroy_process_group()


def _backend_report(group=None) -> dict:
    """What the process group says about its backend. ``dist.get_backend()`` returns the
    string given to ``init_process_group``, so "undefined" when none was given (torch 2.13
    does the same for NCCL); the per-device config and the group object show the choice."""
    pg = group or dist.distributed_c10d._get_default_group()
    return {"backend": str(dist.get_backend(pg)), "config": dist.get_backend_config(pg),
            "group_type": type(pg).__name__, "backend_name": (pg if hasattr(pg, "getBackendName")
                             else pg._get_backend(torch.device("flagos"))).name()}


def _check_backend_report(res: dict) -> None:
    assert res["backend"] in ("undefined", "flagos_shm"), res
    # per-device backends in torch's own ProcessGroup, on every torch
    assert res["config"] == "cpu:flagos_shm,flagos:flagos_shm", res
    assert res["group_type"] == "ProcessGroup" and res["backend_name"] == "flagos_shm", res


def _enable_emulator_without_flagos_shm() -> None:
    """Enable the emulator while the ``flagos_shm`` package (its ``__init__``, which
    registers the backend) has not run, like a vendor plugin imported first: import
    ``flagos_shm.emulation`` under a bare stand-in parent package, enable, then drop the
    stand-in so that a later ``import flagos_shm`` runs the real package."""
    import importlib
    import importlib.util
    import types

    spec = importlib.util.find_spec("flagos_shm")  # locates the package without importing it
    stub = types.ModuleType("flagos_shm")
    stub.__path__ = list(spec.submodule_search_locations)
    sys.modules["flagos_shm"] = stub
    try:
        importlib.import_module("flagos_shm.emulation._device")  # enable() imports it
        importlib.import_module("flagos_shm.emulation").enable()
    finally:
        del sys.modules["flagos_shm"]


@pytest.mark.parametrize("order", ["env", "after", "before"])
def test_init_without_backend_name_picks_flagos_shm(fresh, order):
    env = EMU_ENV if order == "env" else {"FLAGOS_SHM_EMULATE_DEVICES": "4"}
    results = fresh(child_default_backend, 2, env=env, args=(order,))
    for res in results:
        _check_backend_report(res)
        assert res["mapped"] == "flagos_shm", res
        assert res["accelerator"] == "flagos", res
        assert res["flagos"] == [3.0] * 5
        assert res["cpu"] == [0.0, 3.0, 6.0, 9.0]


def child_device_mesh_without_group(rank: int, world_size: int, tmp: str, set_device_first: bool) -> dict:
    """``init_device_mesh("flagos", (n,))`` as the first distributed call (env:// rendezvous
    from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, no LOCAL_RANK). ``set_device_first``:
    select flagos:<rank> before (torch's recommendation); otherwise the mesh must pick it."""
    import flagos_shm  # noqa: F401

    if set_device_first:
        torch.flagos.set_device(rank)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if dist.is_initialized():
        raise AssertionError("a process group exists before init_device_mesh")
    initialized_before = torch.flagos.is_initialized()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "set the device before the mesh"
        mesh = init_device_mesh("flagos", (world_size,))
    try:
        dev = torch.device("flagos", torch.flagos.current_device())
        local = torch.full((2, 3), float(rank + 1), device=dev)
        full = DTensor.from_local(local, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()
        t = torch.ones(4, device=dev)
        dist.all_reduce(t, group=mesh.get_group())
        return {**_backend_report(mesh.get_group()), "device": str(dev), "full": full.cpu().tolist(),
                "sum": t.cpu().tolist(), "mesh_device": mesh.device_type, "initialized_before": initialized_before}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("set_device_first", [True, False], ids=["device_set", "device_from_mesh"])
def test_init_device_mesh_without_process_group(fresh, set_device_first):
    results = fresh(child_device_mesh_without_group, 2, env=EMU_ENV, args=(set_device_first,))
    for rank, res in enumerate(results):
        _check_backend_report(res)
        assert res["mesh_device"] == "flagos", res
    for rank, res in enumerate(results):
        assert res["device"] == f"flagos:{rank}", res
        assert res["full"] == [[1.0] * 3] * 2 + [[2.0] * 3] * 2
        assert res["sum"] == [2.0] * 4
