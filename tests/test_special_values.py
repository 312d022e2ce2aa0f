"""Special values (inf, NaN, signed zeros, overflow) through the reductions, and determinism:
every rank reduces in rank order, so all ranks hold bitwise-identical results.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from support.checks import Checker, assert_clean, gloo_lacks, rank_and_size
from support.reference import FLOAT_DTYPES, make_input, reduce_op, reference_reduce, tname


# ---- special values, determinism ---------------------------------------------------------------

def rank_special_values() -> dict:
    """inf/NaN: float16 overflow gives inf on every rank, MIN/MAX and SUM propagate NaN."""
    rank, n = rank_and_size()
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
                if gloo_lacks("all_reduce", dtype, op) or gloo_lacks("nan") and name == "nan":
                    continue
                case = f"all_reduce {tname(dtype)} {op} special={name} inputs={[x.tolist() for x in inputs]}"
                t = inputs[rank].clone()
                if ck.call(case, lambda: dist.all_reduce(t, op=reduce_op(op))):
                    ck.check(case, t, reference_reduce(inputs, op), op=op, inputs=inputs)
    return ck.report()


def rank_result_bytes(dtype_name: str, op: str, numel: int) -> bytes:
    """The bytes of this rank's all_reduce result (random inputs)."""
    rank, n = rank_and_size()
    dtype = getattr(torch, dtype_name)
    t = make_input(dtype, numel, "bitwise", f"rank{rank}", op=op)
    dist.all_reduce(t, op=reduce_op(op))
    return t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes()


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
