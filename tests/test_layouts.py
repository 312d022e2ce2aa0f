"""Collectives on non-contiguous tensors (strided views, transposes) and tensors with a
storage offset, at world sizes 1-4, against references (``support.checks.Checker``): the
results land in the caller's tensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from support.checks import WORLD_SIZES, Checker, assert_clean, gloo_lacks, rank_and_size, rs_expected
from support.reference import LAYOUTS, all_inputs, layout_shape, place, reduce_op, reference_reduce, sizes, tname


# ---- layouts: non-contiguous tensors and storage offsets ---------------------------------------

LAYOUT_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool, torch.complex64]


def _layout_numels(dtype):
    """7 elements; plus the 2.5-slot size (chunked, misaligned by the offset) for 3 dtypes."""
    return [7, sizes(dtype)[-1]] if dtype in (torch.float32, torch.bfloat16, torch.uint8) else [7]


def rank_layouts() -> dict:
    """Inputs and outputs as an offset slice, a strided column, a transposed 2-D view: the
    result lands in the caller's view, and the buffer around it stays untouched."""
    rank, n = rank_and_size()
    ck = Checker()
    for layout in LAYOUTS[1:]:
        if gloo_lacks(layout):
            continue
        for dtype in LAYOUT_DTYPES:
            if gloo_lacks("layouts", dtype):
                continue
            for numel in _layout_numels(dtype):
                shape = layout_shape(layout, numel)
                k = torch.Size(shape).numel()
                if layout == "transposed" and numel != 7:
                    continue
                tag = f"{layout} {tname(dtype)} shape={shape}"
                # all_reduce (in place)
                for op in ("SUM", "MAX"):
                    if dtype.is_complex and op == "MAX" or gloo_lacks("all_reduce", dtype, op):
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
                if not gloo_lacks("reduce", dtype, "SUM"):
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
                if not gloo_lacks("reduce_scatter_tensor", dtype, "SUM"):
                    inputs = [x.reshape(out_shape) for x in all_inputs(dtype, n * k, n, "layout_rs", op="SUM")]
                    inp, in_guard = place(inputs[rank], layout)
                    out, out_guard = place(torch.ones(shape, dtype=dtype), layout)
                    case = f"reduce_scatter_tensor SUM {tag}"
                    if ck.call(case, lambda: dist.reduce_scatter_tensor(out, inp)):
                        flat = [x.reshape(-1) for x in inputs]
                        ck.check(case, out, rs_expected(flat, "SUM", rank, k).reshape(shape), op="SUM", inputs=flat)
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
                if gloo_lacks("gather", dtype):
                    continue
                if ck.call(case, lambda: dist.gather(inp, outs, dst=0)) and rank == 0:
                    for r in range(n):
                        ck.check(f"{case} [from rank {r}]", outs[r], inputs[r])
    return ck.report()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_layouts(worlds, world_size):
    assert_clean(worlds(world_size).run(rank_layouts), f"layouts at world size {world_size}")
