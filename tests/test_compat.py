"""flagos_shm._compat: the torch-version differences, checked on whichever torch runs the suite
(.ci/run: the README's torch; .ci/compat: torch 2.10)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flagos_shm import _compat
from flagos_shm.backend.options import PREMUL_SUM
from flagos_shm.backend.options import reduce_op as _reduce_op


@pytest.mark.parametrize("text, want", [
    ("2.10.0", (2, 10, 0)), ("2.10.0+cu128", (2, 10, 0)), ("2.15.1+cpu", (2, 15, 1)),
    ("2.16.0a0+git1234", (2, 16, 0)), ("2.11", (2, 11, 0)), ("2.14.0rc1", (2, 14, 0)),
])
def test_version_parsing(text, want):
    assert _compat._version(text) == want


def test_torch_version_and_floor():
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert _compat.TORCH_VERSION[:2] == (major, minor)
    assert _compat.TORCH_VERSION >= _compat.MIN_TORCH_VERSION


def test_old_behaviours_are_told_apart_on_the_tested_torches():
    # Decided from the installed functions' code; on the two torches CI runs they must agree
    # with the releases: 2.10 has every old behaviour, 2.15 none.
    old = (_compat.SPLIT_GROUP_ON_CUDA, _compat.MONITORED_BARRIER_GLOO, _compat.UNDEFINED_DEFAULT_GLOO)
    if _compat.TORCH_VERSION[:2] == (2, 10):
        assert all(old), old
    if _compat.TORCH_VERSION[:2] >= (2, 15):
        assert not any(old), old


@pytest.mark.parametrize("factor", [0.5, 3.0, torch.tensor([2.5])], ids=["0.5", "3.0", "tensor"])
def test_premul_factor_matches_the_pickled_state(factor):
    op = dist._make_nccl_premul_sum(factor)
    got = _compat.premul_factor(op)
    ref = op.__getstate__()[1]               # the state every supported torch pickles
    if isinstance(factor, torch.Tensor):
        assert torch.equal(got, ref) and torch.equal(got, factor)
    else:
        assert got == ref == factor
    code, parsed = _reduce_op(op)
    assert code == PREMUL_SUM and parsed == float(torch.as_tensor(factor).item())


def test_premul_factor_from_state_when_the_attribute_is_missing():
    class OldReduceOp:                       # as torch 2.10's ReduceOp: no .factor
        def __getstate__(self):
            return (dist.ReduceOp.RedOpType.PREMUL_SUM, 0.25)

    assert _compat.premul_factor(OldReduceOp()) == 0.25


@pytest.mark.parametrize("op", [dist.ReduceOp.RedOpType.PREMUL_SUM, 8, dist.ReduceOp.SUM],
                         ids=["RedOpType", "int", "SUM"])
def test_no_factor_raises_attribute_error(op):
    with pytest.raises(AttributeError):
        _compat.premul_factor(op)


def test_premul_without_factor_is_a_value_error():
    with pytest.raises(ValueError, match="needs a factor"):
        _reduce_op(dist.ReduceOp.RedOpType.PREMUL_SUM)
