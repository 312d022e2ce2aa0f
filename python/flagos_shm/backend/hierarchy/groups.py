"""The Gloo sub-groups of a :class:`~flagos_shm.backend.hierarchy.HierarchicalComm`: made on
the group's store under private prefixes of the rendezvous base (``layout.base``), torn
down with the group, and the options every Gloo call takes.

* ``gloo-leaders``: the node leaders (rank = node index), made when the group is made,
  once every node has attached (:func:`connect_leaders`);
* ``gloo-all``: every rank (rank = group rank), made on first use with Gloo's lazy
  connections (:func:`make_all`);
* ``gloo-col/<j>``: the ranks of local rank ``j``, one per node (rank = node index), made on
  first use by the reduce-scatter path (:func:`make_column`; :mod:`.rs`).

A Gloo group lives as long as anything holds it, and with it its threads (Gloo's
``pt_gloo_runloop`` workers, its device's ``gloo_tcp_loop``). An error out of a Gloo call
holds it through its traceback (the frames of the failed call keep their locals), often
in a reference cycle that only Python's garbage collector frees: at an arbitrary later
moment on an arbitrary thread, or during the interpreter's finalization, where a rank
whose peer had died once aborted (``terminate called without an active exception``).
:func:`forget_locals` (:func:`forgetting_locals` around a block) cuts that hold, so that
closing or aborting the group frees its Gloo groups there and then.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, BroadcastOptions, ProcessGroupGloo

from ... import staging
from .. import rendezvous

_GLOO_LAZY = "TORCH_GLOO_LAZY_INIT"


def connect_leaders(store: dist.Store, layout, timeout_s: float) -> ProcessGroupGloo:
    """On a node leader: wait until every node has attached (Gloo's own connect would wait
    for a leader that gave up until the store's timeout), then make the leaders' group.

    Raises:
        RuntimeError: a node did not attach within ``timeout_s`` seconds (or its leader, on
            this machine, exited), or Gloo failed.
    """
    base = layout.base
    store.set(f"{base}/leader-ready/{layout.node}", "1")
    # the other leaders on this machine (one alone on its node has no node mate to notice
    # that it exited)
    watched = rendezvous.watchable(layout, layout.nodes[layout.node][0], [m[0] for m in layout.nodes])
    rendezvous.wait_keys(store, [f"{base}/leader-ready/{k}" for k in range(len(layout.nodes))],
                         time.monotonic() + timeout_s, "waiting for every node to attach",
                         lambda: watched, base)
    return ProcessGroupGloo(dist.PrefixStore(f"{base}/gloo-leaders", store), layout.node,
                            len(layout.nodes), timedelta(seconds=timeout_s))


def make_all(store: dist.Store, base: str, rank: int, world_size: int, timeout_s: float) -> ProcessGroupGloo:
    """The all-ranks group. Gloo's lazy set-up (``TORCH_GLOO_LAZY_INIT``, read when a group
    is made) connects a pair when it first talks, so two ranks that only exchange messages
    need no one else. The caller serializes (the variable is process-wide)."""
    saved = os.environ.get(_GLOO_LAZY)
    os.environ[_GLOO_LAZY] = "1"
    try:
        return ProcessGroupGloo(dist.PrefixStore(f"{base}/gloo-all", store), rank, world_size,
                                timedelta(seconds=timeout_s))
    finally:
        if saved is None:
            os.environ.pop(_GLOO_LAZY, None)
        else:
            os.environ[_GLOO_LAZY] = saved


def make_column(store: dist.Store, base: str, j: int, node: int, n_nodes: int, timeout_s: float) -> ProcessGroupGloo:
    """The group of the ranks of local rank ``j`` (one per node, ranked by node)."""
    return ProcessGroupGloo(dist.PrefixStore(f"{base}/gloo-col/{j}", store), node, n_nodes,
                            timedelta(seconds=timeout_s))


def release(groups: Iterable, abort: bool) -> None:
    """Abort (``abort``: the peers' calls on them then fail at once) or shut down each group
    that is not None; best effort (dropping a group closes its connections)."""
    for pg in groups:
        if pg is not None:
            try:
                pg.abort() if abort else pg.shutdown()
            except Exception:  # noqa: BLE001  best effort: dropping it closes its connections
                pass


def forget_locals(exc: BaseException, spare: Optional[BaseException] = None) -> None:
    """Clear the local variables of the finished frames in ``exc``'s traceback and in those
    of the exceptions it was raised from or during (``__cause__``, ``__context__``), so that
    the error keeps no Gloo group, tensor or buffer of the failed call alive (module
    docstring). Frames still executing (the caller's) keep theirs, and so does ``spare``
    and every exception in its own chain (an error the caller was already handling when
    it made the call: not the call's to clear); the traceback's file and line information
    stays."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or e is spare or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


@contextlib.contextmanager
def forgetting_locals():
    """Run the block; an error leaving it first loses its finished frames' locals
    (:func:`forget_locals`), sparing the error the calling thread was handling when the
    block began (a collective called inside the user's ``except`` block)."""
    handling = sys.exc_info()[1]
    try:
        yield
    except BaseException as exc:
        forget_locals(exc, spare=handling)
        raise


def timed(opts_type, timeout_s: float):
    """An options object of ``opts_type`` (``AllgatherOptions``...) with ``timeout_s`` seconds."""
    opts = opts_type()
    opts.timeout = timedelta(seconds=timeout_s)
    return opts


def allgather_rows(pg: ProcessGroupGloo, t: torch.Tensor, timeout_s: float) -> torch.Tensor:
    """Gloo allgather of ``t`` (1-D, contiguous) over ``pg``: ``[pg.size(), numel]`` of ``t.dtype``.

    From :data:`staging._TORCH_GRAIN` bytes on, one Gloo broadcast per rank, each straight
    into its row of the result (this rank's own row copied on this thread,
    :func:`staging.copy_into`), instead of Gloo's allgather, which unflattens its result
    with a torch copy per rank (``ProcessGroupGloo``'s ``AsyncAllgatherWork``) that for that
    many elements runs on torch's intra-op thread pool. The same bytes reach every rank;
    on the 2-vCPU VM over loopback the broadcasts were also the faster (docs/benchmark.md,
    "torch's copy threads"). Which one runs depends only on the size, which the ranks
    agree on.
    """
    flat = t.reshape(-1).view(torch.uint8)
    m, nb = pg.size(), flat.numel()
    out = torch.empty(m * nb, dtype=torch.uint8)
    if nb >= staging._TORCH_GRAIN and m > 1:
        me = pg.rank()
        staging.copy_into(out[me * nb:(me + 1) * nb], flat)
        for k in range(m):  # in rank order on every rank
            opts = timed(BroadcastOptions, timeout_s)
            opts.rootRank, opts.rootTensor = k, 0
            pg.broadcast([out[k * nb:(k + 1) * nb]], opts).wait()
    else:
        pg._allgather_base(out, flat, timed(AllgatherOptions, timeout_s)).wait()
    return out.view(t.dtype).view(m, -1)
