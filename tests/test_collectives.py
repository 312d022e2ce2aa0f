"""Every collective x dtype x reduce op x size at world sizes 1-4, against references.

Each ``rank_*`` function runs inside every rank process of a pool (``harness.World``): it
loops over many cases of one collective, generates every rank's inputs deterministically
(``reference.make_input``), runs the collective through ``torch.distributed`` and compares
the result with ``reference.reference_reduce`` or the plain data movement, returning
``{"checked": <cases>, "failures": [<case: mismatch>, ...]}``. The pytest side merges the
ranks' reports and fails with every failing case listed.

Sizes are 0, 1, 3, 7 elements and a large one (``reference.large_numel``): 2.5 chunk
slots, about 640 KiB with the suite's 256 KiB slot (conftest.py pins it;
``test_collective_default_slots`` runs four collectives with the core's default), which goes through the slots in 3
chunks and, at 2-4 ranks, takes the two-step allreduce (above ``_core.ONE_SHOT_MAX_BYTES``).
The large size is above ``_core.CMA_MIN_BYTES``, so allreduce, broadcast, allgather and
reduce-scatter take the single-copy path (``process_vm_readv``) where the machine allows it.
``test_collective_small_slots`` repeats six collectives in pools with 4 KiB slots
(``FLAGOS_SHM_SLOT_BYTES=4096``) and single-copy off (``FLAGOS_SHM_CMA=0``), where the
large size is 320 KiB: 80 chunks through the slots, two-step allreduce, slices of each
chunk not divisible by 3.

Cases that gloo does not support are skipped when the suite runs with ``--backend gloo``
(``_gloo_lacks``); with flagos_shm every case runs.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from support.reference import (DTYPES, DTYPES_WITH_COMPLEX, FLOAT_DTYPES, LAYOUTS, OPS, all_inputs, compare,
                               layout_shape, make_input, op_allowed, place, reduce_op, reference_reduce, sizes, tname)

WORLD_SIZES = [1, 2, 3, 4]


# ---- rank-side helpers ------------------------------------------------------------------------

class Checker:
    """Collects mismatches of one rank instead of stopping at the first."""

    def __init__(self):
        self.checked = 0
        self.failures: list = []
        self.exact = dist.get_backend() != "gloo"  # gloo's float sums are not in rank order

    def call(self, case: str, fn) -> bool:
        """Run the collective; record an unexpected exception as a failure."""
        try:
            fn()
            return True
        except Exception as exc:  # noqa: BLE001  reported with the case
            self.failures.append(f"{case}: raised {type(exc).__name__}: {exc}")
            return False

    def check(self, case: str, got, expected, op=None, inputs=None) -> None:
        self.checked += 1
        msg = compare(got, expected, op=op, exact=self.exact, inputs=inputs)
        if msg:
            self.failures.append(f"{case}: {msg}")

    def check_true(self, case: str, ok: bool, what: str) -> None:
        self.checked += 1
        if not ok:
            self.failures.append(f"{case}: {what}")

    def expect_error(self, case: str, fn, types=(TypeError,)) -> None:
        self.checked += 1
        try:
            fn()
        except types:
            return
        except Exception as exc:  # noqa: BLE001
            self.failures.append(f"{case}: expected {'/'.join(t.__name__ for t in types)}, "
                                 f"got {type(exc).__name__}: {exc}")
            return
        self.failures.append(f"{case}: expected {'/'.join(t.__name__ for t in types)}, nothing raised")

    def report(self) -> dict:
        return {"checked": self.checked, "failures": self.failures}


def _gloo_lacks(collective: str, dtype=None, op=None) -> bool:
    """Cases skipped when the suite cross-checks its references against gloo
    (``--backend gloo``), because gloo (torch 2.13) lacks them or gets them wrong:
    AVG/PREMUL_SUM, int16, bool/bfloat16 reductions outside all_reduce, complex gather,
    stacked (n, k) in/outputs, strided views (silently wrong data), NaN in MIN/MAX (not
    propagated), and the invalid dtype x op combinations (RuntimeError, not TypeError).
    Never true for flagos_shm."""
    if dist.get_backend() != "gloo":
        return False
    if collective in ("stacked", "strided", "nan"):
        return True
    if dtype == torch.int16 or (dtype == torch.complex64 and collective == "gather"):
        return True
    if op in ("AVG", "PREMUL_SUM") or (dtype is not None and op is not None and not op_allowed(dtype, op)):
        return True
    if dtype == torch.bool and op is not None:
        return True
    if dtype == torch.bfloat16 and op is not None and collective != "all_reduce":
        return True
    return False


def _ctx():
    return dist.get_rank(), dist.get_world_size()


def _invalid_input(dtype):
    return make_input(dtype, 3, "invalid")


def _error_types(dtype):
    # torch itself rejects MIN/MAX/PRODUCT/bitwise on complex tensors with ValueError.
    return (TypeError, ValueError) if dtype.is_complex else (TypeError,)


# ---- reductions -------------------------------------------------------------------------------

def rank_all_reduce(large: bool = True) -> dict:
    rank, n = _ctx()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        for op in OPS:
            if _gloo_lacks("all_reduce", dtype, op):
                continue
            if not op_allowed(dtype, op):
                t = _invalid_input(dtype)
                ck.expect_error(f"all_reduce {tname(dtype)} {op}", lambda: dist.all_reduce(t, op=reduce_op(op)),
                                _error_types(dtype))
                continue
            for numel in sizes(dtype, large):
                case = f"all_reduce {tname(dtype)} {op} numel={numel}"
                inputs = all_inputs(dtype, numel, n, "all_reduce", op=op)
                t = inputs[rank].clone()
                if ck.call(case, lambda: dist.all_reduce(t, op=reduce_op(op))):
                    ck.check(case, t, reference_reduce(inputs, op), op=op, inputs=inputs)
    return ck.report()


def rank_reduce(large: bool = True) -> dict:
    """Every root; the root gets the reduction, the other ranks' buffers stay unchanged."""
    rank, n = _ctx()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        for op in OPS:
            if _gloo_lacks("reduce", dtype, op):
                continue
            if not op_allowed(dtype, op):
                t = _invalid_input(dtype)
                ck.expect_error(f"reduce {tname(dtype)} {op}", lambda: dist.reduce(t, dst=0, op=reduce_op(op)),
                                _error_types(dtype))
                continue
            for numel in sizes(dtype, large):
                inputs = all_inputs(dtype, numel, n, "reduce", op=op)
                expected = reference_reduce(inputs, op)
                for root in range(n):
                    case = f"reduce {tname(dtype)} {op} numel={numel} root={root}"
                    t = inputs[rank].clone()
                    if not ck.call(case, lambda: dist.reduce(t, dst=root, op=reduce_op(op))):
                        continue
                    if rank == root:
                        ck.check(case, t, expected, op=op, inputs=inputs)
                    elif dist.get_backend() != "gloo":  # flagos_shm documents: only the root is written
                        ck.check(case + " (non-root buffer)", t, inputs[rank])
    return ck.report()


