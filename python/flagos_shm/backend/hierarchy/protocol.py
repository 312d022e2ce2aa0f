"""What every call of a :class:`~flagos_shm.backend.hierarchy.HierarchicalComm` runs around
its data: the phases (node step, leaders' step, node step), the descriptor the leaders
exchange first, and the failure shape.

Before the data of every call the leaders (or, for all-to-all, all ranks) allgather a small
descriptor ``(failed, kind, element count, dtype, op, root, factor)`` (factor: PREMUL_SUM's,
:func:`factor_code`; 0 otherwise): ranks that disagree, or a peer that rejected its
arguments, make every rank raise ``ValueError`` and the group stays usable. Any other
failure aborts the group (:func:`aborting`).
"""

from __future__ import annotations

import contextlib
import struct

import torch

from ... import _core
from .. import options
from . import groups

#: Descriptor codes of dtypes and kinds: the core's (``_core.DTYPE_CODES``, ``_core.KINDS``),
#: then this layer's own kinds after them (*_rs: the path of :mod:`.rs`).
_DTYPE_CODE = dict(_core.DTYPE_CODES)
_KIND_CODE = {**_core.KINDS, **{k: max(_core.KINDS.values()) + 1 + i
                                for i, k in enumerate(("allreduce_rs", "reduce_rs", "reduce_scatter_rs"))}}
_KIND_NAME = {code: name for name, code in _KIND_CODE.items()}
_ALLTOALL_NAMES = ("alltoall", "all_to_all_single", "alltoall_base", "alltoallv")
_HEADER = 6  # fields of a descriptor after the failure flag (kind, count, dtype, op, root, factor)


def _kind_name(code: int) -> str:
    """The name of descriptor kind ``code`` (its number when it is none of :data:`_KIND_CODE`)."""
    return _KIND_NAME.get(code, str(code))


def factor_code(op: int, factor: float) -> int:
    """The descriptor's factor field: PREMUL_SUM's factor as the int64 of its float64 bits
    (so that nodes that scale by different factors disagree, as ranks of one node do in
    the core), 0 for every other op."""
    return struct.unpack("<q", struct.pack("<d", float(factor)))[0] if op == options.PREMUL_SUM else 0


def _factor(code: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(code)))[0]


@contextlib.contextmanager
def aborting(comm):
    """Run the block; a ``ValueError`` (ranks disagree: every rank raises it, the group stays
    usable) passes through, any other error (a dead rank, a timeout, Gloo failing, an
    interrupt) first aborts ``comm``'s whole group on this rank, then propagates."""
    try:
        yield
    except ValueError:
        raise
    except BaseException as exc:
        comm.abort(f"{type(exc).__name__}: {exc}")
        raise


class Protocol:
    """Mixin of :class:`~flagos_shm.backend.hierarchy.HierarchicalComm`: the descriptor
    exchange and the phases of one call (module docstring)."""

    def _exchange(self, header: tuple, timeout_s: float, failed: bool = False, group: str = "leaders") -> None:
        """Allgather ``(failed, *header)`` among the leaders (or all ranks), ``header``
        padded with zeros to :data:`_HEADER` fields; ValueError if a peer failed the call or
        the headers differ (not when ``failed``: the caller raises its own error)."""
        mine = torch.tensor([int(failed), *header, *[0] * (_HEADER - len(header))], dtype=torch.int64)
        rows = groups.allgather_rows(self._gloo(group), mine, timeout_s)
        if failed:
            return
        who = (lambda k: f"node {k} (group ranks {self._nodes[k]})") if group == "leaders" else \
            (lambda k: f"group rank {k}")
        bad = [k for k in range(rows.shape[0]) if rows[k, 0]]
        if bad:
            raise ValueError(f"flagos_shm {_kind_name(header[0])}: {', '.join(map(who, bad))} rejected the call "
                             "(a rank there failed it; see its error)")
        differ = [k for k in range(rows.shape[0]) if not bool((rows[k, 1:] == mine[1:]).all())]
        if differ:
            calls = "; ".join(f"{who(k)}: {self._describe(rows[k, 1:].tolist())}" for k in range(rows.shape[0]))
            me = self._node_of[self._rank] if group == "leaders" else self._rank
            raise options.disagreement(f"flagos_shm: ranks disagree on the collective (kind, element count, dtype, "
                                       f"op, PREMUL_SUM factor, root): {calls}", "calls", me, differ[0],
                                       _kind_name(header[0]), _kind_name(int(rows[differ[0], 1])))

    @staticmethod
    def _describe(h: list) -> str:
        kind = _kind_name(h[0])
        dtype = next((n for n, c in _DTYPE_CODE.items() if c == h[2]), h[2])
        if kind == "alltoall":  # element count -1: per-peer counts (alltoallv), exchanged next
            return (f"alltoallv({dtype}, per-peer counts: split sizes or tensor lists)" if h[1] == -1 else
                    f"alltoall({h[1]} x {dtype} to each rank: no split sizes)")
        op = options.OP_NAMES[h[3]] if 0 <= h[3] < 9 else h[3]
        if h[3] == options.PREMUL_SUM and len(h) > 5:
            op = f"{op} factor {_factor(h[5])!r}"
        return f"{kind}({h[1]} x {dtype}, op {op}, root {h[4]})"

    def _allgather_rows(self, t: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """Gloo allgather of ``t`` (1-D, contiguous) among the leaders: [n_nodes, numel]."""
        return groups.allgather_rows(self._gloo("leaders"), t, timeout_s)

    def _phases(self, header: tuple, timeout_s: float, pre, inter, post) -> None:
        """Run one call: the node step ``pre``, on the leaders the descriptor exchange and
        ``inter``, the node step ``post`` (each may be None). Disagreement (ValueError) is
        passed on so that every rank raises it and the group stays usable; any other error
        aborts the group (:func:`aborting`)."""
        pre, post = self._in_node(pre), self._in_node(post)
        with aborting(self):
            if pre is not None:
                try:
                    pre()
                except ValueError:
                    if self.leader:
                        self._exchange(header, timeout_s, failed=True)
                    raise
            if self.leader:
                try:
                    self._exchange(header, timeout_s)
                    if inter is not None:
                        inter()
                except ValueError:
                    if post is not None:
                        self.local.fail(_kind_name(header[0]), "", timeout_s)
                    raise
                except RuntimeError as exc:
                    raise options.with_context(exc, f"between the node leaders (Gloo; another node failed, or its "
                                                    f"leader exited or was aborted): {exc}") from exc
            if post is not None:
                post()

    def _in_node(self, step):
        """``step`` with its errors naming the node (the core numbers a node's ranks 0, 1, ...)."""
        if step is None:
            return None
        members = self._nodes[self._layout.node]

        def run() -> None:
            try:
                step()
            except Exception as exc:
                raise options.with_context(exc, f"{exc} (in node {self._layout.node}, whose ranks "
                                                f"0..{len(members) - 1} are group ranks {members})") from exc
        return run
