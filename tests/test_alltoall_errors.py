"""all_to_all_single / all_to_all size errors name the user's arguments, on every rank, on
one node and across simulated nodes (``FLAGOS_SHM_NODE_ID``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.spawn import spawn

pytestmark = pytest.mark.timeout(120)


def mismatches(rank: int, n: int, tmp: str) -> dict:
    from datetime import timedelta

    import flagos_shm  # noqa: F401

    dist.init_process_group("flagos_shm", rank=rank, world_size=n, timeout=timedelta(seconds=30))
    out = {}

    def case(name, fn):
        try:
            fn()
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)

    # rank 1 sends 4 elements to each rank, rank 0 2
    case("uniform", lambda: dist.all_to_all_single(torch.empty(2 * n * (rank + 1)), torch.ones(2 * n * (rank + 1))))
    w = [2 + (rank == 1 and q == 0) for q in range(n)]  # rank 1 sends 3 to rank 0, which expects 2
    case("splits", lambda: dist.all_to_all_single(torch.empty(2 * n), torch.ones(sum(w)), [2] * n, w))
    sizes = [2] * n if rank == 0 else None  # rank 0 passes split sizes, rank 1 none
    case("one_none", lambda: dist.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n), sizes, sizes))
    case("list", lambda: dist.all_to_all([torch.empty(2) for _ in range(n)],
                                         [torch.ones(2 + (rank == 1 and q == 0)) for q in range(n)]))
    got = torch.empty(n)
    dist.all_to_all_single(got, torch.full((n,), float(rank)))
    out["after"] = got.tolist()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("nodes", [1, 2])
def test_alltoall_size_errors_name_the_arguments(nodes):
    rank_env = {r: {"FLAGOS_SHM_NODE_ID": str(r)} for r in range(2)} if nodes == 2 else None
    results = spawn(mismatches, 2, env={"GLOO_SOCKET_IFNAME": "lo"}, rank_env=rank_env,
                    timeout=90)
    for rank, res in enumerate(results):
        assert res["after"] == [0.0, 1.0], (rank, res)
        assert "input.numel() / world_size" in res["uniform"] and "output" in res["uniform"], (rank, res["uniform"])
        assert ("rank 1's input_split_sizes[0]" in res["splits"]
                and "rank 0's output_split_sizes[1]" in res["splits"]), (rank, res["splits"])
        assert "input_split_sizes / output_split_sizes" in res["one_none"], (rank, res["one_none"])
        if nodes == 2:  # what each rank passed, not the descriptor's -1
            assert "-1 x" not in res["one_none"], (rank, res["one_none"])
            assert "group rank 0: alltoallv(float32, per-peer counts" in res["one_none"], (rank, res["one_none"])
            assert "group rank 1: alltoall(2 x float32 to each rank: no split sizes)" in res["one_none"], res
        assert ("rank 1's input_tensors[0].numel() against rank 0's output_tensors[1].numel()"
                in res["list"]), (rank, res["list"])
