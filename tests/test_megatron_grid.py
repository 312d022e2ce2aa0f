"""Explicit groups, Megatron-style: a TP x DP x PP grid on 4 ranks built from explicit rank
lists (every group passed to every call; nothing read from the default group), trained a
few steps with tensor-parallel allreduces (forward and backward), data-parallel gradient
allreduces, pipeline sends/receives of activations and their gradients, and a ZeRO-1 style
Adam whose state is sharded over the DP group and gathered on CPU over it at the end (as
distributed optimizers do for checkpoints). Compared with one process training the whole
model with ``torch.optim.Adam``: losses, parameters, optimizer state.

Also what a collective does with a group this rank is not a member of (torch: a warning
and no-op, never the world group) and with a destroyed group (torch: ValueError naming
the group; flagos_shm's own object: RuntimeError naming it).
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(300)
CALL_TIMEOUT_S = 180.0
D, H, BATCH, STEPS, LR = 8, 16, 8, 3, 0.05
GRIDS = [(2, 2, 1), (2, 1, 2), (1, 2, 2)]  # (tp, dp, pp), 4 ranks each


def _full_model():
    """Two blocks ``x -> tanh(x W1^T + b1) W2^T + b2``, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return [{"w1": torch.randn(H, D, generator=g) * 0.4, "b1": torch.randn(H, generator=g) * 0.1,
             "w2": torch.randn(D, H, generator=g) * 0.4, "b2": torch.randn(D, generator=g) * 0.1} for _ in range(2)]


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)


def _block(x, p):
    return torch.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]


NAMES = ["w1", "b1", "w2", "b2"]


