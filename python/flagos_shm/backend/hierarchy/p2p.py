"""Point-to-point between ranks on different nodes of a group: Gloo, with the shared-memory
path's semantics.

:mod:`flagos_shm.backend.collectives.p2p` sends to a peer on this rank's node through a
shared-memory channel; to a peer on another node of a :class:`~flagos_shm.backend.hierarchy.HierarchicalComm`
group it calls :func:`send` / :func:`recv` here, over the group's all-ranks
``ProcessGroupGloo`` (ranks = group ranks, made with Gloo's lazy connection set-up so that
only the pairs that talk connect: see :func:`.groups.make_all`).

One message of ``N`` bytes with user tag ``t`` is three Gloo messages on that pair:

1. sender -> receiver, Gloo tag ``t + HEADER_TAG``: ``[N]`` (int64);
2. sender -> receiver, Gloo tag ``t``: the ``N`` bytes (skipped when ``N == 0``);
3. receiver -> sender, Gloo tag ``t + ACK_TAG``: ``[1 or 0, M]``, M the receive's bytes.

So, as on one node: a send completes when the matching receive has taken the message; a
receive of another size raises ``ValueError`` on **both** ranks (the receiver drains the
message, so the pair stays usable); messages are delivered in order per (source,
destination, tag) (Gloo matches per pair and tag in posting order, and the caller runs one
worker per (peer, direction, tag)), and a receive for one tag never waits behind a message
of another. User tags must lie in ``[0, TAG_LIMIT)``. A dead peer (its connection closes),
an aborted group or the timeout raise ``RuntimeError`` naming the peer; a transfer cut off
half-way leaves that (peer, tag) unusable.
"""

from __future__ import annotations

import ctypes
import time
from datetime import timedelta

import torch

__all__ = ["TAG_LIMIT", "byte_view", "check_tag", "send", "recv"]

#: Cross-node user tags are in [0, TAG_LIMIT): Gloo tags are 31-bit, and each message uses
#: two more tags (its header and its acknowledgement) above the user's.
TAG_LIMIT = 1 << 29
HEADER_TAG = 1 << 29
ACK_TAG = 1 << 30


def byte_view(ptr: int, nbytes: int) -> torch.Tensor:
    """A 1-D uint8 tensor over the ``nbytes`` bytes of host memory at ``ptr`` (no copy; the
    caller keeps the memory alive)."""
    if nbytes == 0 or ptr == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=torch.uint8)


def check_tag(tag: int, peer_name: str) -> int:
    """``tag`` as an int, checked for a cross-node message.

    Raises:
        ValueError: ``tag`` is outside ``[0, TAG_LIMIT)``.
    """
    tag = int(tag)
    if not 0 <= tag < TAG_LIMIT:
        raise ValueError(f"tag: {tag} is outside [0, 2**29), the tags of messages between nodes "
                         f"(to or from {peer_name})")
    return tag


def _wait(works: list, deadline: float, what: str) -> None:
    for w in works:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{what}: the group's timeout passed")
        try:
            w.wait(timedelta(seconds=left))
        except RuntimeError as exc:
            raise RuntimeError(f"{what} (Gloo, between nodes; the peer exited, failed or was aborted, or "
                               f"the timeout passed): {exc}") from exc


def send(pg, peer: int, peer_name: str, data: torch.Tensor, tag: int, deadline: float) -> None:
    """Send the bytes of ``data`` (1-D uint8, contiguous, host memory) to group rank
    ``peer`` of ``pg`` with user ``tag``; return once its receive has taken them.

    Raises:
        ValueError: the receive there is of another size (it raises too).
        RuntimeError: Gloo failed (dead peer, abort) or ``deadline`` (``time.monotonic()``) passed.
    """
    what = f"send of {data.numel()} bytes (tag {tag}) to {peer_name}"
    header = torch.tensor([data.numel()], dtype=torch.int64)
    ack = torch.zeros(2, dtype=torch.int64)
    try:
        works = [pg.send([header], peer, tag + HEADER_TAG)]
        if data.numel():
            works.append(pg.send([data], peer, tag))
        works.append(pg.recv([ack], peer, tag + ACK_TAG))
    except RuntimeError as exc:
        raise RuntimeError(f"{what} (Gloo, between nodes): {exc}") from exc
    _wait(works, deadline, what)
    if int(ack[0]) != 1:
        raise ValueError(f"{what}: the matching receive there expects {int(ack[1])} bytes (sizes must match; "
                         "the receiver raised too)")


def recv(pg, peer: int, peer_name: str, data: torch.Tensor, tag: int, deadline: float) -> None:
    """Receive the next message with user ``tag`` from group rank ``peer`` of ``pg`` into
    ``data`` (1-D uint8, contiguous, host memory; exactly the message's size).

    Raises:
        ValueError: the message has another size (drained; the sender raises too).
        RuntimeError: as :func:`send`.
    """
    what = f"receive of {data.numel()} bytes (tag {tag}) from {peer_name}"
    header = torch.zeros(1, dtype=torch.int64)
    try:
        _wait([pg.recv([header], peer, tag + HEADER_TAG)], deadline, what)
        size = int(header[0])
        into = data if size == data.numel() else torch.empty(size, dtype=torch.uint8)
        if size:
            _wait([pg.recv([into], peer, tag)], deadline, what)
        ack = torch.tensor([int(into is data), data.numel()], dtype=torch.int64)
        _wait([pg.send([ack], peer, tag + ACK_TAG)], deadline, what)
    except RuntimeError as exc:
        if what in str(exc):
            raise
        raise RuntimeError(f"{what} (Gloo, between nodes): {exc}") from exc
    if into is not data:
        raise ValueError(f"{what}: the message has {size} bytes (sizes must match; the sender raised too)")
