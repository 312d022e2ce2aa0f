"""flagos_shm on the (emulated) ``flagos`` device: FSDP2 against DDP on a small decoder-only
transformer (tied and untied embeddings), with a DCP checkpoint round trip.

The set-up these files share (the emulated device on ``flagos:<rank>``, references computed
another way in the same rank, skipped under ``--backend gloo``): ``support/flagos.py``.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.flagos import CALL_TIMEOUT_S, setup_device

pytestmark = pytest.mark.timeout(240)


# ==== 12. FSDP2 vs DDP on a small decoder-only transformer, with a DCP round trip ================

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 2, 16, 4
TF_STEPS, TF_CKPT_STEP = 20, 10
TF_TOL = dict(rtol=1e-5, atol=1e-5)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        # No qkv bias (as in Llama): the key bias's exact gradient is 0 (softmax ignores a
        # per-query shift), so AdamW would amplify its rounding noise into O(lr) updates.
        self.qkv, self.proj = torch.nn.Linear(DIM, 3 * DIM, bias=False), torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class _Decoder(torch.nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        torch.nn.init.normal_(self.tok.weight, std=0.02)  # GPT-2's init; N(0, 1) makes tied logits huge
        self.pos = torch.nn.Parameter(0.02 * torch.randn(SEQ, DIM))
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _decoder(tied: bool, seed: int) -> _Decoder:
    torch.manual_seed(seed)
    return _Decoder(tied)


def _tokens(step: int, rank: int, dev) -> torch.Tensor:
    """Rank ``rank``'s batch of step ``step``: two batches per rank, alternating, so that
    the loss falls within 20 steps."""
    g = torch.Generator().manual_seed(10_000 + 100 * (step % 2) + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(dev)


def _train_step(model, opt, tokens) -> tuple:
    """One AdamW step; returns (local loss, total gradient norm before clipping)."""
    opt.zero_grad()
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    opt.step()
    return loss.item(), norm.item()


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _full_state(model, opt) -> tuple:
    """Full (unsharded) model and optimizer state dicts on CPU, keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # cpu_offload=True would keep the result on rank 0 only; every rank compares here.
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    to_cpu = lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
    msd = {k: to_cpu(v) for k, v in msd.items()}
    osd = {"state": {k: {n: to_cpu(v) for n, v in s.items()} for k, s in osd["state"].items()},
           "param_groups": osd["param_groups"]}
    return msd, osd


def _fully_shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def rank_fsdp2_vs_ddp(tied: bool, ckpt_dir: str) -> dict:
    """20 AdamW steps under DDP and under FSDP2 (``fully_shard`` per block and root on
    ``init_device_mesh("flagos", (n,))``) from the same initial parameters and batches; the
    FSDP2 run saves model and optimizer with DCP after step 10 and continues in a *new*
    model and optimizer (different initial parameters) loaded from the checkpoint. Compares
    per-step losses, gradient norms and the final full state dicts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = setup_device()

    model = _decoder(tied, seed=7).to(dev)
    if tied and model.head.weight is not model.tok.weight:
        raise AssertionError("tying lost by .to()")
    ddp = DDP(model, device_ids=[rank])
    opt = _adamw(ddp)
    ddp_log = [_train_step(ddp, opt, _tokens(s, rank, dev)) for s in range(TF_STEPS)]
    ddp_msd, ddp_osd = _full_state(ddp, opt)
    del ddp, model, opt

    mesh = init_device_mesh("flagos", (n,))
    model = _fully_shard(_decoder(tied, seed=7).to(dev), mesh)
    opt = _adamw(model)
    fsdp_log = [_train_step(model, opt, _tokens(s, rank, dev)) for s in range(TF_CKPT_STEP)]
    for p in model.parameters():
        if not isinstance(p, DTensor) or p.to_local().device != dev:
            raise AssertionError(f"FSDP2 parameter not a flagos DTensor: {type(p).__name__}")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    del model, opt, msd, osd

    model = _fully_shard(_decoder(tied, seed=99).to(dev), mesh)  # other parameters: load must overwrite
    opt = _adamw(model)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    fsdp_log += [_train_step(model, opt, _tokens(s, rank, dev)) for s in range(TF_CKPT_STEP, TF_STEPS)]
    fsdp_msd, fsdp_osd = _full_state(model, opt)

    for step, ((l1, g1), (l2, g2)) in enumerate(zip(ddp_log, fsdp_log)):
        if not (math.isclose(l1, l2, rel_tol=1e-5, abs_tol=1e-5) and math.isclose(g1, g2, rel_tol=1e-5, abs_tol=1e-5)):
            raise AssertionError(f"step {step}: DDP loss/grad norm {l1}/{g1} vs FSDP2 {l2}/{g2}")
    if set(ddp_msd) != set(fsdp_msd):
        raise AssertionError(f"model state keys differ: {sorted(set(ddp_msd) ^ set(fsdp_msd))}")
    initial = _decoder(tied, seed=7).state_dict()
    for key, value in ddp_msd.items():
        if not torch.allclose(fsdp_msd[key], value, **TF_TOL):
            raise AssertionError(f"model {key}: max |DDP - FSDP2| = {(fsdp_msd[key] - value).abs().max()}")
        if torch.equal(value, initial[key]):
            raise AssertionError(f"model {key} did not train")
    _compare_optim(ddp_osd, fsdp_osd)
    margin = {"loss": max(abs(a[0] - b[0]) for a, b in zip(ddp_log, fsdp_log)),
              "grad_norm": max(abs(a[1] - b[1]) for a, b in zip(ddp_log, fsdp_log)),
              "param": max((fsdp_msd[k] - v).abs().max().item() for k, v in ddp_msd.items())}
    return {"losses": [loss for loss, _ in fsdp_log], "grad_norms": [g for _, g in fsdp_log], "max_abs_diff": margin,
            "keys": sorted(ddp_msd), "ckpt_files": sorted(os.listdir(ckpt_dir)) if rank == 0 else None}


def _compare_optim(a: dict, b: dict) -> None:
    """Full optimizer state dicts (``state`` keyed by parameter name) agree within TF_TOL."""
    if set(a["state"]) != set(b["state"]):
        raise AssertionError(f"optimizer state keys differ: {sorted(set(a['state']) ^ set(b['state']))}")
    for name, sa in a["state"].items():
        for key, va in sa.items():
            vb = b["state"][name][key]
            if not torch.allclose(torch.as_tensor(vb).double(), torch.as_tensor(va).double(), **TF_TOL):
                raise AssertionError(f"optimizer {name}.{key}: DDP {va} vs FSDP2 {vb}")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fsdp2_matches_ddp_with_dcp_round_trip(flagos_world, tied, tmp_path):
    results = flagos_world(2).run(rank_fsdp2_vs_ddp, tied, str(tmp_path / "ckpt"), timeout=CALL_TIMEOUT_S)
    losses = results[0]["losses"]
    assert len(losses) == TF_STEPS and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses  # it trained
    assert results[0]["keys"] == results[1]["keys"]
    assert ("head.weight" in results[0]["keys"]) and ("tok.weight" in results[0]["keys"])
    assert any(f.endswith(".distcp") for f in results[0]["ckpt_files"]), results[0]["ckpt_files"]
