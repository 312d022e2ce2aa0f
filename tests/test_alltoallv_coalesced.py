"""Uneven all-to-all and coalesced batches as single core collectives (issue 12, items 4, 5).

Checked on CPU and on the emulated flagos device: values against per-element formulas, uneven
sizes with zeros, ``async_op=True`` with several calls in flight, mismatches raised on every
rank (naming the pair or the tensor) with the group usable afterwards, mixed sizes and
dtypes in one batch, and that a batch or an uneven exchange is one collective of the core
(its sequence number moves by one).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from support.flagos import EMU_ENV

pytestmark = pytest.mark.timeout(240)


def _dev(kind: str) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    torch.flagos.set_device(dist.get_rank())
    return torch.device("flagos", dist.get_rank())


def _seq() -> int:
    """The core's sequence number of the default group's CPU communicator."""
    import flagos_shm.backend

    return flagos_shm.backend.shm_part(dist.distributed_c10d._get_default_group())._comm.seq


def _rows(p: int, q: int) -> int:
    """Rows rank p sends rank q: uneven, with zeros."""
    return [0, 3, 1, 5, 2][(p * 2 + q) % 5]


def _piece(p: int, q: int, dtype: torch.dtype, width: int = 3) -> torch.Tensor:
    """What rank p sends rank q: distinct values per (p, q, element)."""
    k = _rows(p, q) * width
    vals = torch.arange(k, dtype=torch.float64) + 1000 * p + 100 * q
    if dtype.is_complex:
        return torch.complex(vals, -vals).to(dtype).view(-1, width)
    return vals.to(dtype).view(-1, width)


def _fail(errors: list, what: str, got, want) -> None:
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape or not torch.equal(got, want):
        errors.append(f"{what}: got {got.tolist()}, expected {want.tolist()}")


def rank_alltoallv(device: str) -> list:
    rank, n = dist.get_rank(), dist.get_world_size()
    dev, errors = _dev(device), []
    for dtype in (torch.float32, torch.int64, torch.complex64):
        send = [_rows(rank, q) for q in range(n)]
        recv = [_rows(q, rank) for q in range(n)]
        inp = torch.cat([_piece(rank, q, dtype) for q in range(n)]).to(dev)
        want = torch.cat([_piece(q, rank, dtype) for q in range(n)])
        seq = _seq()
        out = torch.full((sum(recv), 3), -1, dtype=dtype, device=dev)
        dist.all_to_all_single(out, inp, recv, send)
        _fail(errors, f"all_to_all_single {dtype}", out, want)
        if device == "cpu" and _seq() != seq + 1:
            errors.append(f"uneven all_to_all_single took {_seq() - seq} core collectives, expected 1")
        # several in flight, waited in reverse order
        outs = [torch.full((sum(recv), 3), -1, dtype=dtype, device=dev) for _ in range(3)]
        works = [dist.all_to_all_single(o, inp * (i + 1), recv, send, async_op=True) for i, o in enumerate(outs)]
        if any(w is None for w in works):
            errors.append("async_op=True returned None (the call ran inline)")
            continue
        for w in reversed(works):
            w.wait()
        for i, o in enumerate(outs):
            _fail(errors, f"async all_to_all_single #{i} {dtype}", o, want * (i + 1))
        # lists of pieces of different shapes, async
        ins = [_piece(rank, q, dtype).reshape(-1).to(dev) for q in range(n)]
        lst = [torch.full((_rows(q, rank), 3), -1, dtype=dtype, device=dev) for q in range(n)]
        work = dist.all_to_all(lst, ins, async_op=True)
        work.wait()
        for q in range(n):
            _fail(errors, f"all_to_all lists piece {q} {dtype}", lst[q], _piece(q, rank, dtype))
    return errors


def _err(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return ""


def rank_alltoallv_mismatch(device: str) -> dict:
    """Rank 1 sends rank 0 one row more than rank 0 expects: sync, async and as lists."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = _dev(device)
    send = [2 + (1 if rank == 1 and q == 0 else 0) for q in range(n)]
    inp, out = torch.ones(sum(send), device=dev), torch.zeros(2 * n, device=dev)
    res = {"sync": _err(lambda: dist.all_to_all_single(out, inp, [2] * n, send))}
    res["async"] = _err(lambda: dist.all_to_all_single(out, inp, [2] * n, send, async_op=True).wait())
    ins = [torch.ones(k, device=dev) for k in send]
    res["lists"] = _err(lambda: dist.all_to_all([torch.zeros(2, device=dev) for _ in range(n)], ins))
    res["untouched"] = bool((out == 0).all())
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    res["after"] = t.cpu().tolist()
    return res


