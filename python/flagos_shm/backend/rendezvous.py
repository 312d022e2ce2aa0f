"""Rendezvous: how the ranks of a new group find out which nodes they are on and meet in
one shared-memory segment per node.

1. Every rank publishes, in one store key, its process id and its identity: host name,
   ``/proc/sys/kernel/random/boot_id``, the inodes of its IPC and PID namespaces, and
   ``FLAGOS_SHM_NODE_ID`` when set. It then waits for every rank's key, watching the
   processes already published (those in its own PID namespace), so that a rank that
   exits is noticed within milliseconds.
2. Ranks with equal node keys (``FLAGOS_SHM_NODE_ID``, else host name + boot id + IPC
   namespace) are candidates for one node. The first of each (its leader) creates the
   node's segment (``flagos_shm._core.create_segment``) and publishes its path; the others
   open that file (the probe) and publish whether they could, and why not. A rank that
   cannot open it has another ``/dev/shm`` (another mount namespace or container): without
   ``FLAGOS_SHM_NODE_ID`` it is on another node, and the probe repeats among such ranks;
   with ``FLAGOS_SHM_NODE_ID`` every rank raises at once, naming it and the cause.
3. Ranks of one node must share a PID namespace (the core tells peers' liveness by process
   id and reads their memory by process id): where they do not, every rank raises at once,
   naming them.

The result is a :class:`Layout`. On one node (the usual case) it is today's single segment
for the whole group, to which :func:`attach` attaches this rank's
``flagos_shm._core.Communicator``, given every rank's process id (so a
rank that exits before attaching is noticed at once there too). On several nodes
:mod:`flagos_shm.backend.hierarchy` builds on it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Callable, Optional

import torch.distributed as dist

from .. import _core, config
from ..config import segment_config

__all__ = ["Layout", "SetupError", "attach", "give_up", "identity", "leave_together", "publish_pid", "rendezvous"]

_log = logging.getLogger("flagos_shm")

_STORE_COUNTER = "flagos_shm/rendezvous"
_STORE_ERROR = "error:"
_OK = "ok"

_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.01  # store polling while a group is set up: 1 ms, backing off to 10 ms
_SETTLE_S = 0.05  # a key missing after a watched process exited is looked for again this much later (published)
#: A rank whose set-up failed waits at most this long (seconds) for its peers to be done
#: with the store before it raises (:func:`leave_together`).
LEAVE_WAIT_S = 2.0


class SetupError(RuntimeError):
    """Setting up a group failed on this rank for a reason every rank learns through the
    store (a peer that cannot open its node's segment, ranks of one node in different PID
    namespaces): raised alike on every rank."""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _ns_inode(name: str) -> int:
    try:
        return os.stat(f"/proc/self/ns/{name}").st_ino
    except OSError:
        return 0


def identity() -> dict:
    """This process's identity as published at set-up: ``pid``, ``host`` (host name),
    ``boot`` (boot id), ``ipc`` and ``pidns`` (namespace inodes, 0 where unknown) and
    ``node`` (``FLAGOS_SHM_NODE_ID``, ``""`` when unset)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"),
            "ipc": _ns_inode("ipc"), "pidns": _ns_inode("pid"), "node": config.node_id()}


def _node_key(peer: dict) -> str:
    return f"id:{peer['node']}" if peer.get("node") else f"{peer.get('host')}/{peer.get('boot')}/ipc:{peer.get('ipc')}"


def _pid_space(peer: dict) -> tuple:
    """Peers whose process ids mean the same processes: one kernel, one PID namespace."""
    return peer.get("boot"), peer.get("pidns")


def _describe(peer: dict) -> str:
    return (f"host {peer.get('host')!r}, pid {peer.get('pid')}, PID namespace {peer.get('pidns')}"
            + (f", FLAGOS_SHM_NODE_ID={peer['node']!r}" if peer.get("node") else ""))


