"""The core checks its own bounds: every buffer address passed to ``_core.Communicator`` is
followed by its length in bytes, and a count that does not fit raises ``ValueError`` naming
the argument, on the calling rank, before anything is written; the peers raise
``ValueError`` naming that rank, and the group stays usable.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.timeout(120)


def _part():
    import flagos_shm

    return flagos_shm.backend.shm_part(dist.distributed_c10d._get_default_group())


def _comm():
    return _part()._comm


def rank_short_buffers() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = _comm()
    count = 1000
    inp = torch.full((n * count,), 7.0)
    out = torch.full((n * count,), -1.0)
    es = 4
    short = (lambda full: full - es) if rank == 1 else (lambda full: full)
    calls = {
        "allreduce": lambda: comm.allreduce(out.data_ptr(), short(count * es), count, "float32", 0),
        "broadcast": lambda: comm.broadcast(out.data_ptr(), short(count * es), count, "float32", 0),
        "reduce": lambda: comm.reduce(out.data_ptr(), short(count * es), count, "float32", 0, 1),
        "allgather": lambda: comm.allgather(inp.data_ptr(), count * es, out.data_ptr(), short(n * count * es),
                                            count, "float32"),
        "reduce_scatter": lambda: comm.reduce_scatter(inp.data_ptr(), short(n * count * es), out.data_ptr(),
                                                      count * es, count, "float32", 0),
        "gather": lambda: comm.gather(inp.data_ptr(), count * es, out.data_ptr() if rank == 1 else 0,
                                      short(n * count * es) if rank == 1 else 0, count, "float32", 1),
        "scatter": lambda: comm.scatter(inp.data_ptr() if rank == 1 else 0, short(n * count * es) if rank == 1 else 0,
                                        out.data_ptr(), count * es, count, "float32", 1),
        "alltoall": lambda: comm.alltoall(inp.data_ptr(), n * count * es, out.data_ptr(), short(n * count * es),
                                          count, "float32"),
        "alltoallv": lambda: comm.alltoallv(inp.data_ptr(), n * count * es, out.data_ptr(), short(n * count * es),
                                            [count] * n, [count] * n, "float32"),
        "allreduce_coalesced": lambda: comm.allreduce_coalesced([inp.data_ptr(), out.data_ptr()],
                                                                [count * es, short(count * es)], [count, count],
                                                                ["float32", "float32"], 0),
        "allgather_coalesced": lambda: comm.allgather_coalesced([inp.data_ptr()], [count * es], [out.data_ptr()],
                                                                [short(n * count * es)], [count], ["float32"]),
        "reduce_scatter_coalesced": lambda: comm.reduce_scatter_coalesced([inp.data_ptr()], [short(n * count * es)],
                                                                          [out.data_ptr()], [count * es], [count],
                                                                          ["float32"], 0),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    # allreduce_coalesced rejected before it reduced its (valid) first tensor in place
    untouched = bool(torch.all(out == -1.0)) and bool(torch.all(inp == 7.0))
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    return {"errors": errors, "untouched": untouched, "after": t.tolist()}


def test_too_short_nbytes_raises_value_error_naming_the_argument_and_writes_nothing(worlds, backend):
    if backend != "flagos_shm":
        pytest.skip("drives flagos_shm's core directly")
    results = worlds(2).run(rank_short_buffers)
    names = {"allreduce": "nbytes", "broadcast": "nbytes", "reduce": "nbytes", "allgather": "out_nbytes",
             "reduce_scatter": "in_nbytes", "gather": "out_nbytes", "scatter": "in_nbytes",
             "alltoall": "out_nbytes", "alltoallv": "out_nbytes", "allreduce_coalesced": "nbytes[1]",
             "allgather_coalesced": "out_nbytes[0]", "reduce_scatter_coalesced": "in_nbytes[0]"}
    for name, arg in names.items():
        err = results[1]["errors"][name]
        assert err is not None and err.startswith(f"{arg}: ") and "too small" in err, (name, err)
        peer = results[0]["errors"][name]
        assert peer is not None and "rank 1 rejected its arguments" in peer, (name, peer)
    for rank, res in enumerate(results):
        assert res["untouched"], f"rank {rank}: a refused call wrote memory"
        assert res["after"] == [3.0] * 4, (rank, res)


def rank_null_with_bytes() -> str:
    try:
        _comm().allreduce(0, 16, 4, "float32", 0)
    except ValueError as e:
        return str(e)
    return ""


def test_null_address_with_bytes_is_refused_before_the_call(worlds, backend):
    if backend != "flagos_shm":
        pytest.skip("drives flagos_shm's core directly")
    for msg in worlds(1).run(rank_null_with_bytes):
        assert msg.startswith("ptr: null buffer address"), msg


def rank_bad_wait_timeouts() -> list:
    comm = _comm()
    out = []
    for seconds in (float("nan"), -1.0):
        try:
            comm.wait_ticket(0, seconds)
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    comm.wait_ticket(0, 0.5)  # a valid timeout off-callback: returns at once
    return out


def test_wait_ticket_refuses_a_nan_or_negative_timeout_by_name(worlds, backend):
    # Before, a NaN timeout passed unchecked (off-callback) or panicked the binding (in a
    # callback, Duration::from_secs_f64).
    if backend != "flagos_shm":
        pytest.skip("drives flagos_shm's core directly")
    for msgs in worlds(1).run(rank_bad_wait_timeouts):
        assert [m.split(",")[0] for m in msgs] == ["timeout_s: expected a non-negative number of seconds"] * 2, msgs


def rank_huge_timeouts() -> list:
    comm = _comm()
    t = torch.full((4,), float(dist.get_rank() + 1))
    comm.allreduce(t.data_ptr(), t.nbytes, t.numel(), "float32", 0, timeout_s=1e19)  # per call
    after_one = t.tolist()
    comm.set_timeout(1e19)  # the group's own, used by the next call
    try:
        comm.allreduce(t.data_ptr(), t.nbytes, t.numel(), "float32", 0)
    finally:
        comm.set_timeout(_part()._timeout_s)
    return [after_one, t.tolist()]


def test_a_timeout_of_centuries_waits_instead_of_overflowing(worlds, backend):
    # Before, a timeout_s between about 9.2e18 and 1.8e19 seconds (a valid Duration, but a
    # deadline beyond what an Instant holds) panicked in the core: "overflow when adding
    # duration to instant". Now every timeout_s is capped at about 31 years.
    if backend != "flagos_shm":
        pytest.skip("drives flagos_shm's core directly")
    world = worlds(2)
    for res in world.run(rank_huge_timeouts):
        assert res == [[3.0] * 4, [6.0] * 4], res  # 1 + 2, then 3 + 3

