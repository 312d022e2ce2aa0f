"""Every collective x dtype x reduce op x size at world sizes 1-4, against references.

Each ``rank_*`` function runs inside every rank process of a pool (``support.harness.World``):
it loops over many cases of one collective, generates every rank's inputs deterministically
(``support.reference.make_input``), runs the collective through ``torch.distributed`` and
compares the result with ``support.reference.reference_reduce`` or the plain data movement,
returning ``{"checked": <cases>, "failures": [<case: mismatch>, ...]}`` (a
``support.checks.Checker``). The pytest side merges the ranks' reports
(``support.checks.assert_clean``) and fails with every failing case listed.

Sizes are 0, 1, 3, 7 elements and a large one (``support.reference.large_numel``): 2.5 chunk
slots, about 640 KiB with the suite's 256 KiB slot (conftest.py pins it;
``test_collective_default_slots`` runs four collectives with the core's default), which goes through the slots in 3
chunks and, at 2-4 ranks, takes the two-step allreduce (above ``_core.ONE_SHOT_MAX_BYTES``).
The large size is inside the single-copy bands of the fallback plan (the suite's;
``_core.PLAN_FALLBACK``) for allgather, reduce-scatter, broadcast and all-to-all, which take
the single-copy path (``process_vm_readv``) where the machine allows it.
``test_collective_small_slots`` repeats six collectives in pools with 4 KiB slots
(``FLAGOS_SHM_SLOT_BYTES=4096``) and single-copy off (``FLAGOS_SHM_CMA=0``), where the
large size is 320 KiB: 80 chunks through the slots, two-step allreduce, slices of each
chunk not divisible by 3.

Cases that gloo does not support are skipped when the suite runs with ``--backend gloo``
(``support.checks.gloo_lacks``); with flagos_shm every case runs. The same checks on other
inputs: ``test_layouts.py`` (non-contiguous tensors, storage offsets),
``test_special_values.py`` (inf/NaN, bitwise-identical results), ``test_subgroups.py``,
``test_bad_input.py``.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from support.checks import (WORLD_SIZES, Checker, assert_clean, error_types, gloo_lacks, invalid_input, rank_and_size,
                            rs_expected)
from support.reference import (DTYPES, DTYPES_WITH_COMPLEX, OPS, all_inputs, make_input, op_allowed, reduce_op,
                               reference_reduce, sizes, tname)


# ---- reductions -------------------------------------------------------------------------------

def rank_all_reduce(large: bool = True) -> dict:
    rank, n = rank_and_size()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        for op in OPS:
            if gloo_lacks("all_reduce", dtype, op):
                continue
            if not op_allowed(dtype, op):
                t = invalid_input(dtype)
                ck.expect_error(f"all_reduce {tname(dtype)} {op}", lambda: dist.all_reduce(t, op=reduce_op(op)),
                                error_types(dtype))
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
    rank, n = rank_and_size()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        for op in OPS:
            if gloo_lacks("reduce", dtype, op):
                continue
            if not op_allowed(dtype, op):
                t = invalid_input(dtype)
                ck.expect_error(f"reduce {tname(dtype)} {op}", lambda: dist.reduce(t, dst=0, op=reduce_op(op)),
                                error_types(dtype))
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


def rank_reduce_scatter_tensor(large: bool = True) -> dict:
    """``reduce_scatter_tensor`` with a flat (n*k,) and a stacked (n, k) input."""
    rank, n = rank_and_size()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        for op in OPS:
            if gloo_lacks("reduce_scatter_tensor", dtype, op):
                continue
            if not op_allowed(dtype, op):
                out, inp = torch.empty(3, dtype=dtype), make_input(dtype, 3 * n, "invalid")
                ck.expect_error(f"reduce_scatter_tensor {tname(dtype)} {op}",
                                lambda: dist.reduce_scatter_tensor(out, inp, op=reduce_op(op)), error_types(dtype))
                continue
            for numel in sizes(dtype, large):
                inputs = all_inputs(dtype, n * numel, n, "reduce_scatter", op=op)
                expected = rs_expected(inputs, op, rank, numel)
                for shape in ("flat", "stacked") if numel <= 7 and not gloo_lacks("stacked") else ("flat",):
                    case = f"reduce_scatter_tensor {tname(dtype)} {op} numel={numel} input={shape}"
                    inp = inputs[rank].clone() if shape == "flat" else inputs[rank].clone().reshape(n, numel)
                    out = torch.full((numel,), 1, dtype=dtype)
                    if ck.call(case, lambda: dist.reduce_scatter_tensor(out, inp, op=reduce_op(op))):
                        ck.check(case, out, expected, op=op, inputs=inputs)
    return ck.report()


def rank_reduce_scatter(large: bool = True) -> dict:
    """``reduce_scatter`` with a list of n input tensors."""
    rank, n = rank_and_size()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        for op in OPS:
            if gloo_lacks("reduce_scatter", dtype, op):
                continue
            if not op_allowed(dtype, op):
                out = torch.empty(3, dtype=dtype)
                ins = [make_input(dtype, 3, "invalid", j) for j in range(n)]
                ck.expect_error(f"reduce_scatter {tname(dtype)} {op}",
                                lambda: dist.reduce_scatter(out, ins, op=reduce_op(op)), error_types(dtype))
                continue
            for numel in sizes(dtype, large):
                case = f"reduce_scatter {tname(dtype)} {op} numel={numel}"
                inputs = all_inputs(dtype, n * numel, n, "reduce_scatter_list", op=op)
                ins = [c.clone() for c in inputs[rank].split(numel)] if numel else \
                    [torch.empty(0, dtype=dtype) for _ in range(n)]
                out = torch.full((numel,), 1, dtype=dtype)
                if ck.call(case, lambda: dist.reduce_scatter(out, ins, op=reduce_op(op))):
                    ck.check(case, out, rs_expected(inputs, op, rank, numel), op=op, inputs=inputs)
    return ck.report()


def rank_all_reduce_coalesced(large: bool = True) -> dict:
    """``dist.all_reduce_coalesced`` and ``all_reduce`` inside ``_coalescing_manager``
    (both reach the backend's ``allreduce_coalesced``) on tensors of every size at once."""
    import warnings

    rank, n = rank_and_size()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        for op in OPS:
            if gloo_lacks("all_reduce", dtype, op) or not op_allowed(dtype, op):
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
    rank, n = rank_and_size()
    ck = Checker()
    for dtype in DTYPES:
        for op in ("SUM", "AVG", "MAX", "PREMUL_SUM"):
            if gloo_lacks("reduce_scatter_tensor", dtype, op) or not op_allowed(dtype, op):
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
                    ck.check(f"{case} [numel={k}]", out, rs_expected(x, op, rank, k), op=op, inputs=x)
    return ck.report()


# ---- data movement ----------------------------------------------------------------------------

def rank_broadcast(large: bool = True) -> dict:
    rank, n = rank_and_size()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        if gloo_lacks("broadcast", dtype):
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
    rank, n = rank_and_size()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        if gloo_lacks("all_gather", dtype):
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
    rank, n = rank_and_size()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        if gloo_lacks("all_gather_into_tensor", dtype):
            continue
        for numel in sizes(dtype, large):
            inputs = all_inputs(dtype, numel, n, "all_gather_into_tensor")
            expected = torch.cat(inputs)
            for shape in ("flat", "stacked", "in-place") if numel <= 7 and not gloo_lacks("stacked") \
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

    rank, n = rank_and_size()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        if gloo_lacks("all_gather_coalesced", dtype):
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
    rank, n = rank_and_size()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        if gloo_lacks("gather", dtype):
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
    rank, n = rank_and_size()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        if gloo_lacks("scatter", dtype):
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
    rank, n = rank_and_size()
    ck = Checker()
    for dtype in DTYPES_WITH_COMPLEX:
        if gloo_lacks("all_to_all", dtype):
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
    rank, n = rank_and_size()
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
    (``FLAGOS_SHM_PLAN=single_copy=1K,allreduce_single_copy=8K``): the large size of every dtype
    takes the ``process_vm_readv`` path (broadcast: the non-roots read the root's buffer;
    all-to-all with equal splits: each rank reads its piece of every peer's input),
    including allreduce, which by default switches only at 2 MiB. Skipped where the kernel
    forbids cross-process reads."""
    if backend == "gloo":
        pytest.skip("single-copy is a flagos_shm path")
    world = worlds(world_size, FLAGOS_SHM_PLAN="single_copy=1K,allreduce_single_copy=8K")
    if world.run(_single_copy_min_bytes)[0] is None:
        pytest.skip("process_vm_readv between the ranks is not allowed here (ptrace scope / seccomp)")
    assert_clean(world.run(COLLECTIVES[collective]), f"{collective} at world size {world_size}, single-copy")


def _single_copy_min_bytes():
    import flagos_shm

    return flagos_shm.backend.shm_part(dist.distributed_c10d._get_default_group())._comm.single_copy_min_bytes


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_barrier(worlds, world_size, tmp_path):
    assert_clean(worlds(world_size).run(rank_barrier, str(tmp_path)), f"barrier at world size {world_size}")
