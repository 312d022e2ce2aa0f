"""flagos_shm on the (emulated) ``flagos`` device: every collective on flagos tensors against the
same collective on CPU copies, bitwise, for several layouts and dtypes.

The set-up these files share (the emulated device on ``flagos:<rank>``, references computed
another way in the same rank, skipped under ``--backend gloo``): ``support/flagos.py``.
"""

from __future__ import annotations

import os
import sys
import warnings
import zlib

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.flagos import CALL_TIMEOUT_S, check_close, check_device, check_equal, setup_device

pytestmark = pytest.mark.timeout(240)


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
    dev = setup_device()
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
                check_device(res, expected_device, f"{name} result {i}")
                check_equal(res, ref, f"{name} result {i} ({layout}, {dtype_name}) vs the CPU path")
            if name == "all_gather":
                for r in range(n):
                    check_equal(reference[r], _data("all_gather", r, m, dtype), f"all_gather CPU path [{r}]")
            if name == "all_reduce_SUM" and m:
                wide = torch.complex128 if dtype.is_complex else torch.float64
                expected = sum(_data("all_reduce", r, m, dtype).to(wide) for r in range(n))
                as_real = lambda t: torch.view_as_real(t) if t.is_complex() else t  # noqa: E731
                check_close(as_real(reference[0]), as_real(expected), "all_reduce SUM CPU path",
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