def _rs_expected(inputs, op, rank, numel):
    return reference_reduce([x[rank * numel:(rank + 1) * numel] for x in inputs], op)


def rank_reduce_scatter_tensor(large: bool = True) -> dict:
    """``reduce_scatter_tensor`` with a flat (n*k,) and a stacked (n, k) input."""
    rank, n = _ctx()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        for op in OPS:
            if _gloo_lacks("reduce_scatter_tensor", dtype, op):
                continue
            if not op_allowed(dtype, op):
                out, inp = torch.empty(3, dtype=dtype), make_input(dtype, 3 * n, "invalid")
                ck.expect_error(f"reduce_scatter_tensor {tname(dtype)} {op}",
                                lambda: dist.reduce_scatter_tensor(out, inp, op=reduce_op(op)), _error_types(dtype))
                continue
            for numel in sizes(dtype, large):
                inputs = all_inputs(dtype, n * numel, n, "reduce_scatter", op=op)
                expected = _rs_expected(inputs, op, rank, numel)
                for shape in ("flat", "stacked") if numel <= 7 and not _gloo_lacks("stacked") else ("flat",):
                    case = f"reduce_scatter_tensor {tname(dtype)} {op} numel={numel} input={shape}"
                    inp = inputs[rank].clone() if shape == "flat" else inputs[rank].clone().reshape(n, numel)
                    out = torch.full((numel,), 1, dtype=dtype)
                    if ck.call(case, lambda: dist.reduce_scatter_tensor(out, inp, op=reduce_op(op))):
                        ck.check(case, out, expected, op=op, inputs=inputs)
    return ck.report()


def rank_reduce_scatter(large: bool = True) -> dict:
    """``reduce_scatter`` with a list of n input tensors."""
    rank, n = _ctx()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        for op in OPS:
            if _gloo_lacks("reduce_scatter", dtype, op):
                continue
            if not op_allowed(dtype, op):
                out = torch.empty(3, dtype=dtype)
                ins = [make_input(dtype, 3, "invalid", j) for j in range(n)]
                ck.expect_error(f"reduce_scatter {tname(dtype)} {op}",
                                lambda: dist.reduce_scatter(out, ins, op=reduce_op(op)), _error_types(dtype))
                continue
            for numel in sizes(dtype, large):
                case = f"reduce_scatter {tname(dtype)} {op} numel={numel}"
                inputs = all_inputs(dtype, n * numel, n, "reduce_scatter_list", op=op)
                ins = [c.clone() for c in inputs[rank].split(numel)] if numel else \
                    [torch.empty(0, dtype=dtype) for _ in range(n)]
                out = torch.full((numel,), 1, dtype=dtype)
                if ck.call(case, lambda: dist.reduce_scatter(out, ins, op=reduce_op(op))):
                    ck.check(case, out, _rs_expected(inputs, op, rank, numel), op=op, inputs=inputs)
    return ck.report()


def rank_all_reduce_coalesced(large: bool = True) -> dict:
    """``dist.all_reduce_coalesced`` and ``all_reduce`` inside ``_coalescing_manager``
    (both reach the backend's ``allreduce_coalesced``) on tensors of every size at once."""
    import warnings

    rank, n = _ctx()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        for op in OPS:
            if _gloo_lacks("all_reduce", dtype, op) or not op_allowed(dtype, op):
                continue
            numels = sizes(dtype, large)
            inputs = [all_inputs(dtype, k, n, "all_reduce_coalesced", op=op) for k in numels]
            expected = [reference_reduce(x, op) for x in inputs]
            for how in ("all_reduce_coalesced", "_coalescing_manager"):
                case = f"{how} {tname(dtype)} {op} numels={numels}"
                ts = [x[rank].clone() for x in inputs]

                def go():
                    if how == "all_reduce_coalesced":
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore", FutureWarning)
                            dist.all_reduce_coalesced(ts, op=reduce_op(op))
                    else:
                        with dist._coalescing_manager(group=dist.group.WORLD):
                            for t in ts:
                                dist.all_reduce(t, op=reduce_op(op))
                if ck.call(case, go):
                    for k, t, e, x in zip(numels, ts, expected, inputs):
                        ck.check(f"{case} [numel={k}]", t, e, op=op, inputs=x)
    return ck.report()


def rank_reduce_scatter_coalesced(large: bool = True) -> dict:
    """``reduce_scatter_tensor`` inside ``_coalescing_manager`` (the backend's
    ``reduce_scatter_single_coalesced``, used by DTensor)."""
    rank, n = _ctx()
    ck = Checker()
    for dtype in DTYPES:
        for op in ("SUM", "AVG", "MAX", "PREMUL_SUM"):
            if _gloo_lacks("reduce_scatter_tensor", dtype, op) or not op_allowed(dtype, op):
                continue
            numels = sizes(dtype, large)
            inputs = [all_inputs(dtype, n * k, n, "rs_coalesced", op=op) for k in numels]
            case = f"_coalescing_manager(reduce_scatter_tensor) {tname(dtype)} {op} numels={numels}"
            outs = [torch.full((k,), 1, dtype=dtype) for k in numels]

            def go():
                with dist._coalescing_manager(group=dist.group.WORLD):
                    for out, x in zip(outs, inputs):
                        dist.reduce_scatter_tensor(out, x[rank].clone(), op=reduce_op(op))
            if ck.call(case, go):
                for k, out, x in zip(numels, outs, inputs):
                    ck.check(f"{case} [numel={k}]", out, _rs_expected(x, op, rank, k), op=op, inputs=x)
    return ck.report()


# ---- data movement ----------------------------------------------------------------------------