def describe_layout(layout: "Layout") -> str:
    """One line naming every node of ``layout``: its group ranks and host (and
    ``FLAGOS_SHM_NODE_ID`` where set), e.g. ``2 nodes: node 0 = ranks [0, 1] on 'hostA';
    node 1 = ranks [2, 3] on 'hostB'`` (what the set-up log line shows)."""
    parts = []
    for k, members in enumerate(layout.nodes):
        peer = layout.peers[members[0]]
        where = f"on {peer.get('host')!r}" + (f" (FLAGOS_SHM_NODE_ID={peer['node']!r})" if peer.get("node") else "")
        parts.append(f"node {k} = ranks {members} {where}")
    return f"{len(layout.nodes)} node{'s' if len(layout.nodes) > 1 else ''}: " + "; ".join(parts)


def _store_wait(store: dist.Store, keys, deadline: float, what: str, watch: Callable[[], dict],
                failure: Optional[str] = None) -> None:
    """Wait until every key of ``keys`` is in ``store``, polling, at most until ``deadline``.

    ``watch()`` returns the ranks whose processes must stay alive meanwhile (rank -> pid);
    one that exits fails the wait at once instead of at the deadline. It is called again
    at every poll, so ranks that publish their process id while this waits are watched
    from then on. ``failure``: a key under which any rank that gave up setting the group
    up says why (:func:`publish_failure`); its appearance fails the wait at once too.

    Raises:
        RuntimeError: a watched rank exited, a rank gave up, or the deadline passed (each
            names ``what``).
    """
    keys = [keys] if isinstance(keys, str) else list(keys)
    pause = _POLL_FIRST_S
    while keys and not store.check(keys):
        if failure is not None and store.check([failure]):
            raise RuntimeError(f"{what}: {_get_all(store, [failure])[0]}")
        gone = [f"group rank {r} (pid {pid})" for r, pid in watch().items() if _core.process_exited(pid)]
        if gone and not published(store, keys):
            raise RuntimeError(f"{what}: {', '.join(gone)} exited")
        left = deadline - time.monotonic()
        if left <= 0:
            missing = [k for k in keys if not store.check([k])]
            if not missing:  # they came in since the loop's check: no timeout after all
                return
            raise RuntimeError(f"{what}: not there within the group's timeout (missing {', '.join(missing)})")
        time.sleep(min(pause, left))
        pause = min(2 * pause, _POLL_MAX_S)


def published(store: dist.Store, keys: list, settle_s: float = _SETTLE_S) -> bool:
    """Whether every key of ``keys`` is in ``store``; False if the store cannot be reached.

    For a wait that found a watched process gone: looked at once more *after* that
    finding, the keys tell whether the rank published what was waited for and then exited
    (its keys precede its exit), which is no failure; the wait's own check, made before,
    may predate them. ``TCPStore``'s ``set`` returns without a reply from the server,
    which serves its clients' sockets in no set order, so a key the rank sent just before
    it exited may reach the server after this look: a key still missing is looked for
    once more ``settle_s`` seconds later (0.05 s by default: a death is reported that
    much later; a key still on its way after that is taken for missing). The store may
    have gone with the rank (``TCPStore`` on rank 0): then the exit is what to report."""
    try:
        if store.check(keys):
            return True
        time.sleep(settle_s)
        return bool(store.check(keys))
    except Exception:  # noqa: BLE001  the store went with its host: report the exit
        return False


def wait_keys(store: dist.Store, keys: list, deadline: float, what: str, watch: Callable[[], dict],
              base: str) -> None:
    """:func:`_store_wait` for the later set-up steps of incarnation ``base`` (fails at once
    when a rank has published a failure)."""
    _store_wait(store, keys, deadline, what, watch, failure_key(base))


def _get_all(store: dist.Store, keys: list) -> list:
    if not keys:
        return []
    try:
        values = store.multi_get(keys)
    except (AttributeError, RuntimeError, NotImplementedError):  # an older or a custom store
        values = [store.get(k) for k in keys]
    return [v.decode() if isinstance(v, (bytes, bytearray)) else bytes(v).decode() for v in values]


def publish_pid(store: dist.Store, rank: int, world_size: int) -> str:
    """Join the group's next incarnation in ``store``: publish this process's id and
    identity (:func:`identity`) under it and return the incarnation's key prefix. A counter
    makes the keys unique per group incarnation, so a store reused after
    ``destroy_process_group`` never yields stale ones."""
    incarnation = (store.add(_STORE_COUNTER, 1) - 1) // world_size
    base = f"flagos_shm/{incarnation}"
    store.set(_pid_key(base, rank), json.dumps(identity()))
    return base


