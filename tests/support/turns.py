"""Ranks taking turns through the default group's store, in rank-side test code: one rank
says "go" when it has done its step, the other waits for that before its own. Orders two
ranks' steps without a sleep that a loaded machine can outlast (issue 27)."""

from __future__ import annotations

import datetime


def let_go(key: str) -> None:
    """Set ``key`` in the default group's store: the rank waiting in :func:`wait_for_go` goes on."""
    import torch.distributed as dist

    dist.distributed_c10d._get_default_store().set(key, "1")


def wait_for_go(key: str, timeout_s: float = 60.0) -> None:
    """Wait until another rank has called :func:`let_go` with ``key`` (at most ``timeout_s``
    seconds, whatever the store's own timeout; then the store raises), and remove the key so
    that a pool's next call starts clean."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.wait([key], datetime.timedelta(seconds=timeout_s))
    store.delete_key(key)