def rank_broadcast(large: bool = True) -> dict:
    rank, n = _ctx()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        if _gloo_lacks("broadcast", dtype):
            continue
        for numel in sizes(dtype, large):
            inputs = all_inputs(dtype, numel, n, "broadcast")
            for root in range(n):
                case = f"broadcast {tname(dtype)} numel={numel} root={root}"
                t = inputs[rank].clone()
                if ck.call(case, lambda: dist.broadcast(t, src=root)):
                    ck.check(case, t, inputs[root])
    return ck.report()


def rank_all_gather(large: bool = True) -> dict:
    """``all_gather`` into a list; also ranks contributing different element counts."""
    rank, n = _ctx()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        if _gloo_lacks("all_gather", dtype):
            continue
        for numel in sizes(dtype, large):
            case = f"all_gather {tname(dtype)} numel={numel}"
            inputs = all_inputs(dtype, numel, n, "all_gather")
            outs = [torch.full((numel,), 1, dtype=dtype) for _ in range(n)]
            if ck.call(case, lambda: dist.all_gather(outs, inputs[rank].clone())):
                for r in range(n):
                    ck.check(f"{case} [from rank {r}]", outs[r], inputs[r])
        if dist.get_backend() == "gloo":
            continue
        counts = [2 * r + 1 for r in range(n)]  # uneven: rank r contributes 2r+1 elements
        case = f"all_gather {tname(dtype)} uneven counts={counts}"
        inputs = [make_input(dtype, counts[r], "all_gather_uneven", r) for r in range(n)]
        outs = [torch.full((counts[r],), 1, dtype=dtype) for r in range(n)]
        if ck.call(case, lambda: dist.all_gather(outs, inputs[rank].clone())):
            for r in range(n):
                ck.check(f"{case} [from rank {r}]", outs[r], inputs[r])
    return ck.report()


def rank_all_gather_into_tensor(large: bool = True) -> dict:
    """Flat (n*k,) and stacked (n, k) outputs, and the in-place form whose input is this
    rank's slice of the output (as FSDP calls it)."""
    rank, n = _ctx()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        if _gloo_lacks("all_gather_into_tensor", dtype):
            continue
        for numel in sizes(dtype, large):
            inputs = all_inputs(dtype, numel, n, "all_gather_into_tensor")
            expected = torch.cat(inputs)
            for shape in ("flat", "stacked", "in-place") if numel <= 7 and not _gloo_lacks("stacked") \
                    else ("flat", "in-place"):
                case = f"all_gather_into_tensor {tname(dtype)} numel={numel} output={shape}"
                out = torch.full((n * numel,), 1, dtype=dtype)
                if shape == "stacked":
                    out = out.reshape(n, numel)
                if shape == "in-place":
                    inp = out[rank * numel:(rank + 1) * numel]
                    inp.copy_(inputs[rank])
                else:
                    inp = inputs[rank].clone()
                if ck.call(case, lambda: dist.all_gather_into_tensor(out, inp)):
                    ck.check(case, out, expected)
    return ck.report()


def rank_all_gather_coalesced(large: bool = True) -> dict:
    """``all_gather_into_tensor`` inside ``_coalescing_manager`` (the backend's
    ``all_gather_single_coalesced``, used by FSDP2/DTensor) and ``dist.all_gather_coalesced``."""
    import warnings

    rank, n = _ctx()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        if _gloo_lacks("all_gather_coalesced", dtype):
            continue
        numels = sizes(dtype, large)
        inputs = [all_inputs(dtype, k, n, "ag_coalesced") for k in numels]
        case = f"_coalescing_manager(all_gather_into_tensor) {tname(dtype)} numels={numels}"
        outs = [torch.full((n * k,), 1, dtype=dtype) for k in numels]

        def go():
            with dist._coalescing_manager(group=dist.group.WORLD):
                for out, x in zip(outs, inputs):
                    dist.all_gather_into_tensor(out, x[rank].clone())
        if ck.call(case, go):
            for k, out, x in zip(numels, outs, inputs):
                ck.check(f"{case} [numel={k}]", out, torch.cat(x))
        # Documented layout: output_tensor_lists[r][i] receives rank r's input_tensor_list[i].
        # Also with as many inputs as ranks (of one size), where a transposed layout would
        # not be rejected by a length check.
        for numels_i in (numels, [5] * n):
            inputs_i = [all_inputs(dtype, k, n, "ag_coalesced_old", i) for i, k in enumerate(numels_i)]
            case = f"all_gather_coalesced {tname(dtype)} numels={numels_i}"
            lists = [[torch.full((k,), 1, dtype=dtype) for k in numels_i] for _ in range(n)]

            def go_old():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    dist.all_gather_coalesced(lists, [x[rank].clone() for x in inputs_i])
            if ck.call(case, go_old):
                for r in range(n):
                    for i, (k, x) in enumerate(zip(numels_i, inputs_i)):
                        ck.check(f"{case} [output_tensor_lists[{r}][{i}] (numel={k}) from rank {r}]",
                                 lists[r][i], x[r])
    return ck.report()


def rank_gather(large: bool = True) -> dict:
    rank, n = _ctx()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        if _gloo_lacks("gather", dtype):
            continue
        for numel in sizes(dtype, large):
            inputs = all_inputs(dtype, numel, n, "gather")
            for root in range(n):
                case = f"gather {tname(dtype)} numel={numel} root={root}"
                inp = inputs[rank].clone()
                outs = [torch.full((numel,), 1, dtype=dtype) for _ in range(n)] if rank == root else None
                if not ck.call(case, lambda: dist.gather(inp, gather_list=outs, dst=root)):
                    continue
                ck.check(case + " (input unchanged)", inp, inputs[rank])
                if rank == root:
                    for r in range(n):
                        ck.check(f"{case} [from rank {r}]", outs[r], inputs[r])
    return ck.report()


def rank_scatter(large: bool = True) -> dict:
    rank, n = _ctx()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        if _gloo_lacks("scatter", dtype):
            continue
        for numel in sizes(dtype, large):
            for root in range(n):
                pieces = all_inputs(dtype, numel, n, "scatter", f"root{root}")
                case = f"scatter {tname(dtype)} numel={numel} root={root}"
                out = torch.full((numel,), 1, dtype=dtype)
                ins = [p.clone() for p in pieces] if rank == root else None
                if ck.call(case, lambda: dist.scatter(out, scatter_list=ins, src=root)):
                    ck.check(case, out, pieces[rank])
    return ck.report()