def _reference() -> dict:
    blocks = [{k: v.clone().requires_grad_() for k, v in b.items()} for b in _full_model()]
    params = [b[k] for b in blocks for k in NAMES]
    opt = torch.optim.Adam(params, lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(_block(_block(x, blocks[0]), blocks[1]), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = [{k: (opt.state[b[k]]["exp_avg"], opt.state[b[k]]["exp_avg_sq"]) for k in NAMES} for b in blocks]
    return {"losses": losses, "blocks": [{k: v.detach() for k, v in b.items()} for b in blocks], "state": state}


def _tp_slice(name: str, t: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's shard of a full parameter: W1 and b1 by rows (column-parallel), W2 by
    columns (row-parallel), b2 replicated."""
    part = H // tp
    if name in ("w1", "b1"):
        return t[tp_rank * part:(tp_rank + 1) * part]
    if name == "w2":
        return t[:, tp_rank * part:(tp_rank + 1) * part]
    return t


def rank_grid(tp: int, dp: int, pp: int) -> dict:
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    assert tp * dp * pp == n
    # Megatron order: TP fastest, then DP, then PP. Every rank creates every group.
    coords = {r: (r % tp, (r // tp) % dp, r // (tp * dp)) for r in range(n)}  # (tp_rank, dp_rank, pp_rank)
    lists = {"tp": [[r for r in range(n) if coords[r][1:] == (d, p)] for p in range(pp) for d in range(dp)],
             "dp": [[r for r in range(n) if (coords[r][0], coords[r][2]) == (t, p)]
                    for p in range(pp) for t in range(tp)],
             "pp": [[r for r in range(n) if coords[r][:2] == (t, d)] for d in range(dp) for t in range(tp)]}
    groups, mine = {}, {}
    for kind, rank_lists in lists.items():
        for ranks in rank_lists:
            g = dist.new_group(ranks)
            groups.setdefault(kind, []).append((ranks, g))
            if rank in ranks:
                mine[kind] = (ranks, g)
    tp_rank, dp_rank, pp_rank = coords[rank]
    tp_ranks, tp_g = mine["tp"]
    dp_ranks, dp_g = mine["dp"]
    pp_ranks, pp_g = mine["pp"]

    class CopyToTP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=tp_g)
            return grad

    class ReduceFromTP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x = x.clone()
            dist.all_reduce(x, group=tp_g)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad

    full = _full_model()
    my_blocks = [0, 1] if pp == 1 else [pp_rank]
    params = [{k: _tp_slice(k, full[b][k], tp, tp_rank).clone().requires_grad_() for k in NAMES} for b in my_blocks]
    flat_params = [p[k] for p in params for k in NAMES]

    def tp_block(x, p):
        x = CopyToTP.apply(x)
        return ReduceFromTP.apply(torch.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T) + p["b2"]

    # ZeRO-1 Adam: this DP rank owns one contiguous shard of the flattened local parameters.
    total = sum(p.numel() for p in flat_params)
    shard = -(-total // dp)
    lo, hi = dp_rank * shard, min((dp_rank + 1) * shard, total)
    m, v = torch.zeros(shard), torch.zeros(shard)
    b1, b2, eps = 0.9, 0.999, 1e-8
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        x, y = x[rows], y[rows]
        for p in flat_params:
            p.grad = None
        if pp == 1:
            out = tp_block(tp_block(x, params[0]), params[1])
            loss = torch.nn.functional.mse_loss(out, y)
            loss.backward()
        elif pp_rank == 0:
            act = tp_block(x, params[0])
            dist.send(act.detach().contiguous(), pp_ranks[1], group=pp_g)
            grad = torch.empty_like(act)
            dist.recv(grad, pp_ranks[1], group=pp_g)
            act.backward(grad)
            loss = None
        else:
            act = torch.empty(x.shape[0], D)
            dist.recv(act, pp_ranks[0], group=pp_g)
            act.requires_grad_()
            loss = torch.nn.functional.mse_loss(tp_block(act, params[0]), y)
            loss.backward()
            dist.send(act.grad.contiguous(), pp_ranks[0], group=pp_g)
        if loss is not None:
            value = loss.detach().clone()
            dist.all_reduce(value, group=dp_g)
            losses.append(value.item() / dp)
        grads = torch.cat([p.grad.reshape(-1) for p in flat_params])
        dist.all_reduce(grads, group=dp_g)
        grads /= dp
        # this shard's Adam step (torch.optim.Adam's formula)
        flat = torch.cat([p.detach().reshape(-1) for p in flat_params])
        gs = torch.zeros(shard)
        gs[:hi - lo] = grads[lo:hi]
        m.mul_(b1).add_(gs, alpha=1 - b1)
        v.mul_(b2).addcmul_(gs, gs, value=1 - b2)
        t = step + 1
        denom = (v.sqrt() / (1 - b2 ** t) ** 0.5).add_(eps)
        new = torch.zeros(shard)
        new[:hi - lo] = flat[lo:hi]
        new.addcdiv_(m, denom, value=-LR / (1 - b1 ** t))
        gathered = torch.empty(shard * dp)
        dist.all_gather_into_tensor(gathered, new, group=dp_g)
        offset = 0
        with torch.no_grad():
            for p in flat_params:
                p.copy_(gathered[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
    # gather the sharded optimizer state on CPU over the DP group, to DP rank 0
    state = torch.cat([m, v])
    parts = [torch.empty_like(state) for _ in range(dp)] if dp_rank == 0 else None
    dist.gather(state, parts, dst=dp_ranks[0], group=dp_g)

    ref = _reference()
    res = {"coords": [tp_rank, dp_rank, pp_rank]}
    diffs = []
    for b, block in zip(my_blocks, params):
        for k in NAMES:
            want = _tp_slice(k, ref["blocks"][b][k], tp, tp_rank)
            diffs.append((block[k].detach() - want).abs().max().item())
    res["param"] = max(diffs)
    res["moved"] = max((p.detach() - _tp_slice(k, full[b][k], tp, tp_rank)).abs().max().item()
                       for b, pd in zip(my_blocks, params) for k, p in pd.items())
    if losses:
        res["loss"] = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
    if dp_rank == 0:
        ms = torch.cat([s[:shard] for s in parts])[:total]
        vs = torch.cat([s[shard:] for s in parts])[:total]
        def want(j):
            return torch.cat([_tp_slice(k, ref["state"][b][k][j], tp, tp_rank).reshape(-1)
                              for b in my_blocks for k in NAMES])
        want_m, want_v = want(0), want(1)
        res["exp_avg"] = (ms - want_m).abs().max().item()
        res["exp_avg_sq"] = (vs - want_v).abs().max().item()
    for kind in groups:
        for ranks, g in groups[kind]:
            if rank in ranks:
                dist.destroy_process_group(g)
    return res


def rank_foreign_and_destroyed_groups() -> dict:
    """Group [0, 1] used on ranks 2 and 3 (not members), and a destroyed group [0..3]."""
    import torch.distributed as dist

    from flagos_shm.backend import shm_part

    rank = dist.get_rank()
    res = {}
    g = dist.new_group([0, 1])
    t = torch.full((2,), float(rank + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        work = dist.all_reduce(t, group=g)
    res["nonmember"] = {"returned": repr(work), "value": t.tolist(),
                        "warned": any("does not belong to the given group" in str(w.message) for w in caught)}
    h = dist.new_group([0, 1, 2, 3])
    part = shm_part(h)
    dist.all_reduce(t, group=h)
    dist.destroy_process_group(h)
    for name, call in [("all_reduce", lambda: dist.all_reduce(t, group=h)),
                       ("send", lambda: dist.send(t, (rank + 1) % 4, group=h)),
                       ("backend", lambda: part.allreduce([t]).wait())]:
        try:
            call()
            res[name] = None
        except (ValueError, RuntimeError) as exc:
            res[name] = f"{type(exc).__name__}: {exc}"
    res["group_name"] = part._group_name
    if rank in (0, 1):
        dist.destroy_process_group(g)
    return res


@pytest.fixture
def shm_worlds(worlds, backend):
    if backend != "flagos_shm":
        pytest.skip("flagos_shm groups")
    return worlds


def test_megatron_grid_matches_single_process(shm_worlds):
    world = shm_worlds(4)
    for tp, dp, pp in GRIDS:
        results = world.run(rank_grid, tp, dp, pp, timeout=CALL_TIMEOUT_S)
        assert sorted(tuple(r["coords"]) for r in results) == sorted(
            (r % tp, (r // tp) % dp, r // (tp * dp)) for r in range(4))
        for res in results:
            assert res["moved"] > 1e-3, res  # training changed the parameters
            assert res["param"] < 1e-5, ((tp, dp, pp), res)
            if "loss" in res:
                assert res["loss"] < 1e-5, ((tp, dp, pp), res)
            if "exp_avg" in res:
                assert res["exp_avg"] < 1e-6 and res["exp_avg_sq"] < 1e-7, ((tp, dp, pp), res)
        assert sum("loss" in r for r in results) == tp * dp  # the last stages report the loss
        assert sum("exp_avg" in r for r in results) == 4 // dp  # one DP rank 0 per DP group


def test_foreign_and_destroyed_groups(shm_worlds):
    results = shm_worlds(4).run(rank_foreign_and_destroyed_groups, timeout=CALL_TIMEOUT_S)
    for rank, res in enumerate(results):
        non = res["nonmember"]
        if rank < 2:  # members: the group's sum, 1 + 2
            assert non["value"] == [3.0, 3.0] and not non["warned"], res
        else:  # torch: warning, returns None, tensor untouched (never the world group's sum, 10)
            assert non == {"returned": "None", "value": [float(rank + 1)] * 2, "warned": True}, res
        for name in ("all_reduce", "send"):  # torch refuses a destroyed group, naming it
            assert res[name] and res[name].startswith("ValueError") and "not initialized" in res[name], res
        assert res["backend"] and "has been shut down" in res["backend"], res
        assert repr(res["group_name"]) in res["backend"], res
