"""The staging copies into a caller's tensors bump its autograd version counter, as
``Tensor.copy_`` does, whatever the size: the list forms (``all_gather``/``all_to_all``
into a list, whose pieces are copied out by ``staging.split_into``/``unpack``) used to
bump it for small tensors (torch's copy) but not from ``staging._TORCH_GRAIN`` elements on
(the core's memmove), so a tensor saved for backward and then overwritten by a large
collective gave a wrong gradient instead of autograd's "modified by an inplace operation"
error (what Gloo, which copies with torch, raises)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.timeout(120)


def overwritten_after_forward(numel: int) -> dict:
    """Rank 0 saves ``x`` for backward, then receives rank 1's piece of an ``all_gather``
    list into it; and the versions of every output of the list forms."""
    rank, n = dist.get_rank(), dist.get_world_size()
    w = torch.ones(numel, requires_grad=True)
    x = torch.full((numel,), 2.0)
    y = (w * x).sum()  # backward needs x as it was: 2.0
    outs = [torch.zeros(numel) for _ in range(n)]
    if rank == 0:
        outs[1] = x
    dist.all_gather(outs, torch.full((numel,), 5.0 + rank))
    try:
        y.backward()
        backward = f"ran, grad {w.grad[0].item()}"
    except RuntimeError as exc:
        backward = "raised" if "modified by an inplace operation" in str(exc) else str(exc)
    lists = [torch.zeros(numel) for _ in range(n)]
    dist.all_to_all(lists, [torch.ones(numel) for _ in range(n)])
    return {"backward": backward, "all_gather": [t._version for t in outs if t is not x],
            "all_to_all": [t._version for t in lists]}


@pytest.mark.parametrize("numel", [100, 40_000])  # below and above staging._TORCH_GRAIN (32768)
def test_list_outputs_get_a_new_version(worlds, backend, numel):
    results = worlds(2).run(overwritten_after_forward, numel)
    assert results[0]["backward"] == "raised", results
    assert results[1]["backward"] == "ran, grad 2.0", results
    for r in results:
        assert all(v >= 1 for v in r["all_gather"] + r["all_to_all"]), results
