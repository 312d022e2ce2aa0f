"""The collectives layer both c10d adapters share: every collective written once.

:class:`Collectives` is a mixin: :class:`~flagos_shm.backend.process_group.ProcessGroupShm`
puts it in front of ``dist.ProcessGroup`` (torch < 2.14) and
:class:`~flagos_shm.backend.per_device.ShmBackend` in front of ``c10d.Backend`` (torch >=
2.14). Each family is one module, as gloo keeps one algorithm per file:

* :mod:`.base`: group state, ordering of calls, validation, the inline/async path;
* :mod:`.reduction`: allreduce (and coalesced), reduce, reduce-scatter (three forms);
* :mod:`.sparse`: allreduce of sparse COO tensors (SUM), as Gloo does it;
* :mod:`.allgather`: allgather (four forms) and gather;
* :mod:`.broadcast`: broadcast and scatter;
* :mod:`.alltoall`: all_to_all_single and alltoall;
* :mod:`.barrier`: barrier and monitored_barrier;
* :mod:`.p2p`: send, recv and recv_anysource (per-pair channels, their own worker threads).

Method names and arguments follow ``torch._C._distributed_c10d.ProcessGroup`` /
``Backend`` (torch 2.13 spellings; the ProcessGroup adapter adds the older aliases).
"""

from __future__ import annotations

from .allgather import Gathering
from .alltoall import AllToAll
from .barrier import Barrier
from .base import CollectiveBase
from .broadcast import OneToAll
from .p2p import PointToPoint
from .reduction import Reduction
from .sparse import SparseReduction

__all__ = ["Collectives", "CollectiveBase"]


class Collectives(PointToPoint, SparseReduction, Reduction, Gathering, OneToAll, AllToAll, Barrier):
    """Every flagos_shm collective (see the module docstring); set up with ``_setup``."""
