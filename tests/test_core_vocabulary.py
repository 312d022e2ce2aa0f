"""The core's vocabulary (``_core.DTYPE_CODES``, ``REDUCE_OPS``, ``REDUCE_OP_DTYPES``, ``KINDS``)
is what Python's tables derive from: the op codes are torch's ``RedOpType`` numbers, the
dtype/op rules are the documented ones (written out here as the reference), and the
hierarchy's descriptor codes extend the core's without clashing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flagos_shm import _core, staging
from flagos_shm.backend import options
from flagos_shm.backend.hierarchy import protocol

FLOATS = ("float32", "float64", "float16", "bfloat16")
#: The README's rules: bitwise ops need integer or bool tensors, PREMUL_SUM floating point,
#: AVG is not defined for bool.
REFUSED = {"BAND": FLOATS, "BOR": FLOATS, "BXOR": FLOATS,
           "PREMUL_SUM": ("int8", "uint8", "int16", "int32", "int64", "bool"), "AVG": ("bool",)}


def test_reduce_op_codes_are_torchs():
    assert _core.REDUCE_OPS == {op.name: op.value for op in dist.ReduceOp.RedOpType.__members__.values()
                                if op.name in _core.REDUCE_OPS}
    assert len(_core.REDUCE_OPS) == 9 and options.OP_NAMES[options.PREMUL_SUM] == "PREMUL_SUM"


def test_each_dtype_takes_the_ops_of_the_rules():
    assert list(_core.REDUCE_OP_DTYPES) == _core.DTYPES == list(_core.DTYPE_CODES)
    for dtype, codes in _core.REDUCE_OP_DTYPES.items():
        want = {code for name, code in _core.REDUCE_OPS.items() if dtype not in REFUSED.get(name, ())}
        assert set(codes) == want, dtype


@pytest.mark.parametrize("dtype", [*staging.CORE_DTYPES, torch.complex64])
def test_check_op_follows_the_core_and_names_the_argument(dtype):
    name = staging.core_dtype(dtype, "x")
    buf = staging.HostBuffer(None, torch.empty(0, dtype=dtype), name, write_back=False)
    for op, code in _core.REDUCE_OPS.items():
        refused = (dtype.is_complex and op not in ("SUM", "AVG", "PREMUL_SUM")) or name in REFUSED.get(op, ())
        if refused:
            with pytest.raises(TypeError, match=rf"^x: ReduceOp\.{op} "):
                options.check_op(code, buf, "x")
        else:
            options.check_op(code, buf, "x")


def test_hierarchy_descriptor_codes_extend_the_cores():
    assert protocol._DTYPE_CODE == _core.DTYPE_CODES
    assert {k: protocol._KIND_CODE[k] for k in _core.KINDS} == _core.KINDS
    assert len(set(protocol._KIND_CODE.values())) == len(protocol._KIND_CODE)


def test_partial_results_are_carried_in_the_documented_dtypes():
    """The README's rule for reductions split into levels: half types in float32, integer AVG
    in int64 (exact sum, divided once), everything else in its own dtype."""
    small_ints = ("int8", "uint8", "int16", "int32")
    avg = _core.REDUCE_OPS["AVG"]
    for name in _core.DTYPES:
        for code in _core.REDUCE_OPS.values():
            want = ("float32" if name in ("float16", "bfloat16")
                    else "int64" if name in small_ints and code == avg else name)
            assert _core.CARRY_DTYPES[name][code] == want, (name, code)
