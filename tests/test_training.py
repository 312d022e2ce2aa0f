"""What real callers do over the backend: DDP and FSDP2 training, object collectives, DTensor.

Training tests compare the distributed result with one process training on the
concatenated batches: with a mean loss and equal per-rank batch sizes, the average of the
ranks' gradients (DDP's allreduce / world size, FSDP2's reduce-scatter with AVG) is the
full-batch gradient, so after the same optimizer steps the parameters agree up to float32
rounding (compared with a tolerance of 1e-5). Ranks start from *different* random
parameters, so the tests also check that DDP's and FSDP2's initial synchronisation
(broadcast / sharding from rank 0's values) happened.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

IN, HIDDEN, OUT = 8, 16, 3
BATCH_PER_RANK = 6
STEPS = 4
LR = 0.1
TOL = dict(rtol=1e-5, atol=1e-5)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def _batch(step: int, world_size: int, seed: int):
    """The full batch of one step (world_size * BATCH_PER_RANK rows); rank r takes rows
    [r * BATCH_PER_RANK, (r + 1) * BATCH_PER_RANK)."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randn(world_size * BATCH_PER_RANK, IN, generator=g)
    y = torch.randint(0, OUT, (world_size * BATCH_PER_RANK,), generator=g)
    return x, y


def _optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def reference_training(world_size: int, seed: int, init_seed: int) -> dict:
    """One process, the full batches, starting from ``init_seed``'s parameters."""
    model = _model(init_seed)
    opt = _optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, world_size, seed)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses}


# ---- rank functions ---------------------------------------------------------------------------

def _train_local_rows(model, rank: int, n: int, seed: int) -> None:
    """STEPS optimizer steps of ``model`` on this rank's rows of each global batch."""
    opt = _optimizer(model.parameters())
    rows = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    for step in range(STEPS):
        x, y = _batch(step, n, seed)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        opt.step()


def rank_ddp(seed: int, bucket_cap_mb: float) -> dict:
    """DDP over the default group; each rank starts from its own random parameters (DDP
    broadcasts rank 0's). Returns the final parameters and the local losses."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = dist.get_rank(), dist.get_world_size()
    model = DDP(_model(seed + 100 + rank), bucket_cap_mb=bucket_cap_mb)
    _train_local_rows(model, rank, n, seed)
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def rank_compiled_ddp(seed: int, compiler: str) -> dict:
    """``torch.compile(DDP(model))``: Dynamo traces DDP's forward (with its graph breaks at the
    bucketed allreduces, which run through the backend as in eager mode)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = dist.get_rank(), dist.get_world_size()
    model = _model(seed + 100 + rank)
    compiled = torch.compile(DDP(model), backend=compiler)
    try:
        _train_local_rows(compiled, rank, n, seed)
    finally:
        torch._dynamo.reset()  # the harness's rank processes are reused by later tests
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rank_fsdp2(seed: int) -> dict:
    """FSDP2 ``fully_shard`` per Linear layer and at the root, on a CPU device mesh over the
    default group. Returns the full (unsharded) parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    model = _model(seed + 100)  # FSDP2 does not broadcast: every rank must start alike
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train_local_rows(model, rank, n, seed)
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


def _obj(rank: int):
    """A rank-specific object of rank-dependent size (uneven pickles), with a tensor inside."""
    return {"rank": rank, "name": "r" * (rank * 37 + 1), "tensor": torch.arange(rank + 2, dtype=torch.float64),
            "nested": [rank, (rank, str(rank)), {"x": rank ** 2}]}


def rank_objects() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    out: dict = {"broadcast": [], "gather": [], "scatter": []}
    for src in range(n):
        objs = [_obj(src), "second", src * 1.5] if rank == src else [None, None, None]
        dist.broadcast_object_list(objs, src=src)
        out["broadcast"].append(objs)
    gathered = [None] * n
    dist.all_gather_object(gathered, _obj(rank))
    out["all_gather"] = gathered
    for dst in range(n):
        lst = [None] * n if rank == dst else None
        dist.gather_object(_obj(rank), lst, dst=dst)
        out["gather"].append(lst)
    for src in range(n):
        recv = [None]
        dist.scatter_object_list(recv, [_obj(100 * src + r) for r in range(n)] if rank == src else None, src=src)
        out["scatter"].append(recv[0])
    return out


def rank_dtensor() -> dict:
    """Redistributions on a 1-D CPU mesh; each result as a plain tensor (or an error)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    full = torch.arange(n * 3 * 5, dtype=torch.float32).reshape(n * 3, 5) / 7
    local = torch.arange(n * 2 * 3, dtype=torch.float32).reshape(n * 2, 3) * (rank + 1) + rank
    out = {}

    def attempt(name, fn):
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001  reported by the test
            out[name] = f"{type(exc).__name__}: {exc}"

    attempt("distribute Shard(0) -> Replicate",
            lambda: distribute_tensor(full, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local())
    attempt("distribute Shard(1) -> Replicate (uneven)",
            lambda: distribute_tensor(full, mesh, [Shard(1)]).redistribute(mesh, [Replicate()]).to_local())
    attempt("Shard(0) -> Shard(1) local",
            lambda: distribute_tensor(full, mesh, [Shard(0)]).redistribute(mesh, [Shard(1)]).to_local())
    attempt("Partial(sum) -> Replicate",
            lambda: DTensor.from_local(local, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local())
    attempt("Partial(avg) -> Replicate",
            lambda: DTensor.from_local(local, mesh, [Partial("avg")]).redistribute(mesh, [Replicate()]).to_local())
    attempt("Partial(sum) -> Shard(0) local",
            lambda: DTensor.from_local(local, mesh, [Partial()]).redistribute(mesh, [Shard(0)]).to_local())
    attempt("Partial(max) -> Replicate",
            lambda: DTensor.from_local(local, mesh, [Partial("max")]).redistribute(mesh, [Replicate()]).to_local())
    return out


# ---- tests ----------------------------------------------------------------------------------------

def _assert_params_close(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], **TOL, msg=lambda m, k=k: f"{what}, {k}: {m}")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.0005], ids=["one-bucket", "many-buckets"])
def test_ddp_matches_full_batch_training(worlds, world_size, bucket_cap_mb):
    seed = 7
    results = worlds(world_size).run(rank_ddp, seed, bucket_cap_mb)
    reference = reference_training(world_size, seed, init_seed=seed + 100)  # rank 0's initial parameters
    initial = _model(seed + 100).state_dict()
    assert any(not torch.equal(reference["params"][k], initial[k]) for k in initial), "training changed nothing"
    for rank, params in enumerate(results):
        _assert_params_close(params, reference["params"], f"DDP rank {rank}")
        for k in params:  # the same averaged gradients on every rank -> identical parameters
            assert torch.equal(params[k], results[0][k]), f"rank {rank} parameter {k} differs from rank 0's"