def _a2a_rows(src: int, dst: int) -> int:
    """Rows rank ``src`` sends to rank ``dst`` in the uneven all-to-all (0 included)."""
    return (src + 2 * dst) % 3


def rank_all_to_all(large: bool = True) -> dict:
    """``all_to_all_single`` with equal splits and with split sizes, and ``all_to_all``."""
    rank, n = _ctx()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        if _gloo_lacks("all_to_all", dtype):
            continue
        for per_peer in sizes(dtype, large):
            case = f"all_to_all_single {tname(dtype)} per_peer={per_peer}"
            inputs = all_inputs(dtype, n * per_peer, n, "a2a")
            out = torch.full((n * per_peer,), 1, dtype=dtype)
            expected = torch.cat([x[rank * per_peer:(rank + 1) * per_peer] for x in inputs])
            if ck.call(case, lambda: dist.all_to_all_single(out, inputs[rank].clone())):
                ck.check(case, out, expected)
        # Uneven splits of (rows, 2) tensors: rank s sends _a2a_rows(s, d) rows to rank d.
        width = 2
        sent = {s: [_a2a_rows(s, d) for d in range(n)] for s in range(n)}
        inputs = {s: make_input(dtype, sum(sent[s]) * width, "a2a_uneven", s).reshape(-1, width) for s in range(n)}
        pieces = {s: list(inputs[s].split(sent[s])) for s in range(n)}
        expected = torch.cat([pieces[s][rank] for s in range(n)])
        in_splits, out_splits = sent[rank], [sent[s][rank] for s in range(n)]
        case = f"all_to_all_single {tname(dtype)} splits in={in_splits} out={out_splits}"
        out = torch.full((sum(out_splits), width), 1, dtype=dtype)
        if ck.call(case, lambda: dist.all_to_all_single(out, inputs[rank].clone(), out_splits, in_splits)):
            ck.check(case, out, expected)
        case = f"all_to_all (lists) {tname(dtype)} rows in={in_splits} out={out_splits}"
        outs = [torch.full((k, width), 1, dtype=dtype) for k in out_splits]
        if dist.get_backend() == "gloo":
            continue  # gloo has no all_to_all with lists
        if ck.call(case, lambda: dist.all_to_all(outs, [p.clone() for p in pieces[rank]])):
            for s in range(n):
                ck.check(f"{case} [from rank {s}]", outs[s], pieces[s][rank])
    return ck.report()


def rank_barrier(marker_dir: str) -> dict:
    """After ``barrier`` every rank's marker file exists, although one rank (a different
    one each round) writes its marker only after a pause."""
    rank, n = _ctx()
    ck = Checker()
    for rnd in range(3):
        late = rnd % n
        if rank == late:
            time.sleep(0.3)
        with open(os.path.join(marker_dir, f"round{rnd}-rank{rank}"), "w"):
            pass
        if ck.call(f"barrier round {rnd}", dist.barrier):
            present = [os.path.exists(os.path.join(marker_dir, f"round{rnd}-rank{r}")) for r in range(n)]
            ck.check_true(f"barrier round {rnd} (rank {late} late)", all(present),
                          f"returned before every rank arrived: markers {present}")
    return ck.report()


# ---- layouts: non-contiguous tensors and storage offsets ---------------------------------------

LAYOUT_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool, torch.complex64]


def _layout_numels(dtype):
    """7 elements; plus the 2.5-slot size (chunked, misaligned by the offset) for 3 dtypes."""
    return [7, sizes(dtype)[-1]] if dtype in (torch.float32, torch.bfloat16, torch.uint8) else [7]


