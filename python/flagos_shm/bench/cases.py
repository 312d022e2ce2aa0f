"""One benchmark case's torch buffers, call and correctness check (:func:`make_case`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .common import DTYPES, OPS, case_numel


class WrongResult(RuntimeError):
    """A backend returned a wrong result: the benchmark stops."""


@dataclass
class Case:
    """One (op, dtype, size) measurement's buffers for one backend."""

    op: str
    dtype: str
    size_bytes: int
    numel: int
    run: Callable[[], None]      # one synchronous call
    fill: Callable[[], None]     # write the check's inputs (values from the rank)
    verify: Callable[[], None]   # after fill + run: compare; raises WrongResult
    zero: Callable[[], None]     # zero-fill the buffers for timing (sums stay finite)


def _collectives():
    import torch.distributed as dist

    # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (same signatures)
    # and deprecated the old names; older torch has only those.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return all_gather, reduce_scatter


def make_case(op: str, dtype_name: str, requested: int, group, rank: int, n: int, device) -> Case:
    """Allocate the buffers of ``op`` on ``device`` for a requested size S in bytes.

    Raises:
        ValueError: unknown op or dtype.
    """
    import torch
    import torch.distributed as dist

    if dtype_name not in DTYPES:
        raise ValueError(f"dtype: unknown {dtype_name!r}; expected one of {', '.join(DTYPES)}")
    dt = getattr(torch, dtype_name)
    numel, size = case_numel(op, requested, n, DTYPES[dtype_name])
    all_gather, reduce_scatter = _collectives()

    def new(count: int):
        return torch.zeros(count, dtype=dt, device=device)

    def host(values):  # a CPU tensor of dt, written into a device buffer with copy_
        return torch.as_tensor(values).to(dt)

    def ramp(start: int, step: int, pieces: int):
        """[start, start + step, ...] (pieces values), each repeated numel times."""
        return host(torch.arange(pieces) * step + start).repeat_interleave(numel)

    def expect(got, want, what: str) -> None:
        got = got.cpu()
        want = want.expand_as(got)
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            i = int(bad[0]) if len(bad) else -1
            raise WrongResult(
                f"{op} {dtype_name} S={size} on backend {_backend_name(group)} returned a wrong "
                f"{what}: {len(bad)} of {got.numel()} elements differ, first at index {i}: got "
                f"{got[i].item()}, expected {want[i].item()}")

    if op in ("allreduce", "broadcast"):
        buf = new(numel)
        if op == "allreduce":
            def run():
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)

            def verify():
                expect(buf, host(n * (n + 1) // 2), "sum")
        else:
            def run():
                dist.broadcast(buf, group_src=0, group=group)

            def verify():
                expect(buf, host(1), "broadcast")
        return Case(op, dtype_name, size, numel, run, lambda: buf.fill_(rank + 1), verify,
                    lambda: buf.zero_())

    small, big = new(numel), new(numel * n)
    if op == "allgather":
        def run():
            all_gather(big, small, group=group)

        def fill():
            small.fill_(rank + 1)

        def verify():
            expect(big, ramp(1, 1, n), "gather")
        zero_bufs = (small, big)
    elif op == "reduce_scatter":
        def run():
            reduce_scatter(small, big, op=dist.ReduceOp.SUM, group=group)

        def fill():
            # rank r contributes (r + 1) * (i + 1) to chunk i; chunk `rank` sums to
            # (rank + 1) * n (n + 1) / 2.
            big.copy_(ramp(rank + 1, rank + 1, n))

        def verify():
            expect(small, host((rank + 1) * n * (n + 1) // 2), "sum")
        zero_bufs = (small, big)
    elif op == "alltoall":
        out = new(numel * n)

        def run():
            dist.all_to_all_single(out, big, group=group)

        def fill():
            # rank r sends r * n + q + 1 to rank q; rank r receives q * n + r + 1 from q.
            big.copy_(ramp(rank * n + 1, 1, n))

        def verify():
            expect(out, ramp(rank + 1, n, n), "exchange")
        zero_bufs = (big, out)
    else:
        raise ValueError(f"op: unknown op {op!r}; expected one of {', '.join(OPS)}")

    def zero():
        for t in zero_bufs:
            t.zero_()
    return Case(op, dtype_name, size, numel, run, fill, verify, zero)


def _backend_name(group) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group))
    except Exception:  # the name is only used in an error message
        return "?"