def failure_key(base: str) -> str:
    """The store key under which a rank that gave up setting up incarnation ``base`` says why."""
    return f"{base}/failed"


def publish_failure(store: dist.Store, base: str, rank: int, exc: BaseException) -> None:
    """Tell the other ranks, through ``store``, that this rank gave up setting the group up
    (best effort; the first reason published stays)."""
    key = failure_key(base)
    try:
        if not store.check([key]):
            store.set(key, f"group rank {rank} gave up setting up the group ({type(exc).__name__}: {exc})")
    except Exception:  # noqa: BLE001  the store may be gone too; the caller raises its own error
        pass


def watchable(layout: "Layout", rank: int, ranks) -> dict:
    """The process ids (group rank -> pid) of those of ``ranks`` (other than ``rank``)
    whose processes this rank can watch: those in its PID namespace on its kernel (the
    ranks of its node, and those of other nodes that run on the same machine, such as
    nodes simulated with ``FLAGOS_SHM_NODE_ID``). Ranks of other machines are left out:
    their process ids mean nothing here."""
    return _same_pid_space(dict(enumerate(layout.peers)), rank, ranks)


def _same_pid_space(peers: dict, rank: int, ranks=None) -> dict:
    """Of ``peers`` (group rank -> identity, ``rank``'s own among them), the process ids of
    the ranks other than ``rank`` (and in ``ranks``, unless None) that have one and share
    ``rank``'s PID namespace on its kernel."""
    mine = _pid_space(peers[rank])
    return {r: int(p["pid"]) for r, p in peers.items()
            if r != rank and (ranks is None or r in ranks) and int(p.get("pid", 0)) > 0 and _pid_space(p) == mine}


def _pid_key(base: str, rank: int) -> str:
    """The store key under which ``rank`` of incarnation ``base`` publishes its process id."""
    return f"{base}/pid/{rank}"


def _parse_peer(value: str) -> dict:
    try:
        peer = json.loads(value)
    except ValueError:
        peer = None
    if not isinstance(peer, dict):  # a bare process id (an older writer)
        peer = {"pid": int(value)}
    return peer


class _Watch:
    """The process ids of the ranks that share this rank's PID namespace, as far as they
    are published (re-read at every call until all are known), or, for a rank that has
    not published yet, as ``known`` gives it (group rank -> identity: the process that is
    that rank in another live group of this process, :func:`rendezvous`)."""

    def __init__(self, store: dist.Store, base: str, rank: int, world_size: int, me: dict,
                 known: Optional[dict] = None):
        self.store, self.base, self.rank, self.me = store, base, rank, me
        self.peers: dict = {rank: me}
        self.known = {r: p for r, p in (known or {}).items() if r != rank and 0 <= r < world_size}
        self.unknown = [r for r in range(world_size) if r != rank]

    def read(self) -> None:
        if not self.unknown:
            return
        keys = [_pid_key(self.base, r) for r in self.unknown]
        if self.store.check(keys):
            have = list(self.unknown)
        else:
            have = [r for r, k in zip(self.unknown, keys) if len(keys) > 1 and self.store.check([k])]
        for r, value in zip(have, _get_all(self.store, [_pid_key(self.base, r) for r in have])):
            self.peers[r] = _parse_peer(value)
        self.unknown = [r for r in self.unknown if r not in self.peers]

    def __call__(self, ranks: Optional[list] = None) -> dict:
        self.read()
        if self.unknown and self.known:
            return _same_pid_space({**self.known, **self.peers}, self.rank, ranks)
        return _same_pid_space(self.peers, self.rank, ranks)