def rank_layouts() -> dict:
    """Inputs and outputs as an offset slice, a strided column, a transposed 2-D view: the
    result lands in the caller's view, and the buffer around it stays untouched."""
    rank, n = _ctx()
    ck = Checker()
    for layout in LAYOUTS[1:]:
        if _gloo_lacks(layout):
            continue
        for dtype in LAYOUT_DTYPES:
            if _gloo_lacks("layouts", dtype):
                continue
            for numel in _layout_numels(dtype):
                shape = layout_shape(layout, numel)
                k = torch.Size(shape).numel()
                if layout == "transposed" and numel != 7:
                    continue
                tag = f"{layout} {tname(dtype)} shape={shape}"
                # all_reduce (in place)
                for op in ("SUM", "MAX"):
                    if dtype.is_complex and op == "MAX" or _gloo_lacks("all_reduce", dtype, op):
                        continue
                    inputs = [x.reshape(shape) for x in all_inputs(dtype, k, n, "layout_ar", op=op)]
                    t, guard = place(inputs[rank], layout)
                    case = f"all_reduce {op} {tag}"
                    if ck.call(case, lambda: dist.all_reduce(t, op=reduce_op(op))):
                        ck.check(case, t, reference_reduce(inputs, op), op=op, inputs=inputs)
                        ck.check_true(case, guard() is None, str(guard()))
                # broadcast from the last rank (in place)
                inputs = [x.reshape(shape) for x in all_inputs(dtype, k, n, "layout_bc")]
                t, guard = place(inputs[rank], layout)
                case = f"broadcast {tag}"
                if ck.call(case, lambda: dist.broadcast(t, src=n - 1)):
                    ck.check(case, t, inputs[n - 1])
                    ck.check_true(case, guard() is None, str(guard()))
                # reduce to rank 0
                if not _gloo_lacks("reduce", dtype, "SUM"):
                    inputs = [x.reshape(shape) for x in all_inputs(dtype, k, n, "layout_rd", op="SUM")]
                    t, guard = place(inputs[rank], layout)
                    case = f"reduce SUM {tag}"
                    if ck.call(case, lambda: dist.reduce(t, dst=0)):
                        if rank == 0:
                            ck.check(case, t, reference_reduce(inputs, "SUM"), op="SUM", inputs=inputs)
                        elif dist.get_backend() != "gloo":  # flagos_shm: non-root buffers unchanged
                            ck.check(case + " (non-root buffer)", t, inputs[rank])
                        ck.check_true(case, guard() is None, str(guard()))
                # all_gather_into_tensor: non-contiguous input and output
                inputs = [x.reshape(shape) for x in all_inputs(dtype, k, n, "layout_ag")]
                inp, in_guard = place(inputs[rank], layout)
                out_shape = (n * shape[0],) + tuple(shape[1:])
                out, out_guard = place(torch.ones(out_shape, dtype=dtype), layout)
                case = f"all_gather_into_tensor {tag}"
                if ck.call(case, lambda: dist.all_gather_into_tensor(out, inp)):
                    ck.check(case, out, torch.cat(inputs))
                    ck.check_true(case, in_guard() is None and out_guard() is None, f"{in_guard()} {out_guard()}")
                # all_gather (list of non-contiguous outputs)
                outs = [place(torch.ones(shape, dtype=dtype), layout) for _ in range(n)]
                case = f"all_gather {tag}"
                if ck.call(case, lambda: dist.all_gather([o for o, _ in outs], inp)):
                    for r, (o, g) in enumerate(outs):
                        ck.check(f"{case} [from rank {r}]", o, inputs[r])
                        ck.check_true(case, g() is None, str(g()))
                # reduce_scatter_tensor: non-contiguous input and output
                if not _gloo_lacks("reduce_scatter_tensor", dtype, "SUM"):
                    inputs = [x.reshape(out_shape) for x in all_inputs(dtype, n * k, n, "layout_rs", op="SUM")]
                    inp, in_guard = place(inputs[rank], layout)
                    out, out_guard = place(torch.ones(shape, dtype=dtype), layout)
                    case = f"reduce_scatter_tensor SUM {tag}"
                    if ck.call(case, lambda: dist.reduce_scatter_tensor(out, inp)):
                        flat = [x.reshape(-1) for x in inputs]
                        ck.check(case, out, _rs_expected(flat, "SUM", rank, k).reshape(shape), op="SUM", inputs=flat)
                        ck.check_true(case, in_guard() is None and out_guard() is None,
                                      f"{in_guard()} {out_guard()}")
                # all_to_all_single: non-contiguous input and output
                if layout != "transposed":
                    inputs = all_inputs(dtype, n * k, n, "layout_a2a")
                    inp, in_guard = place(inputs[rank], layout)
                    out, out_guard = place(torch.ones(n * k, dtype=dtype), layout)
                    case = f"all_to_all_single {tag}"
                    if ck.call(case, lambda: dist.all_to_all_single(out, inp)):
                        ck.check(case, out, torch.cat([x[rank * k:(rank + 1) * k] for x in inputs]))
                        ck.check_true(case, in_guard() is None and out_guard() is None,
                                      f"{in_guard()} {out_guard()}")
                # scatter / gather from rank 0 with non-contiguous tensors
                inputs = [x.reshape(shape) for x in all_inputs(dtype, k, n, "layout_sg")]
                out, out_guard = place(torch.ones(shape, dtype=dtype), layout)
                ins = [place(x, layout)[0] for x in inputs] if rank == 0 else None
                case = f"scatter {tag}"
                if ck.call(case, lambda: dist.scatter(out, ins, src=0)):
                    ck.check(case, out, inputs[rank])
                    ck.check_true(case, out_guard() is None, str(out_guard()))
                inp, _ = place(inputs[rank], layout)
                outs = [place(torch.ones(shape, dtype=dtype), layout)[0] for _ in range(n)] if rank == 0 else None
                case = f"gather {tag}"
                if _gloo_lacks("gather", dtype):
                    continue
                if ck.call(case, lambda: dist.gather(inp, outs, dst=0)) and rank == 0:
                    for r in range(n):
                        ck.check(f"{case} [from rank {r}]", outs[r], inputs[r])
    return ck.report()


# ---- special values, determinism ---------------------------------------------------------------

def rank_special_values() -> dict:
    """inf/NaN: float16 overflow gives inf on every rank, MIN/MAX and SUM propagate NaN."""
    rank, n = _ctx()
    ck = Checker()
    for dtype in FLOAT_DTYPES:
        big = torch.finfo(dtype).max
        rows = {
            "overflow": [big, -big, 1.0],
            "nan": [float("nan"), 1.0, -2.0],
            "inf": [float("inf"), -float("inf"), 0.0],
        }
        for name, row in rows.items():
            # rank r contributes row rotated by r, so each position sees different mixes
            inputs = [torch.tensor(row[r % 3:] + row[:r % 3], dtype=dtype) for r in range(n)]
            for op in ("SUM", "MIN", "MAX", "PRODUCT"):
                if _gloo_lacks("all_reduce", dtype, op) or _gloo_lacks("nan") and name == "nan":
                    continue
                case = f"all_reduce {tname(dtype)} {op} special={name} inputs={[x.tolist() for x in inputs]}"
                t = inputs[rank].clone()
                if ck.call(case, lambda: dist.all_reduce(t, op=reduce_op(op))):
                    ck.check(case, t, reference_reduce(inputs, op), op=op, inputs=inputs)
    return ck.report()


def rank_result_bytes(dtype_name: str, op: str, numel: int) -> bytes:
    """The bytes of this rank's all_reduce result (random inputs)."""
    rank, n = _ctx()
    dtype = getattr(torch, dtype_name)
    t = make_input(dtype, numel, "bitwise", f"rank{rank}", op=op)
    dist.all_reduce(t, op=reduce_op(op))
    return t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes()


# ---- subgroups ----------------------------------------------------------------------------------