def test_compiled_ddp_matches_full_batch_training(worlds):
    """``torch.compile(DDP(model))`` (the README once listed it as failing: it trains like
    eager DDP on torch 2.10 and the newest, with the C++ adapter)."""
    seed = 9
    results = worlds(2).run(rank_compiled_ddp, seed, "aot_eager")
    reference = reference_training(2, seed, init_seed=seed + 100)
    for rank, params in enumerate(results):
        _assert_params_close(params, reference["params"], f"compiled DDP rank {rank}")
        for k in params:
            assert torch.equal(params[k], results[0][k]), f"rank {rank} parameter {k} differs from rank 0's"


@pytest.mark.parametrize("world_size", [2])
def test_fsdp2_matches_full_batch_training(worlds, world_size):
    seed = 11
    results = worlds(world_size).run(rank_fsdp2, seed)
    reference = reference_training(world_size, seed, init_seed=seed + 100)
    for rank, params in enumerate(results):
        _assert_params_close(params, reference["params"], f"FSDP2 rank {rank}")


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_object_collectives_round_trip(worlds, world_size):
    results = worlds(world_size).run(rank_objects)
    n = world_size

    def same(a, b):  # objects holding tensors: compare via torch.equal where needed
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    for rank, out in enumerate(results):
        for src in range(n):
            assert same(out["broadcast"][src], [_obj(src), "second", src * 1.5]), (rank, "broadcast", src)
            assert same(out["scatter"][src], _obj(100 * src + rank)), (rank, "scatter", src)
        assert same(out["all_gather"], [_obj(r) for r in range(n)]), (rank, "all_gather")
        for dst in range(n):
            expected = [_obj(r) for r in range(n)] if rank == dst else None
            assert same(out["gather"][dst], expected), (rank, "gather", dst)


@pytest.mark.parametrize("world_size", [2, 3])
def test_dtensor_redistribute(worlds, world_size):
    results = worlds(world_size).run(rank_dtensor)
    n = world_size
    full = torch.arange(n * 3 * 5, dtype=torch.float32).reshape(n * 3, 5) / 7
    locals_ = [torch.arange(n * 2 * 3, dtype=torch.float32).reshape(n * 2, 3) * (r + 1) + r for r in range(n)]
    total = sum(locals_)
    problems = []
    for rank, out in enumerate(results):
        expected = {
            "distribute Shard(0) -> Replicate": full,
            "distribute Shard(1) -> Replicate (uneven)": full,
            # Shard(1) of 5 columns over n ranks: torch.chunk sizes (ceil), possibly empty
            "Shard(0) -> Shard(1) local": torch.chunk(full, n, dim=1)[rank] if rank < len(torch.chunk(full, n, dim=1))
            else full[:, :0],
            "Partial(sum) -> Replicate": total,
            "Partial(avg) -> Replicate": total / n,
            "Partial(sum) -> Shard(0) local": torch.chunk(total, n, dim=0)[rank],
            "Partial(max) -> Replicate": torch.stack(locals_).amax(0),
        }
        for name, exp in expected.items():
            got = out[name]
            if isinstance(got, str):
                problems.append(f"rank {rank} {name}: raised {got}")
            elif got.shape != exp.shape or not torch.allclose(got, exp, rtol=1e-6, atol=1e-6):
                problems.append(f"rank {rank} {name}: got {got.tolist()}, expected {exp.tolist()}")
    assert not problems, "\n".join(problems)
