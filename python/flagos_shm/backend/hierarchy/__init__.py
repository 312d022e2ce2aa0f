"""Groups that span nodes: shared memory inside each node, Gloo between the nodes.

When :func:`~flagos_shm.backend.rendezvous.rendezvous` finds a group on several nodes,
:meth:`CollectiveBase._setup` gives the group a :class:`HierarchicalComm` instead of a core
``Communicator``. It has the core communicator's interface (raw host addresses, element
counts, core dtype names, the ``done`` callback of asynchronous calls), so the collectives
layer, its argument checks and its staging (device tensors are staged to host memory once;
every inter-node step works on that host buffer) serve both kinds of group unchanged.

What it holds:

* a core ``Communicator`` over the ranks of this rank's node (its segment comes from the
  rendezvous, through the group's store);
* on each node's leader (its lowest group rank), a ``ProcessGroupGloo`` over the leaders,
  made directly on the group's store under a private prefix;
* a ``ProcessGroupGloo`` over all ranks, made on first use with Gloo's lazy connections
  (all_to_all, and point-to-point between nodes: :mod:`.p2p`);
* on nodes of equal size, a ``ProcessGroupGloo`` per local rank index, made on first use
  (the reduce-scatter path of large allreduces: :mod:`.rs`).

Algorithms (``L`` = in-node step through shared memory, ``G`` = among the leaders):

* allreduce: L reduce to the leader, G allgather of the leaders' partial results, each
  leader combines them in node order (so every leader computes the same bits), L broadcast.
  float16/bfloat16 are reduced in float32 and rounded once at the end; integer AVG sums in
  int64 and divides rounding toward zero; AVG divides by the group size; PREMUL_SUM scales
  in the node step: the core's rules (see ``rust/reduce/mod.rs``), applied per level. Results
  are bitwise identical on every rank; they may differ in the last bit from the one-node
  order (ranks are combined node by node). From ``FLAGOS_SHM_HIER_RS_MIN_BYTES`` on nodes of
  equal size: L reduce-scatter, Gloo among the ranks of each local rank, L allgather
  (:mod:`.rs`, which also states the order of each path).
* broadcast: L broadcast on the root's node, G broadcast from its leader, L broadcast on
  the others. barrier: L barrier, G exchange, L barrier.
* allgather: L gather to the leader, G allgather (padded to the largest node), L broadcast.
* reduce, reduce-scatter: an allreduce of a scratch copy, each rank keeping its part;
  gather: an allgather; scatter: a broadcast of the root's whole input.
* alltoall: the all-ranks Gloo group; alltoallv (uneven) and coalesced batches:
  :mod:`.alltoallv_coalesced`.

Before the data of every call the leaders exchange a small descriptor (kind, element count,
dtype, op, root) and a failure flag: ranks that disagree raise ``ValueError`` on every rank
(the group stays usable), as on one node. Any other failure (a dead rank, a timeout, an
abort) aborts the whole group: this rank's node communicator and its Gloo groups are torn
down, which makes the other nodes' Gloo calls fail at once and them abort theirs, so every
rank raises within the group's timeout. The Gloo groups are destroyed with the group.

The files, from the bottom up:

* ``host.py``: host views of the core's raw buffers, op codes, the reduction rules per level;
* ``worker.py``: the call queue (one call at a time, in issue order);
* ``groups.py``: the Gloo sub-groups (leaders, all ranks, columns): making and tearing
  them down, and the options every Gloo call takes;
* ``protocol.py``: each call's phases, the descriptor exchange, the abort-on-failure shape;
* ``algorithms.py``: the collectives (the algorithms above);
* ``rs.py``: the reduce-scatter allreduce; ``alltoallv_coalesced.py``: alltoallv and
  coalesced batches; ``p2p.py``: point-to-point between nodes;
* ``comm.py``: :class:`HierarchicalComm` (group state, lifetime, dispatch).
"""

from .comm import HierarchicalComm

__all__ = ["HierarchicalComm"]