def rank_subgroups() -> dict:
    """Two subgroups (even and odd ranks, ``new_group(backend=<the world's backend>)``) used
    interleaved with the world group, then destroyed; each group gets its own segment and
    none is left in ``FLAGOS_SHM_DIR``."""
    rank, n = _ctx()
    ck = Checker()
    backend = dist.get_backend()
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    g_even = dist.new_group(evens, backend=backend)
    g_odd = dist.new_group(odds, backend=backend) if odds else None
    mine, members = (g_even, evens) if rank in evens else (g_odd, odds)
    try:
        dist.barrier()  # every rank has attached to both subgroups' segments
        if backend != "gloo":
            left = sorted(f for f in os.listdir(os.environ["FLAGOS_SHM_DIR"]) if f.startswith("flagos_shm-"))
            ck.check_true("segments after new_group", not left, f"segment files not unlinked: {left}")
        for step in range(3):
            for dtype in (torch.float32, torch.int64, torch.bfloat16):
                for numel in (5, sizes(dtype)[-1]) if step == 0 else (5,):
                    tag = f"step {step} {tname(dtype)} numel={numel}"
                    # world all_reduce
                    inputs = all_inputs(dtype, numel, n, "sub_world", step)
                    t = inputs[rank].clone()
                    if ck.call(f"world all_reduce {tag}", lambda: dist.all_reduce(t)):
                        ck.check(f"world all_reduce {tag}", t, reference_reduce(inputs, "SUM"), op="SUM",
                                 inputs=inputs)
                    # subgroup all_reduce
                    sub_inputs = all_inputs(dtype, numel, n, "sub_group", step)
                    t = sub_inputs[rank].clone()
                    mine_inputs = [sub_inputs[r] for r in members]
                    case = f"subgroup {members} all_reduce {tag}"
                    if ck.call(case, lambda: dist.all_reduce(t, group=mine)):
                        ck.check(case, t, reference_reduce(mine_inputs, "SUM"), op="SUM", inputs=mine_inputs)
                    # world all_gather_into_tensor
                    out = torch.ones(n * numel, dtype=dtype)
                    case = f"world all_gather_into_tensor {tag}"
                    if ck.call(case, lambda: dist.all_gather_into_tensor(out, inputs[rank].clone())):
                        ck.check(case, out, torch.cat(inputs))
                    # subgroup broadcast from its last member (group-local rank len-1)
                    t = sub_inputs[rank].clone()
                    src = members[-1]
                    case = f"subgroup {members} broadcast from {src} {tag}"
                    if ck.call(case, lambda: dist.broadcast(t, src=src, group=mine)):
                        ck.check(case, t, sub_inputs[src])
                    # subgroup all_gather
                    out = torch.ones(len(members) * numel, dtype=dtype)
                    case = f"subgroup {members} all_gather_into_tensor {tag}"
                    if ck.call(case, lambda: dist.all_gather_into_tensor(out, sub_inputs[rank].clone(), group=mine)):
                        ck.check(case, out, torch.cat(mine_inputs))
            if ck.call(f"world barrier step {step}", dist.barrier):
                ck.checked += 1
    finally:
        dist.barrier()
        for g in (g_even, g_odd):
            if g is not None:
                dist.destroy_process_group(g)
    if backend != "gloo":
        left = sorted(f for f in os.listdir(os.environ["FLAGOS_SHM_DIR"]) if f.startswith("flagos_shm-"))
        ck.check_true("segments after destroying the subgroups", not left, f"segment files left: {left}")
    # the world group still works
    t = torch.ones(4)
    if ck.call("world all_reduce after destroying subgroups", lambda: dist.all_reduce(t)):
        ck.check("world all_reduce after destroying subgroups", t, torch.full((4,), float(n)))
    return ck.report()


