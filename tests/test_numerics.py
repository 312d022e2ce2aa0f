"""Numerics under stress: property tests (hypothesis) and half-precision overflow.

Hypothesis draws a case (collective, dtype, reduce op, shape, and for each tensor a view:
a permutation of its dimensions, a step per dimension, a storage offset; sometimes a
message of 2.5 chunk slots) and runs it in the session's long-lived rank pools
(``conftest.worlds``, world sizes 1-4): no process is started per example. Every rank
regenerates all ranks' inputs from the case (``reference.make_input``), runs the collective
through ``torch.distributed`` on its views, and compares what landed in its views with
``reference.reference_reduce`` or the plain data movement (``reference.compare``: bitwise
for integers, data movement and SUM/PRODUCT/MIN/MAX; a few ulps for AVG/PREMUL_SUM); the
elements of each view's buffer outside the view must keep their sentinel. The pytest side
also checks that ranks that should hold the same result hold the same bytes.

``FLAGOS_SHM_HYPOTHESIS_EXAMPLES`` sets the number of examples per world size (default
:data:`EXAMPLES`; raise it for a longer search).
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.reference import (DTYPES_WITH_COMPLEX, SENTINEL, compare, large_numel, make_input, op_allowed,
                               reduce_op, reference_reduce)

EXAMPLES = int(os.environ.get("FLAGOS_SHM_HYPOTHESIS_EXAMPLES", "50"))
COLLECTIVES = ["all_reduce", "reduce", "broadcast", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
               "all_to_all_single"]
REDUCING = ("all_reduce", "reduce", "reduce_scatter_tensor")
#: Collectives after which every rank holds the same bytes.
SAME_ON_ALL = ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather")
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM", "BAND", "BOR", "BXOR"]

pytestmark = pytest.mark.timeout(300)


# ---- views ------------------------------------------------------------------------------------------

def make_view(values: torch.Tensor, spec: dict, fill_from: torch.Tensor = None):
    """A tensor of ``values``' shape and dtype holding ``values`` (or, if ``fill_from`` is
    given, the placeholder ``fill_from``), stored as ``spec`` says: ``perm`` (the view's
    dim i is dim ``perm[i]`` of its buffer), ``steps`` (per view dim), ``offset`` (storage
    offset of the buffer). Returns ``(view, check)``: ``check()`` is None while every buffer
    element outside the view still holds the sentinel, else a description."""
    shape = list(values.shape)
    d = len(shape)
    perm = list(spec["perm"][:d]) if d else []
    perm = perm if sorted(perm) == list(range(d)) else list(range(d))
    steps = (list(spec["steps"]) + [1] * d)[:d]
    base_shape = [0] * d
    for i in range(d):
        base_shape[perm[i]] = shape[i] * steps[i]
    numel = 1
    for s in base_shape:
        numel *= s
    offset = spec["offset"]
    sentinel = True if values.dtype == torch.bool else SENTINEL
    flat = torch.full((offset + numel + 2,), sentinel, dtype=values.dtype)
    mark = torch.zeros(flat.shape, dtype=torch.bool)

    def shaped(buf):
        base = buf[offset:offset + numel].view(base_shape)
        v = base.permute(perm) if d else base
        return v[tuple(slice(None, None, s) for s in steps)] if d else v

    view = shaped(flat)
    shaped(mark).fill_(True)
    view.copy_(values if fill_from is None else fill_from)
    keep = flat[~mark].clone()

    def check():
        return None if torch.equal(flat[~mark], keep) else "elements outside the view were modified"
    return view, check


def _digest(t: torch.Tensor) -> str:
    t = torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1)  # fresh strides, even for size-1 dims
    if t.dtype.is_complex:
        t = torch.view_as_real(t).reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def test_make_view_builds_the_requested_layout():
    """The views really are permuted, strided and offset, hold the values, and the guard
    notices a write outside them (so the property test can fail)."""
    values = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    view, check = make_view(values, {"perm": [2, 0, 1], "steps": [2, 1, 3], "offset": 5})
    assert torch.equal(view, values) and view.shape == values.shape
    assert not view.is_contiguous() and view.storage_offset() == 5
    # buffer (3, 12, 4); view dim i = buffer dim perm[i], then every steps[i]-th element
    assert view.stride() == (2, 48, 12)
    assert check() is None
    flat = torch.tensor([], dtype=torch.float32).set_(view.untyped_storage())
    flat[0] = -1.0  # outside the view (before its offset)
    assert check() is not None
    scalar, check0 = make_view(torch.tensor(3.5), {"perm": [0, 1, 2], "steps": [3, 3, 3], "offset": 3})
    assert scalar.dim() == 0 and scalar.item() == 3.5 and check0() is None


# ---- the rank side ----------------------------------------------------------------------------------

def rank_case(case: dict) -> dict:
    """Run one drawn case on this rank; return ``{"failures": [...], "digest": ...}``."""
    rank, n = dist.get_rank(), dist.get_world_size()
    kind, op, seed = case["collective"], case["op"], case["seed"]
    dtype = getattr(torch, case["dtype"])
    shape = tuple(case["shape"])
    numel = 1
    for s in shape:
        numel *= s
    root = case["root"] % n
    failures: list = []
    views = iter(case["views"])

    def inputs_of(count, tag, shp):
        return [make_input(dtype, count, "hyp", seed, tag, f"rank{r}", op=op if kind in REDUCING else None)
                .reshape(shp) for r in range(n)]

    guards = []

    def place(values, fill=None):
        v, g = make_view(values, next(views), fill)
        guards.append(g)
        return v

    def placeholder(shp):
        return torch.zeros(shp, dtype=dtype) if dtype != torch.bool else torch.ones(shp, dtype=dtype)

    redop = reduce_op(op) if kind in REDUCING else None
    if kind == "all_reduce":
        ins = inputs_of(numel, "x", shape)
        got = place(ins[rank])
        dist.all_reduce(got, op=redop)
        expected, terms = reference_reduce(ins, op), ins
    elif kind == "reduce":
        ins = inputs_of(numel, "x", shape)
        got = place(ins[rank])
        dist.reduce(got, dst=root, op=redop)
        expected, terms = (reference_reduce(ins, op) if rank == root else ins[rank]), ins
    elif kind == "broadcast":
        ins = inputs_of(numel, "x", shape)
        got = place(ins[rank])
        dist.broadcast(got, src=root)
        expected, terms = ins[root], None
    elif kind == "all_gather_into_tensor":
        ins = inputs_of(numel, "x", shape)
        src = place(ins[rank])
        got = place(placeholder((n * numel,)))
        dist.all_gather_into_tensor(got, src)
        expected, terms = torch.cat([x.reshape(-1) for x in ins]), None
    elif kind == "all_gather":
        ins = inputs_of(numel, "x", shape)
        src = place(ins[rank])
        outs = [place(placeholder(shape)) for _ in range(n)]
        dist.all_gather(outs, src)
        got = torch.cat([o.reshape(-1) for o in outs])
        expected, terms = torch.cat([x.reshape(-1) for x in ins]), None
    elif kind == "reduce_scatter_tensor":
        ins = inputs_of(n * numel, "x", (n * numel,))
        src = place(ins[rank])
        got = place(placeholder(shape))
        dist.reduce_scatter_tensor(got, src, op=redop)
        pieces = [x[rank * numel:(rank + 1) * numel].reshape(shape) for x in ins]
        expected, terms = reference_reduce(pieces, op), pieces
    elif kind == "all_to_all_single":
        ins = inputs_of(n * numel, "x", (n * numel,))
        src = place(ins[rank])
        got = place(placeholder((n * numel,)))
        dist.all_to_all_single(got, src)
        expected, terms = torch.cat([x[rank * numel:(rank + 1) * numel] for x in ins]), None
    else:
        raise ValueError(f"collective: unknown {kind!r}")
    msg = compare(got, expected, op=op if kind in REDUCING else None, exact=True, inputs=terms)
    if msg:
        failures.append(f"rank {rank}: {msg}")
    for g in guards:
        if g() is not None:
            failures.append(f"rank {rank}: {g()}")
    return {"failures": failures, "digest": _digest(got)}


# ---- strategies -------------------------------------------------------------------------------------

view_specs = st.fixed_dictionaries({
    "perm": st.permutations([0, 1, 2]),
    "steps": st.lists(st.sampled_from([1, 1, 2, 3]), min_size=3, max_size=3),
    "offset": st.sampled_from([0, 0, 1, 3, 5]),
})


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(COLLECTIVES))
    dtype = draw(st.sampled_from(DTYPES_WITH_COMPLEX))
    op = "SUM"
    if kind in REDUCING:
        op = draw(st.sampled_from([o for o in OPS if op_allowed(dtype, o)]))
    if draw(st.integers(0, 9)) == 0:  # sometimes a message of 2.5 chunk slots (3 chunks)
        shape = [large_numel(dtype)]
    else:
        shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=3))
    return {
        "collective": kind, "dtype": str(dtype).replace("torch.", ""), "op": op, "shape": shape,
        "root": draw(st.integers(0, 3)), "seed": draw(st.integers(0, 2**31 - 1)),
        "views": draw(st.lists(view_specs, min_size=6, max_size=6)),
    }


# ---- the tests --------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_random_collectives_match_reference(worlds, backend, world_size):
    """Random collective x dtype x op x shape x views (permuted, strided, offset), in the
    pool of ``world_size`` ranks: values match the reference, buffers outside the views are
    untouched, and all ranks hold the same bytes where the result is shared."""
    if backend != "flagos_shm":
        pytest.skip("the reference follows flagos_shm's documented summation order")
    world = worlds(world_size)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=False, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases())
    def check(case):
        results = world.run(rank_case, case, timeout=60)
        failures = [f for res in results for f in res["failures"]]
        assert not failures, f"{case}: " + "; ".join(failures)
        if case["collective"] in SAME_ON_ALL:
            digests = {res["digest"] for res in results}
            assert len(digests) == 1, f"{case}: ranks hold different bytes"

    check()


# ---- half-precision overflow -------------------------------------------------------------------------

#: name: (dtype, op, the value of each rank 0..3, expected at world sizes 2, 3, 4)
OVERFLOW_CASES = {
    "fp16 60000 + 60000": ("float16", "SUM", [60000.0] * 4, [float("inf")] * 3),
    "fp16 -60000 - 60000": ("float16", "SUM", [-60000.0] * 4, [-float("inf")] * 3),
    # accumulated in float32 and rounded once: a partial sum above the fp16 range is fine
    "fp16 60000 + 60000 - 60000": ("float16", "SUM", [60000.0, 60000.0, -60000.0, -60000.0],
                                   [float("inf"), 60000.0, 0.0]),
    "fp16 AVG of 60000s": ("float16", "AVG", [60000.0] * 4, [60000.0] * 3),
    "fp16 300 * 300": ("float16", "PRODUCT", [300.0] * 4, [float("inf")] * 3),
    "bf16 3e38 + 3e38": ("bfloat16", "SUM", [3e38] * 4, [float("inf")] * 3),
    "bf16 MAX with inf": ("bfloat16", "MAX", [1.0, float("inf"), 2.0, -float("inf")], [float("inf")] * 3),
}


def rank_overflow() -> dict:
    """Every overflow case at this pool's world size: the result of each rank (as bytes,
    hex) and whether it equals the expected value and the reference reduction."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (dtype_name, op, values, expected) in OVERFLOW_CASES.items():
        dtype = getattr(torch, dtype_name)
        ins = [torch.full((33,), values[r], dtype=dtype) for r in range(n)]  # 33: vector body and tail
        t = ins[rank].clone()
        dist.all_reduce(t, op=reduce_op(op))
        want = torch.full((33,), expected[n - 2], dtype=dtype)
        out[name] = {"bytes": _digest(t), "expected": bool(torch.equal(t, want)),
                     "reference": compare(t, reference_reduce(ins, op), op=op, inputs=ins) is None,
                     "got": t[0].item()}
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_half_precision_overflow_is_inf_on_every_rank(worlds, backend, world_size):
    """fp16/bf16 sums and products that overflow give +-inf on every rank, bitwise
    identical; partial sums beyond the fp16 range do not overflow (float32 accumulation)."""
    if backend != "flagos_shm":
        pytest.skip("float32 accumulation of half types is flagos_shm's documented rule")
    results = worlds(world_size).run(rank_overflow)
    for name in OVERFLOW_CASES:
        per_rank = [res[name] for res in results]
        assert all(r["expected"] and r["reference"] for r in per_rank), (name, per_rank)
        assert len({r["bytes"] for r in per_rank}) == 1, (name, per_rank)