def rank_coalesced(device: str) -> list:
    rank, n = dist.get_rank(), dist.get_world_size()
    dev, errors = _dev(device), []

    def val(i: int, k: int, r: int, dtype=torch.float32) -> torch.Tensor:
        return ((torch.arange(k, dtype=torch.float64) * (i + 1) + r) % 13).to(dtype)

    sizes = [0, 1, 1000, 70_000, 5]  # 70 000 float32 run as their own collective in the batch
    for async_ops in (False, True):
        ts = [val(i, k, rank).to(dev) for i, k in enumerate(sizes)]
        seq = _seq()
        with dist._coalescing_manager(async_ops=async_ops) as cm:
            for t in ts:
                dist.all_reduce(t)
        if async_ops:
            cm.wait()
        if device == "cpu" and not async_ops and _seq() != seq + 2:
            errors.append(f"a batch of 5 (one large) took {_seq() - seq} core collectives, expected 2")
        for i, (t, k) in enumerate(zip(ts, sizes)):
            _fail(errors, f"coalesced all_reduce tensor {i} async={async_ops}", t,
                  sum(val(i, k, r) for r in range(n)))
    # mixed dtypes and sizes: all_gather_into_tensor and reduce_scatter_tensor in a batch
    dtypes = [torch.float32, torch.int64, torch.bfloat16, torch.float64, torch.int32]
    ks = [1000, 7, 33, 0, 4000]
    ins = [val(i, k, rank, d).to(dev) for i, (k, d) in enumerate(zip(ks, dtypes))]
    outs = [torch.full((n * k,), -1, dtype=d, device=dev) for k, d in zip(ks, dtypes)]
    with dist._coalescing_manager():
        for o, t in zip(outs, ins):
            dist.all_gather_into_tensor(o, t)
    for i, (o, k, d) in enumerate(zip(outs, ks, dtypes)):
        _fail(errors, f"coalesced all_gather tensor {i} ({d})", o, torch.cat([val(i, k, r, d) for r in range(n)]))
    rs_in = [val(i, n * k, rank, d).to(dev) for i, (k, d) in enumerate(zip(ks, dtypes))]
    rs_out = [torch.full((k,), -1, dtype=d, device=dev) for k, d in zip(ks, dtypes)]
    with dist._coalescing_manager():
        for o, t in zip(rs_out, rs_in):
            dist.reduce_scatter_tensor(o, t, op=dist.ReduceOp.MAX)
    for i, (o, k, d) in enumerate(zip(rs_out, ks, dtypes)):
        want = torch.stack([val(i, n * k, r, d)[rank * k:(rank + 1) * k] for r in range(n)]).amax(0) if k else o.cpu()
        _fail(errors, f"coalesced reduce_scatter tensor {i} ({d})", o, want)
    # the list form: dist.all_gather_coalesced
    lists = [[torch.full((k,), -1.0, device=dev) for k in (3, 0, 600)] for _ in range(n)]
    dist.all_gather_coalesced(lists, [val(i, k, rank).to(dev) for i, k in enumerate((3, 0, 600))])
    for r in range(n):
        for i, k in enumerate((3, 0, 600)):
            _fail(errors, f"all_gather_coalesced [{r}][{i}]", lists[r][i], val(i, k, r))
    return errors


def rank_coalesced_mismatch(device: str) -> dict:
    """Rank 1's tensor 2 of a batch has another size; then rank 1's batch is one tensor short."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = _dev(device)
    ks = [4, 4, 5 if rank == 1 else 4]
    outs = [torch.zeros(n * k, device=dev) for k in ks]

    def gather():
        with dist._coalescing_manager():
            for o, k in zip(outs, ks):
                dist.all_gather_into_tensor(o, torch.ones(k, device=dev))
    res = {"size": _err(gather), "untouched": all(bool((o == 0).all()) for o in outs)}

    def reduce():
        with dist._coalescing_manager():
            for _ in range(2 if rank == 1 else 3):
                dist.all_reduce(torch.ones(8, device=dev))
    res["length"] = _err(reduce)
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    res["after"] = t.cpu().tolist()
    return res


# ---- the pytest side ---------------------------------------------------------------------------

CONFIGS = {  # name: (world size, device, environment)
    "cpu": (3, "cpu", {}),
    "flagos": (2, "flagos", EMU_ENV),
}


@pytest.fixture(params=list(CONFIGS))
def config(request, worlds, backend, emulator_built):  # noqa: F811
    if backend != "flagos_shm":
        pytest.skip("tests flagos_shm's core collectives")
    n, device, env = CONFIGS[request.param]
    return worlds(n, **env), n, device


def test_uneven_all_to_all_values_async_and_lists(config):
    world, _, device = config
    for rank, errors in enumerate(world.run(rank_alltoallv, device)):
        assert errors == [], f"rank {rank}: " + "\n".join(errors)


def test_uneven_all_to_all_mismatch_raises_on_every_rank_and_the_group_stays_usable(config):
    world, n, device = config
    for rank, res in enumerate(world.run(rank_alltoallv_mismatch, device)):
        for how in ("sync", "async", "lists"):
            assert res[how].startswith("ValueError") and "rank 1 sends 3 elements to rank 0, which expects 2" \
                in res[how], (rank, how, res[how])
        assert res["untouched"] and res["after"] == [float(n)] * 4, res


def test_coalesced_batches_values_mixed_sizes_and_dtypes(config):
    world, _, device = config
    for rank, errors in enumerate(world.run(rank_coalesced, device)):
        assert errors == [], f"rank {rank}: " + "\n".join(errors)


def test_coalesced_batch_mismatch_names_the_tensor_on_every_rank(config):
    world, n, device = config
    for rank, res in enumerate(world.run(rank_coalesced_mismatch, device)):
        assert res["size"].startswith("ValueError") and "tensor 2 of the batch" in res["size"] \
            and "rank 1 has float32 x 5 elements" in res["size"], (rank, res["size"])
        assert res["length"].startswith("ValueError") and "2 tensors" in res["length"], (rank, res["length"])
        assert res["untouched"] and res["after"] == [float(n)] * 4, res