def rank_threads(iterations: int) -> dict:
    """Two threads per rank, each issuing collectives (sync and ``async_op=True``) on its
    own process group over the same ranks, at the same time: groups must not share state."""
    import threading

    rank, n = _ctx()
    backend = dist.get_backend()
    groups = [dist.new_group(list(range(n)), backend=backend) for _ in range(2)]
    ck = Checker()
    failures: list = [[], []]
    counts = [0, 0]

    def worker(idx: int) -> None:
        group = groups[idx]
        for it in range(iterations):
            numel = (3, 1000, 70_001)[it % 3]
            inputs = all_inputs(torch.float32, numel, n, "threads", idx, it)
            t = inputs[rank].clone()
            out = torch.ones(n * numel)
            try:
                work = dist.all_reduce(t, group=group, async_op=(it % 2 == 1))
                if work is not None:
                    work.wait()
                dist.all_gather_into_tensor(out, inputs[rank].clone(), group=group)
            except Exception as exc:  # noqa: BLE001
                failures[idx].append(f"thread {idx} iteration {it}: raised {type(exc).__name__}: {exc}")
                return
            for what, got, exp in (("all_reduce", t, reference_reduce(inputs, "SUM")),
                                   ("all_gather_into_tensor", out, torch.cat(inputs))):
                msg = compare(got, exp, op="SUM" if what == "all_reduce" else None, exact=ck.exact, inputs=inputs)
                counts[idx] += 1
                if msg:
                    failures[idx].append(f"thread {idx} iteration {it} {what} numel={numel}: {msg}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dist.barrier()
    for g in groups:
        dist.destroy_process_group(g)
    ck.checked += sum(counts)
    ck.failures += failures[0] + failures[1]
    return ck.report()


# ---- bad input ------------------------------------------------------------------------------------

def _try(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None


def rank_bad_input(case: str, bad_rank: int) -> dict:
    """One rank (``bad_rank``; -1 for all) passes invalid arguments; report what each rank
    raised, and whether the group still computes a correct all_reduce afterwards."""
    rank, n = _ctx()
    bad = rank == bad_rank or bad_rank == -1
    f32 = torch.float32
    if case == "all_gather_into_tensor output size":
        out = torch.zeros(n * 4 + (1 if bad else 0))
        err = _try(lambda: dist.all_gather_into_tensor(out, torch.ones(4)))
    elif case == "reduce_scatter_tensor input size":
        err = _try(lambda: dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(n * 4 - (1 if bad else 0))))
    elif case == "all_gather list length":
        outs = [torch.zeros(4) for _ in range(n + (1 if bad else 0))]
        err = _try(lambda: dist.all_gather(outs, torch.ones(4)))
    elif case == "reduce_scatter list length":
        ins = [torch.ones(4) for _ in range(n + (1 if bad else 0))]
        err = _try(lambda: dist.reduce_scatter(torch.zeros(4), ins))
    elif case == "all_gather_into_tensor mixed dtypes":
        out = torch.zeros(n * 4, dtype=torch.float64 if bad else f32)
        err = _try(lambda: dist.all_gather_into_tensor(out, torch.ones(4)))
    elif case == "all_to_all_single output size":
        out = torch.zeros(n * 2 + (n if bad else 0), dtype=torch.int64)
        err = _try(lambda: dist.all_to_all_single(out, torch.ones(n * 2, dtype=torch.int64)))
    elif case == "reduce_scatter_tensor mixed dtypes":
        out = torch.zeros(4, dtype=torch.float64 if bad else f32)
        err = _try(lambda: dist.reduce_scatter_tensor(out, torch.ones(n * 4)))
    elif case == "all_gather_into_tensor count differs between ranks":
        k = 5 if bad else 4
        err = _try(lambda: dist.all_gather_into_tensor(torch.zeros(n * k), torch.ones(k)))
    elif case == "all_reduce_coalesced mixed dtypes":
        # torch checks dtypes of all_reduce_coalesced itself, so use the coalescing manager
        def go():
            with dist._coalescing_manager(group=dist.group.WORLD):
                dist.all_reduce(torch.ones(3))
                dist.all_reduce(torch.ones(3, dtype=torch.float64 if bad else f32))
        err = _try(go)
    elif case == "all_reduce count differs between ranks":
        err = _try(lambda: dist.all_reduce(torch.ones(5 + (1 if bad else 0))))
    elif case == "all_reduce dtype differs between ranks":
        err = _try(lambda: dist.all_reduce(torch.ones(5, dtype=torch.float64 if bad else f32)))
    elif case == "all_reduce op differs between ranks":
        err = _try(lambda: dist.all_reduce(torch.ones(5), op=dist.ReduceOp.MAX if bad else dist.ReduceOp.SUM))
    elif case == "broadcast root differs between ranks":
        err = _try(lambda: dist.broadcast(torch.ones(5), src=(rank + 1) % n if bad else 0))
    elif case == "all_to_all_single split sizes differ between ranks":
        rows = [1, 2, 3] if bad else [2] * n
        err = _try(lambda: dist.all_to_all_single(torch.zeros(2 * n), torch.ones(2 * n), rows[::-1], rows))
    elif case == "all_reduce premul_sum factor differs between ranks":
        err = _try(lambda: dist.all_reduce(torch.ones(5), op=dist._make_nccl_premul_sum(3.0 if bad else 2.0)))
    elif case == "bitwise op on float, all ranks":
        err = _try(lambda: dist.all_reduce(torch.ones(5), op=dist.ReduceOp.BAND))
    elif case == "avg on bool, all ranks":
        err = _try(lambda: dist.all_reduce(torch.ones(5, dtype=torch.bool), op=dist.ReduceOp.AVG))
    else:
        raise ValueError(f"unknown case {case!r}")
    t = torch.arange(6, dtype=f32) + rank
    after = _try(lambda: dist.all_reduce(t))
    expected = torch.arange(6, dtype=f32) * n + n * (n - 1) / 2
    return {"error": err, "after": after or (None if torch.equal(t, expected) else f"wrong result {t.tolist()}")}


BAD_INPUT_CASES = {
    # case: (bad rank (-1: all ranks), the argument the bad rank's error message must name,
    #        accepted error types). Only cases that torch.distributed passes on to the backend:
    # torch validates some arguments itself before (e.g. mixed dtypes of all_to_all_single)
    # and then only that rank raises, whatever the backend.
    "all_gather_into_tensor output size": (1, "output", ("ValueError",)),
    "reduce_scatter_tensor input size": (0, "input", ("ValueError",)),
    "all_gather list length": (1, "output_tensors", ("ValueError",)),
    "reduce_scatter list length": (0, "input_tensors", ("ValueError",)),
    "all_gather_into_tensor mixed dtypes": (1, "dtype", ("TypeError", "ValueError")),
    "all_to_all_single output size": (0, "output", ("ValueError",)),
    "reduce_scatter_tensor mixed dtypes": (2, "dtype", ("TypeError", "ValueError")),
    "all_gather_into_tensor count differs between ranks": (1, "", ("ValueError",)),
    "all_reduce_coalesced mixed dtypes": (1, "dtype", ("TypeError", "ValueError")),
    "all_reduce count differs between ranks": (1, "", ("ValueError",)),
    "all_reduce dtype differs between ranks": (1, "", ("ValueError",)),
    "all_reduce op differs between ranks": (0, "", ("ValueError",)),
    "broadcast root differs between ranks": (1, "", ("ValueError",)),
    "all_to_all_single split sizes differ between ranks": (1, "split sizes", ("ValueError",)),
    "all_reduce premul_sum factor differs between ranks": (0, "factor", ("ValueError",)),
    "bitwise op on float, all ranks": (-1, "BAND", ("TypeError",)),
    "avg on bool, all ranks": (-1, "AVG", ("TypeError",)),
}


# ---- the pytest side ---------------------------------------------------------------------------

def assert_clean(results: list, what: str) -> None:
    """Fail listing every failing case (with the ranks it failed on); also fail if a rank
    checked nothing (a test that cannot fail)."""
    merged: dict = {}
    for rank, rep in enumerate(results):
        for failure in rep["failures"]:
            merged.setdefault(failure, []).append(rank)
    lines = [f"ranks {ranks}: {failure}" for failure, ranks in merged.items()]
    checked = [rep["checked"] for rep in results]
    assert lines == [], f"{what}: {len(lines)} failing case(s) of {max(checked)}:\n" + "\n".join(lines[:200])
    assert min(checked) > 0, f"{what}: a rank checked nothing ({checked})"


COLLECTIVES = {
    "all_reduce": rank_all_reduce,
    "reduce": rank_reduce,
    "reduce_scatter_tensor": rank_reduce_scatter_tensor,
    "reduce_scatter": rank_reduce_scatter,
    "all_reduce_coalesced": rank_all_reduce_coalesced,
    "reduce_scatter_coalesced": rank_reduce_scatter_coalesced,
    "broadcast": rank_broadcast,
    "all_gather": rank_all_gather,
    "all_gather_into_tensor": rank_all_gather_into_tensor,
    "all_gather_coalesced": rank_all_gather_coalesced,
    "gather": rank_gather,
    "scatter": rank_scatter,
    "all_to_all": rank_all_to_all,
}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("collective", list(COLLECTIVES))
def test_collective(worlds, collective, world_size):
    """Every dtype x op x size of one collective, at the default slot size."""
    assert_clean(worlds(world_size).run(COLLECTIVES[collective]), f"{collective} at world size {world_size}")


SMALL_SLOT_COLLECTIVES = ["all_reduce", "reduce", "reduce_scatter_tensor", "all_gather_into_tensor",
                          "broadcast", "all_to_all"]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("collective", SMALL_SLOT_COLLECTIVES)
def test_collective_small_slots(worlds, backend, collective, world_size):
    """The same checks with 4 KiB chunk slots (FLAGOS_SHM_SLOT_BYTES=4096) and single-copy
    transfers off (FLAGOS_SHM_CMA=0): the large size is then 320 KiB, i.e. 80 chunks
    through the slots (two-step allreduce). The default pools take the
    single-copy path for the large size (above ``_core.CMA_MIN_BYTES``)."""
    if backend == "gloo":
        pytest.skip("slot size is a flagos_shm setting")
    assert_clean(worlds(world_size, FLAGOS_SHM_SLOT_BYTES=4096, FLAGOS_SHM_CMA="0").run(COLLECTIVES[collective]),
                 f"{collective} at world size {world_size} with 4 KiB slots")


DEFAULT_SLOT_COLLECTIVES = ["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast"]


def _slot_bytes():
    import flagos_shm
    from flagos_shm import _core

    comm = flagos_shm.backend.shm_part(dist.distributed_c10d._get_default_group())._comm
    return comm.slot_bytes, int(_core.default_slot_bytes(os.environ.get("FLAGOS_SHM_DIR") or "/dev/shm",
                                                         dist.get_world_size()))


@pytest.mark.parametrize("collective", DEFAULT_SLOT_COLLECTIVES)
def test_collective_default_slots(worlds, backend, collective):
    """The same checks with ``FLAGOS_SHM_SLOT_BYTES`` unset (the rest of the suite pins
    256 KiB slots, see conftest.py): the group gets the slot size the core picks for its
    directory (``_core.default_slot_bytes``: 1 MiB in a large /dev/shm), and the large size,
    2.5 of those slots, streams through them in 3 chunks."""
    if backend == "gloo":
        pytest.skip("slot size is a flagos_shm setting")
    world = worlds(2, FLAGOS_SHM_SLOT_BYTES="")
    for got, want in world.run(_slot_bytes):
        assert got == want, f"the group's slot is {got} bytes, the core's default for its directory {want}"
    assert_clean(world.run(COLLECTIVES[collective]), f"{collective} at world size 2 with the default slots")


SINGLE_COPY_COLLECTIVES = ["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast", "all_to_all"]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("collective", SINGLE_COPY_COLLECTIVES)
def test_collective_single_copy(worlds, backend, collective, world_size):
    """The same checks with the single-copy threshold lowered to 1 KiB
    (``FLAGOS_SHM_CMA_MIN_BYTES=1024``; allreduce from 8 KiB): the large size of every dtype
    takes the ``process_vm_readv`` path (broadcast: the non-roots read the root's buffer;
    all-to-all with equal splits: each rank reads its piece of every peer's input),
    including allreduce, which by default switches only at 2 MiB. Skipped where the kernel
    forbids cross-process reads."""
    if backend == "gloo":
        pytest.skip("single-copy is a flagos_shm path")
    world = worlds(world_size, FLAGOS_SHM_CMA_MIN_BYTES="1024")
    if world.run(_single_copy_min_bytes)[0] is None:
        pytest.skip("process_vm_readv between the ranks is not allowed here (ptrace scope / seccomp)")
    assert_clean(world.run(COLLECTIVES[collective]), f"{collective} at world size {world_size}, single-copy")


def _single_copy_min_bytes():
    import flagos_shm

    return flagos_shm.backend.shm_part(dist.distributed_c10d._get_default_group())._comm.single_copy_min_bytes


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_barrier(worlds, world_size, tmp_path):
    assert_clean(worlds(world_size).run(rank_barrier, str(tmp_path)), f"barrier at world size {world_size}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_layouts(worlds, world_size):
    assert_clean(worlds(world_size).run(rank_layouts), f"layouts at world size {world_size}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_special_values(worlds, world_size):
    assert_clean(worlds(world_size).run(rank_special_values), f"special values at world size {world_size}")


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("dtype_name,op", [("float16", "SUM"), ("bfloat16", "SUM"), ("float32", "SUM"),
                                            ("float16", "AVG"), ("bfloat16", "PREMUL_SUM")])
def test_results_bitwise_identical_across_ranks(worlds, backend, world_size, dtype_name, op):
    """Every rank reduces in rank order, so all ranks hold the same bytes (small and
    two-step sizes)."""
    if backend == "gloo" and op != "SUM":
        pytest.skip("gloo lacks AVG/PREMUL_SUM")
    world = worlds(world_size)
    for numel in (1000, 300_003):
        results = world.run(rank_result_bytes, dtype_name, op, numel)
        assert len(results[0]) == numel * torch.empty((), dtype=getattr(torch, dtype_name)).element_size()
        differing = [r for r in range(world_size) if results[r] != results[0]]
        assert not differing, f"{dtype_name} {op} numel={numel}: ranks {differing} differ from rank 0"


@pytest.mark.parametrize("world_size", [3, 4])
def test_subgroups_interleaved(worlds, world_size):
    assert_clean(worlds(world_size).run(rank_subgroups), f"subgroups at world size {world_size}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_two_threads_two_groups(worlds, world_size):
    assert_clean(worlds(world_size).run(rank_threads, 12), f"two threads at world size {world_size}")


@pytest.mark.parametrize("case", list(BAD_INPUT_CASES))
def test_bad_input_raises_on_every_rank(worlds, backend, case):
    """A rank with invalid arguments raises ValueError/TypeError naming the argument; its
    peers raise too (instead of hanging) naming it as well; the group keeps working."""
    if backend == "gloo":
        pytest.skip("gloo hangs or crashes on mismatched arguments")
    bad_rank, argument, types = BAD_INPUT_CASES[case]
    world_size = 3
    world = worlds(world_size)
    try:
        results = world.run(rank_bad_input, case, bad_rank, timeout=90)
    finally:
        world.check_health()  # a group left unusable is replaced, not passed to the next test
    problems = []
    for rank, rep in enumerate(results):
        err = rep["error"]
        if err is None:
            problems.append(f"rank {rank}: nothing raised")
            continue
        if err[0] not in types:
            problems.append(f"rank {rank}: raised {err[0]} (expected {'/'.join(types)}): {err[1]}")
        if rank == bad_rank or bad_rank == -1:
            if argument not in err[1]:
                problems.append(f"rank {rank} (bad input): message does not name {argument!r}: {err[1]}")
        elif bad_rank >= 0 and f"rank {bad_rank}" not in err[1]:
            problems.append(f"rank {rank} (peer): message does not name rank {bad_rank}: {err[1]}")
        if rep["after"] is not None:
            problems.append(f"rank {rank}: all_reduce afterwards: {rep['after']}")
    assert not problems, f"{case}:\n" + "\n".join(problems)
