"""Rank-side checking shared by the collective tests (``test_collectives.py``,
``test_layouts.py``, ``test_special_values.py``, ``test_subgroups.py``,
``test_bad_input.py``): a :class:`Checker` that collects a rank's mismatches against the
references of :mod:`support.reference`, the cases gloo lacks (``--backend gloo``), and
:func:`assert_clean`, the pytest side that merges the ranks' reports.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .reference import compare, make_input, op_allowed, reference_reduce

#: The world sizes of the collective tests.
WORLD_SIZES = [1, 2, 3, 4]


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


def gloo_lacks(collective: str, dtype=None, op=None) -> bool:
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


def rank_and_size():
    """This rank's (rank, world size) in the default group."""
    return dist.get_rank(), dist.get_world_size()


def invalid_input(dtype):
    """A 3-element input of ``dtype`` that no collective accepts."""
    return make_input(dtype, 3, "invalid")


def error_types(dtype):
    """The exceptions an invalid dtype x op raises for ``dtype``."""
    # torch itself rejects MIN/MAX/PRODUCT/bitwise on complex tensors with ValueError.
    return (TypeError, ValueError) if dtype.is_complex else (TypeError,)



def rs_expected(inputs, op, rank, numel):
    """The reference of ``rank``'s ``numel``-element piece of a reduce-scatter of ``inputs``."""
    return reference_reduce([x[rank * numel:(rank + 1) * numel] for x in inputs], op)



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