class Layout:
    """Where the ranks of a group are: its nodes and this rank's node segment.

    Attributes:
        base: the incarnation's store key prefix (keys of later set-up steps go below it).
        peers: every rank's published identity (:func:`identity`), by group rank.
        nodes: the group ranks of each node, ascending; nodes ordered by their first rank.
        node_of: the node index of each group rank.
        node: this rank's node index; ``local_rank``/``local_size``: its place in the node.
        path: this rank's node segment (to attach as ``local_rank`` of ``local_size``).
        pids: process ids of this node's ranks, in local order.
    """

    def __init__(self, base: str, peers: list, nodes: list, rank: int, path: str):
        self.base, self.peers, self.nodes, self.path = base, peers, nodes, path
        self.node_of = [0] * len(peers)
        for k, members in enumerate(nodes):
            for r in members:
                self.node_of[r] = k
        self.node = self.node_of[rank]
        self.local_rank = nodes[self.node].index(rank)
        self.local_size = len(nodes[self.node])
        self.pids = [int(peers[r].get("pid", 0)) for r in nodes[self.node]]

    @property
    def single_node(self) -> bool:
        return len(self.nodes) == 1

    def __repr__(self) -> str:
        return f"Layout(nodes={self.nodes}, path={self.path!r})"


def _remove(path: Optional[str]) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


