"""The c10d adapter's own staging (csrc/staging.hpp): a synchronous allreduce, broadcast,
all_gather_into_tensor, reduce_scatter_tensor or all_to_all_single (no split sizes) of
contiguous device tensors is staged in C++ and run by the CPU path; everything else keeps the
Python staging (flagos_shm/staging.py). Checked on the emulated flagos device, 2 ranks:
values against references each rank computes from every rank's inputs, which path took each
call (the Python staging is counted), the adapter pool's limit, errors on every rank with the
group usable after, tensors that require grad, FSDP's in-place all-gather, and calls after an
asynchronous one on the same tensor.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from support.flagos import CALL_TIMEOUT_S, EMU_ENV

pytestmark = pytest.mark.timeout(240)


@contextlib.contextmanager
def python_stagings():
    """Counts the device tensors the Python side stages while active."""
    from flagos_shm import staging

    seen = []
    real = staging.stage_device

    def counting(tensor, *args, **kwargs):
        seen.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    staging.stage_device = counting
    try:
        yield seen
    finally:
        staging.stage_device = real


def rank_paths() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.flagos.set_device(rank)
    dev = torch.device("flagos", rank)
    total = float(sum(range(1, n + 1)))
    out = {}
    with python_stagings() as staged:
        for numel in (1, 3, 1000, 70_000):  # 4 B to 280 KB: several pool sizes
            t = torch.full((numel,), float(rank + 1), device=dev)
            dist.all_reduce(t)
            out[f"sync{numel}"] = bool(torch.all(t.cpu() == total))
        out["sync_python_stagings"] = len(staged)
        # bf16 and an integer op, 2-D
        b = torch.full((4, 5), float(rank + 1), dtype=torch.bfloat16, device=dev)
        dist.all_reduce(b, op=dist.ReduceOp.MAX)
        out["bf16_max"] = bool(torch.all(b.cpu() == n))
        i = torch.full((7,), rank + 1, dtype=torch.int32, device=dev)
        dist.all_reduce(i, op=dist.ReduceOp.PRODUCT)
        out["int_product"] = i.cpu().tolist() == [2] * 7
        out["more_python_stagings"] = len(staged)
        # async: the Python staging, as before
        a = torch.full((5,), float(rank + 1), device=dev)
        dist.all_reduce(a, async_op=True).wait()
        out["async"] = bool(torch.all(a.cpu() == total))
        out["async_python_stagings"] = len(staged)
        # a strided device tensor: the Python full path
        s = torch.full((4, 3), float(rank + 1), device=dev)[:, 1]
        dist.all_reduce(s)
        out["strided"] = bool(torch.all(s.cpu() == total))
        out["strided_python_stagings"] = len(staged)
        # all_gather_into_tensor and reduce_scatter_tensor, synchronous: staged by the adapter
        for k in (1, 5, 20_000):
            inp = torch.arange(k, dtype=torch.float32, device=dev) + 1000 * rank
            out_ag = torch.full((n * k,), -1.0, device=dev)
            dist.all_gather_into_tensor(out_ag, inp)
            want = torch.cat([torch.arange(k, dtype=torch.float32) + 1000 * q for q in range(n)])
            out[f"ag{k}"] = torch.equal(out_ag.cpu(), want)
            big = torch.arange(n * k, dtype=torch.float64, device=dev) * (rank + 1)
            out_rs = torch.full((k,), -1.0, dtype=torch.float64, device=dev)
            dist.reduce_scatter_tensor(out_rs, big)
            ref = torch.arange(n * k, dtype=torch.float64) * sum(range(1, n + 1))
            out[f"rs{k}"] = torch.equal(out_rs.cpu(), ref[rank * k:(rank + 1) * k])
            before = torch.arange(n * k, dtype=torch.float64) * (rank + 1)
            out[f"rs_input_untouched{k}"] = torch.equal(big.cpu(), before)
        out["pair_python_stagings"] = len(staged)
        # broadcast from the last rank and all_to_all_single without split sizes
        for k in (1, 1000):
            bc = torch.full((k,), float(rank + 5), dtype=torch.float16, device=dev)
            dist.broadcast(bc, src=n - 1)
            out[f"bcast{k}"] = bool(torch.all(bc.cpu() == n + 4))
            send = torch.arange(n * k, dtype=torch.int64, device=dev) + 100 * rank
            recv = torch.full((n * k,), -1, dtype=torch.int64, device=dev)
            dist.all_to_all_single(recv, send)
            want = torch.cat([torch.arange(rank * k, (rank + 1) * k, dtype=torch.int64) + 100 * q for q in range(n)])
            out[f"a2a{k}"] = torch.equal(recv.cpu(), want)
        out["more_pair_python_stagings"] = len(staged)
        # FSDP's in-place all-gather: the input is this rank's piece of the output
        flat = torch.zeros(n * 3, device=dev)
        flat[rank * 3:(rank + 1) * 3] = float(rank + 7)
        dist.all_gather_into_tensor(flat, flat[rank * 3:(rank + 1) * 3])
        out["inplace_ag"] = flat.cpu().tolist() == [float(q + 7) for q in range(n) for _ in range(3)]
    # a leaf that requires grad (a parameter): its value changes, autograd does not object
    p = torch.nn.Parameter(torch.full((3,), float(rank + 1), device=dev))
    dist.all_reduce(p.data)
    dist.all_reduce(p)
    out["param"] = p.detach().cpu().tolist() == [total * n] * 3 and p.requires_grad
    # the version counter moves, as with any in-place write
    v = torch.ones(2, device=dev)
    before = v._version
    dist.all_reduce(v)
    out["version_moved"] = v._version > before
    # an async call on a tensor, then a synchronous one on the same tensor: the second sees
    # the first's result (it waits for its write-back before copying the tensor out)
    w = torch.full((6,), float(rank + 1), device=dev)
    work = dist.all_reduce(w, async_op=True)
    dist.all_reduce(w)
    work.wait()
    out["after_async"] = bool(torch.all(w.cpu() == total * n))
    return out


def rank_mismatch() -> dict:
    """Ranks disagree on the element count of a synchronous device allreduce: ValueError
    on every rank naming both counts, the tensor untouched, the group usable, the adapter's
    pool within its limit."""
    import flagos_shm

    rank = dist.get_rank()
    torch.flagos.set_device(rank)
    dev = torch.device("flagos", rank)
    t = torch.ones(4 + rank, device=dev)
    out = {}
    try:
        dist.all_reduce(t)
        out["error"] = None
    except ValueError as exc:
        out["error"] = f"ValueError: {exc}"
    out["untouched"] = bool(torch.all(t.cpu() == 1))
    after = torch.full((3,), float(rank), device=dev)
    dist.all_reduce(after)
    out["after"] = after.cpu().tolist()
    # all_gather_into_tensor whose pieces differ between ranks (each rank's own sizes fit)
    gathered = torch.full((2 * (2 + rank),), -1.0, device=dev)
    try:
        dist.all_gather_into_tensor(gathered, torch.ones(2 + rank, device=dev))
        out["ag_error"] = None
    except ValueError as exc:
        out["ag_error"] = f"ValueError: {exc}"
    out["ag_untouched"] = bool(torch.all(gathered.cpu() == -1))
    native = flagos_shm.backend.native()
    native.set_pinned_pool_limit(600_000)
    for numel in (1 << 14, 1 << 15, 1 << 16, 1 << 17):  # buffers of 64 KiB to 512 KiB: 960 KiB
        dist.all_reduce(torch.ones(numel, device=dev))
    out["idle_bytes"] = native.pinned_pool_idle_bytes()
    native.set_pinned_pool_limit(flagos_shm.staging.pinned_pool().limit_bytes)
    return out


@pytest.fixture
def flagos2(worlds, backend, emulator_built):  # noqa: F811
    if backend != "flagos_shm":
        pytest.skip("flagos_shm's staging")
    return worlds(2, **EMU_ENV)


def test_synchronous_device_allreduce_is_staged_by_the_adapter(flagos2):
    for rank, res in enumerate(flagos2.run(rank_paths, timeout=CALL_TIMEOUT_S)):
        assert all(res[f"sync{k}"] for k in (1, 3, 1000, 70_000)), res
        assert res["sync_python_stagings"] == 0, res  # the adapter staged them
        assert res["bf16_max"] and res["int_product"], res
        assert res["more_python_stagings"] == 0, res
        assert res["async"] and res["async_python_stagings"] == 1, res
        assert res["strided"] and res["strided_python_stagings"] == 2, res
        assert res["param"] and res["version_moved"] and res["after_async"], res
        for k in (1, 5, 20_000):
            assert res[f"ag{k}"] and res[f"rs{k}"] and res[f"rs_input_untouched{k}"], (k, res)
        assert res["pair_python_stagings"] == 2, res  # none since the strided one
        assert res["inplace_ag"], res
        assert res["bcast1"] and res["bcast1000"] and res["a2a1"] and res["a2a1000"], res
        assert res["more_pair_python_stagings"] == 2, res


def test_a_mismatch_raises_on_every_rank_and_the_pool_keeps_its_limit(flagos2):
    for res in flagos2.run(rank_mismatch, timeout=CALL_TIMEOUT_S):
        assert res["error"] and "4" in res["error"] and "5" in res["error"], res
        assert res["untouched"], res
        assert res["after"] == [1.0, 1.0, 1.0], res
        assert res["ag_error"] and "ValueError" in res["ag_error"], res
        assert res["ag_untouched"], res
        assert 0 < res["idle_bytes"] <= 600_000, res  # the limit holds (the smallest go first)
