"""The collectives layer: every collective written once.

:class:`Collectives` is the base of :class:`~flagos_shm.backend.group.ShmGroup`, to which the
c10d adapter (:mod:`flagos_shm.backend.adapter`) forwards every call. Each family is one
module, as gloo keeps one algorithm per file:

* :mod:`.base`: group state, ordering of calls, validation, the inline/async path;
* :mod:`.reduction`: allreduce (and coalesced), reduce, reduce-scatter (three forms);
* :mod:`.sparse`: allreduce of sparse COO tensors (SUM), as Gloo does it (under
  :mod:`.reduction`, whose allreduce hands it sparse tensors);
* :mod:`.allgather`: allgather (four forms) and gather;
* :mod:`.broadcast`: broadcast and scatter;
* :mod:`.alltoall`: all_to_all_single and alltoall;
* :mod:`.barrier`: barrier and monitored_barrier;
* :mod:`.p2p`: send, recv and recv_anysource (per-pair channels, their own worker threads).

Method names and arguments follow ``torch._C._distributed_c10d.Backend`` (torch 2.13
spellings; the C++ adapter maps the names each torch uses onto them).
"""

from __future__ import annotations

from .allgather import Gathering
from .alltoall import AllToAll
from .barrier import Barrier
from .base import CollectiveBase
from .broadcast import OneToAll
from .p2p import PointToPoint
from .reduction import Reduction

__all__ = ["Collectives", "CollectiveBase"]


class Collectives(PointToPoint, Reduction, Gathering, OneToAll, AllToAll, Barrier):
    """Every flagos_shm collective (see the module docstring); set up with ``_setup``."""