def _probe(path: str) -> str:
    """Open the node segment at ``path`` as the core will: ``"ok"`` or the cause."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    os.close(fd)
    return _OK


def rendezvous(store: dist.Store, rank: int, world_size: int, timeout_s: float,
               known: Optional[dict] = None) -> Layout:
    """Find the group's nodes and this rank's node segment (see the module docstring).

    Every rank first publishes its process id and identity in the group's store and waits
    for every other rank's, watching the ranks already published for exits; the leader of
    each node (its first rank) creates the node's segment and publishes its path; the other
    ranks of the node open it and publish the outcome. Every rank thus knows, before it
    attaches, every rank's process id (so a rank whose process exits is noticed within
    milliseconds, here and by the core's attach) and whether every peer could open its
    segment. A rank that exits before publishing its id is noticed at once too when
    ``known`` has it (group rank -> identity as :func:`identity` gives it, from another
    group of this process whose members it is: a rank that exited before calling
    ``new_group``); otherwise it is noticed at the timeout. If
    creation fails, the leader publishes an error marker instead of a path and the node's
    other ranks raise ``RuntimeError`` instead of waiting. A rank whose set-up fails
    publishes why, then waits (at most :data:`LEAVE_WAIT_S`) until its peers are done with
    the store too before it raises, so that a store living in it outlasts their reads.

    Raises:
        SetupError: a rank that ``FLAGOS_SHM_NODE_ID`` puts on a node cannot open its
            segment, or ranks of one node do not share a PID namespace (on every rank).
        RuntimeError: a leader could not create its segment, a rank exited, a rank gave
            up (a malformed setting, :func:`give_up`), or the timeout (``timeout_s``,
            seconds) passed.
        ValueError: a malformed setting on this rank
            (:func:`flagos_shm.config.check_group_settings`).
        OSError, ValueError: on a leader, from creating the segment.
    """
    deadline = time.monotonic() + timeout_s
    base = publish_pid(store, rank, world_size)
    try:
        config.check_group_settings(world_size)
        return _find_nodes(store, rank, world_size, base, deadline, known)
    except Exception as exc:
        publish_failure(store, base, rank, exc)
        leave_together(store, base, rank, world_size, deadline, known)
        raise
    except BaseException as exc:  # Ctrl-C and the like: leave at once
        publish_failure(store, base, rank, exc)
        raise


def give_up(store: dist.Store, rank: int, world_size: int, exc: BaseException) -> None:
    """This rank cannot take part in setting up a group (it failed before the rendezvous:
    the c10d adapter cannot be built or loaded, the group's timeout is not positive): join
    the group's incarnation in ``store`` as :func:`rendezvous` does, publish ``exc`` there
    as the reason, so that every other rank raises at once naming it instead of waiting for
    this rank until the timeout, and wait for them as :func:`leave_together` does (at most
    :data:`LEAVE_WAIT_S`). Never raises; the caller raises ``exc``."""
    try:
        base = publish_pid(store, rank, world_size)
    except Exception:  # noqa: BLE001  the store is gone: nothing to tell
        return
    publish_failure(store, base, rank, exc)
    leave_together(store, base, rank, world_size, time.monotonic() + LEAVE_WAIT_S)


def attach(layout, timeout_s: float, where: str):
    """Attach a core ``Communicator`` to this rank's node segment of ``layout``.

    Raises:
        RuntimeError, ValueError: attaching failed (the message names ``where`` and the path).
    """
    path = layout.path
    try:
        return _core.Communicator(path, layout.local_rank, layout.local_size, timeout_s, layout.pids,
                                  **config.core_settings())
    except FileNotFoundError as exc:  # the others removed it: they gave up before we attached
        raise RuntimeError(f"{where}: attaching to {path}: the segment is gone: the other ranks gave up "
                           "setting up the group before this rank attached (a rank exited, or the timeout "
                           f"passed) ({exc})") from exc
    except (RuntimeError, ValueError) as exc:
        raise type(exc)(f"{where}: attaching to {path}: {exc}") from exc


def leave_together(store: dist.Store, base: str, rank: int, world_size: int, deadline: float,
                   known: Optional[dict] = None) -> None:
    """On a failed set-up (here, and in :func:`flagos_shm.backend.plan.setup`): say that
    this rank is done with the store for incarnation ``base``, then wait until every other
    rank has said so, has exited, or :data:`LEAVE_WAIT_S` (never past ``deadline``,
    ``time.monotonic()``) has passed. Never raises.

    The store often lives in one of the ranks (``TCPStore`` on rank 0): a rank that raised
    and exited at once took it along while its peers were still reading why the set-up
    failed (a probe's verdicts, a segment error, the failure key), and they raised
    ``DistNetworkError: Broken pipe`` instead of the cause. Every failing rank reaches this
    point within a poll interval of the first (each wait of the set-up also watches the
    failure key), so the wait is short; exited ranks are not waited for (a rank that never
    published its process id counts as exited when ``known``, as :func:`rendezvous` takes
    it, has its process and that process is gone: before, the others waited the whole
    ``LEAVE_WAIT_S`` for a rank that exited before ``new_group``), and ranks whose
    processes this rank cannot watch (other PID namespaces) at most ``LEAVE_WAIT_S``."""
    end = min(deadline, time.monotonic() + LEAVE_WAIT_S)
    pause = _POLL_FIRST_S
    try:
        store.set(f"{base}/left/{rank}", "1")
        watch = _Watch(store, base, rank, world_size, _parse_peer(json.dumps(identity())), known)
        while True:
            gone = {r for r, pid in watch().items() if _core.process_exited(pid)}
            keys = [f"{base}/left/{r}" for r in range(world_size) if r != rank and r not in gone]
            if not keys or store.check(keys) or time.monotonic() >= end:
                return
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)
    except Exception:  # noqa: BLE001  the store may be gone already: nothing left to wait for
        pass


def _find_nodes(store: dist.Store, rank: int, world_size: int, base: str, deadline: float,
                known: Optional[dict] = None) -> Layout:
    """The body of :func:`rendezvous`, after this rank has published its identity."""
    failure = failure_key(base)
    # Group rank 0 creates and publishes the whole group's segment at once, as if the group
    # were on one node (the usual case), so that its peers find it when they have every
    # identity; it is removed if the group turns out to span nodes. A failure to create it
    # is reported once the layout is known (on several nodes each segment is smaller).
    early, early_error = None, None
    if rank == 0:
        try:
            directory, slot_bytes = segment_config(world_size)
        except Exception as exc:
            store.set(f"{base}/segment", f"{_STORE_ERROR}{type(exc).__name__}: {exc}")
            raise
        try:
            early = _core.create_segment(directory, world_size, slot_bytes)
            store.set(f"{base}/segment", early)
        except Exception as exc:  # noqa: BLE001  raised below if the group is on one node
            early_error = exc
    watch = _Watch(store, base, rank, world_size, _parse_peer(json.dumps(identity())), known)
    try:
        _store_wait(store, [_pid_key(base, r) for r in range(world_size)], deadline,
                    "waiting for every rank's process id in the store", watch, failure)
    except BaseException:
        _remove(early)
        raise
    watch.read()
    peers = [watch.peers[r] for r in range(world_size)]
    keys = [_node_key(p) for p in peers]
    for attempt in range(world_size):
        groups: dict = {}
        for r, key in enumerate(keys):
            groups.setdefault(key, []).append(r)
        mine = groups[keys[rank]]
        leader = mine[0]
        seg_key = f"{base}/segment" if attempt == 0 and len(groups) == 1 else f"{base}/{attempt}/segment/{leader}"
        path = None
        if rank == 0 and attempt == 0 and len(groups) == 1:  # one node: the segment made at once
            if early_error is not None:
                store.set(seg_key, f"{_STORE_ERROR}{type(early_error).__name__}: {early_error}")
                raise early_error
            path = early
        elif rank == leader:
            _remove(early)
            early = None
            try:
                directory, slot_bytes = segment_config(len(mine))
                path = _core.create_segment(directory, len(mine), slot_bytes)
            except Exception as exc:
                store.set(seg_key, f"{_STORE_ERROR}{type(exc).__name__}: {exc}")
                raise
            store.set(seg_key, path)
        try:
            if rank != leader:
                _store_wait(store, seg_key, deadline, f"waiting for group rank {leader}'s segment path in the store",
                            lambda leader=leader: watch([leader]), failure)
                value = _get_all(store, [seg_key])[0]
                if value.startswith(_STORE_ERROR):
                    what = "group rank 0" if leader == 0 else f"group rank {leader} (this node's first rank)"
                    raise RuntimeError(f"flagos_shm: {what} could not create the shared-memory segment: "
                                       f"{value[len(_STORE_ERROR):]}")
                path = value
                store.set(f"{base}/{attempt}/probe/{rank}", _probe(path))
            members = [r for g in groups.values() for r in g[1:]]
            probe_keys = [f"{base}/{attempt}/probe/{r}" for r in members]
            _store_wait(store, probe_keys, deadline, "waiting for the other ranks to open their node's segment", watch,
                        failure)
            verdicts = dict(zip(members, _get_all(store, probe_keys)))
            failed = {r: v for r, v in verdicts.items() if v != _OK}
            if not failed:
                break
            forced = [r for r in failed if peers[r].get("node")]
            if forced:
                lines = []
                for r in forced:
                    lead = groups[keys[r]][0]
                    lines.append(f"group rank {r} ({_describe(peers[r])}) cannot open the shared-memory segment of "
                                 f"group rank {lead} ({_describe(peers[lead])}): {failed[r]}")
                raise SetupError(
                    "flagos_shm: " + "; ".join(lines) + f". {config.ENV_NODE_ID} puts these ranks on one node, but "
                    "they do not share its segment directory: likely another /dev/shm (another mount namespace or "
                    "container), another FLAGOS_SHM_DIR, or another machine. Give ranks that cannot share memory "
                    f"different {config.ENV_NODE_ID} values (or leave it unset).")
            if rank == 0:
                _log.warning("flagos_shm: group ranks %s cannot open the shared-memory segment of the first rank "
                             "with their node identity (%s); they are treated as another node (Gloo between them)",
                             sorted(failed), "; ".join(f"rank {r}: {v}" for r, v in sorted(failed.items())))
        except BaseException:
            if rank == leader:
                _remove(path)
            raise
        if rank == leader:
            _remove(path)  # this attempt's segment: the node is smaller than its key said
        for r in failed:
            keys[r] = f"{keys[r]}/apart-from:{groups[keys[r]][0]}"
    nodes = [g for g in groups.values()]
    nodes.sort(key=lambda g: g[0])
    _check_pid_namespaces(peers, nodes, path if rank == leader else None)
    return Layout(base, peers, nodes, rank, path)


def _check_pid_namespaces(peers: list, nodes: list, own_segment: Optional[str]) -> None:
    """Every rank of a node must share the node leader's PID namespace (SetupError, on
    every rank alike, naming the ranks that do not)."""
    bad = []
    for members in nodes:
        lead = members[0]
        bad += [(r, lead) for r in members[1:] if _pid_space(peers[r]) != _pid_space(peers[lead])]
    if not bad:
        return
    _remove(own_segment)
    pairs = "; ".join(f"group rank {r} ({_describe(peers[r])}) and group rank {lead} ({_describe(peers[lead])})"
                      for r, lead in bad)
    raise SetupError(
        f"flagos_shm: ranks share a node's shared memory but not its PID namespace: {pairs}. flagos_shm tells "
        "whether a peer is alive, and reads its memory, by process id, which needs one PID namespace per node: run "
        "the ranks of a node in one (e.g. docker --pid=host, or one pod with shareProcessNamespace), or give them "
        f"different {config.ENV_NODE_ID} values so that they talk through Gloo.")
