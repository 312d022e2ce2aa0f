"""``ProcessGroupShm``: the c10d process group of the ``flagos_shm`` backend.

One object per process group and rank. Group rank 0 creates a shared-memory segment
(``flagos_shm._core.create_segment``) and publishes its path through the group's store;
every rank then attaches a ``flagos_shm._core.Communicator`` to it. The segment file is
unlinked as soon as every rank has attached, so nothing is left in the directory.

Each collective validates its arguments (a rank whose arguments are invalid tells its peers
through ``Communicator.fail`` and raises ``ValueError``/``TypeError``, so no rank hangs),
stages the tensors as contiguous host buffers (:mod:`flagos_shm.staging`), runs the core's
collective with the GIL released, writes results back and returns a completed
:class:`~flagos_shm.work.ShmWork`. A failure of the transfer itself (a mismatch between
ranks, a timeout, a dead peer) is stored in the work and raised by ``wait()``.

Method names follow ``torch._C._distributed_c10d.ProcessGroup`` in torch 2.13, with the
older spellings (``_allgather_base``, ``_reduce_scatter_base``, ``alltoall_base``,
``allgather_into_tensor_coalesced``, ``reduce_scatter_tensor_coalesced``) as aliases.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.distributed.constants import default_pg_timeout

from . import _core, staging
from .work import ShmWork

__all__ = ["BACKEND_NAME", "ProcessGroupShm", "create_process_group", "segment_config"]

BACKEND_NAME = "flagos_shm"
ENV_DIR = "FLAGOS_SHM_DIR"
ENV_SLOT_BYTES = "FLAGOS_SHM_SLOT_BYTES"
ENV_ASYNC = "FLAGOS_SHM_ASYNC"  # "0": run async_op=True collectives inline too (debugging, measurements)
DEFAULT_DIR = "/dev/shm"

# torch's RedOpType numbering, which the core uses as well.
SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM = range(9)
_OP_NAMES = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
_COMPLEX_OPS = (SUM, AVG, PREMUL_SUM)  # elementwise on (real, imag) pairs
_RED_OP_TYPE = dist.ReduceOp.RedOpType

# c10d's options classes, grouped by the fields they carry (all have .timeout).
_REDUCE_OPTIONS = (c10d.AllreduceOptions, c10d.AllreduceCoalescedOptions, c10d.ReduceOptions,
                   c10d.ReduceScatterOptions)
_ROOT_OPTIONS = (c10d.BroadcastOptions, c10d.ReduceOptions, c10d.GatherOptions, c10d.ScatterOptions)
_OPTIONS = (*_REDUCE_OPTIONS, *_ROOT_OPTIONS, c10d.AllgatherOptions, c10d.BarrierOptions, c10d.AllToAllOptions)
# options type -> (has reduceOp, has rootRank, has rootTensor)
_OPTION_FIELDS = {t: (t in _REDUCE_OPTIONS, t in _ROOT_OPTIONS, t in (c10d.BroadcastOptions, c10d.ReduceOptions))
                  for t in _OPTIONS}
_STORE_COUNTER = "flagos_shm/rendezvous"
_STORE_ERROR = "error:"


def segment_config() -> tuple[str, int]:
    """Read the segment directory and slot size from the environment.

    ``FLAGOS_SHM_DIR`` (default ``/dev/shm``): an existing directory, ideally a tmpfs.
    ``FLAGOS_SHM_SLOT_BYTES`` (default ``_core.DEFAULT_SLOT_BYTES``): the per-rank chunk-slot
    size in bytes, a positive integer within the core's bounds (a multiple of 4096 up to
    1 GiB in this version; each rank owns 2 slots of the segment).

    Raises:
        ValueError: a variable is set to an unusable value.
    """
    directory = os.environ.get(ENV_DIR, DEFAULT_DIR)
    if not directory or not os.path.isdir(directory):
        raise ValueError(f"{ENV_DIR}={directory!r}: expected an existing directory (default {DEFAULT_DIR})")
    raw = os.environ.get(ENV_SLOT_BYTES)
    if raw is None or raw.strip() == "":
        return directory, int(_core.DEFAULT_SLOT_BYTES)
    try:
        slot_bytes = int(raw.strip())
    except ValueError:
        slot_bytes = 0
    if slot_bytes <= 0:
        raise ValueError(f"{ENV_SLOT_BYTES}={raw!r}: expected a positive integer number of bytes "
                         f"(default {_core.DEFAULT_SLOT_BYTES})")
    try:
        _core.segment_bytes(1, slot_bytes)  # the core's own bounds and alignment rules
    except ValueError as exc:
        raise ValueError(f"{ENV_SLOT_BYTES}={raw!r}: {exc}") from None
    return directory, slot_bytes


_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.01  # store polling while a group is set up: 1 ms, backing off to 10 ms


def _store_wait(store: dist.Store, key: str, deadline: float, what: str, watch: Callable[[], dict]) -> None:
    """Wait until ``key`` is in ``store``, polling, at most until ``deadline`` (monotonic).

    ``watch()`` returns the ranks whose processes must stay alive meanwhile (rank -> pid);
    one that exits fails the wait at once instead of at the deadline.

    Raises:
        RuntimeError: a watched rank exited, or the deadline passed (both name ``what``).
    """
    pause = _POLL_FIRST_S
    while not store.check([key]):
        gone = [f"group rank {r} (pid {pid})" for r, pid in watch().items() if _core.process_exited(pid)]
        if gone:
            raise RuntimeError(f"{what}: {', '.join(gone)} exited")
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{what}: not there within the group's timeout")
        time.sleep(min(pause, left))
        pause = min(2 * pause, _POLL_MAX_S)


def _publish_pid(store: dist.Store, rank: int, world_size: int) -> str:
    """Join the group's next incarnation in ``store``: publish this process's id under it
    and return the incarnation's key prefix. A counter makes the keys unique per group
    incarnation, so a store reused after ``destroy_process_group`` never yields stale ones."""
    incarnation = (store.add(_STORE_COUNTER, 1) - 1) // world_size
    base = f"flagos_shm/{incarnation}"
    store.set(_pid_key(base, rank), str(os.getpid()))
    return base


def _pid_key(base: str, rank: int) -> str:
    """The store key under which ``rank`` of incarnation ``base`` publishes its process id."""
    return f"{base}/pid/{rank}"


def _published_pid(store: dist.Store, base: str, rank: int) -> int:
    """``rank``'s published process id, or 0 if it has not published it yet (no waiting)."""
    key = _pid_key(base, rank)
    return int(store.get(key)) if store.check([key]) else 0


def _rendezvous(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> tuple[str, list]:
    """Group rank 0 creates the segment; return its path and the ranks' process ids
    (a list indexed by rank, 0 where unknown) on every rank.

    Every rank first publishes its process id in the group's store. Group rank 0 then
    creates the segment and publishes its path; the others wait for the path, then for
    every rank's process id (polling the store, ``_store_wait``), so that a rank whose
    process exits while the group is set up is noticed within milliseconds rather than at
    the timeout (here, and by the core's attach, which is given the ids). Only a rank
    that dies before publishing its id is noticed at the timeout. If creation fails, rank
    0 publishes an error marker instead of a path and the other ranks raise
    ``RuntimeError`` instead of waiting.

    Raises:
        RuntimeError: rank 0 could not create the segment, a rank exited, or the timeout
            (``timeout_s``, seconds) passed.
        OSError, ValueError: on rank 0, from creating the segment.
    """
    deadline = time.monotonic() + timeout_s
    base = _publish_pid(store, rank, world_size)
    key = f"{base}/segment"
    if rank == 0:
        try:
            directory, slot_bytes = segment_config()
            path = _core.create_segment(directory, world_size, slot_bytes)
        except Exception as exc:
            store.set(key, f"{_STORE_ERROR}{type(exc).__name__}: {exc}")
            raise
        store.set(key, path)
        return path, [_published_pid(store, base, r) for r in range(world_size)]
    creator: dict = {}

    def watch_creator() -> dict:
        if not creator and (pid := _published_pid(store, base, 0)):
            creator[0] = pid
        return creator

    _store_wait(store, key, deadline, "waiting for group rank 0's segment path in the store", watch_creator)
    value = store.get(key).decode()
    if value.startswith(_STORE_ERROR):
        raise RuntimeError(f"flagos_shm: group rank 0 could not create the shared-memory segment: "
                           f"{value[len(_STORE_ERROR):]}")
    pids: dict = {}
    for r in range(world_size):
        _store_wait(store, _pid_key(base, r), deadline, f"waiting for group rank {r}'s process id in the store",
                    lambda: pids)
        pids[r] = int(store.get(_pid_key(base, r)))
    return value, [pids[r] for r in range(world_size)]


def _with_context(exc: Exception, message: str) -> Exception:
    """An exception of ``exc``'s type (RuntimeError if that type cannot be built from a
    message) carrying ``message``."""
    try:
        return type(exc)(message)
    except Exception:  # noqa: BLE001  an exception type with another constructor
        return RuntimeError(message)


_UNSET_TIMEOUT = timedelta(milliseconds=-1)  # c10d's kUnsetTimeout


def _timeout_seconds(timeout) -> Optional[float]:
    """A timedelta/seconds value -> seconds; ``None`` or <= 0 (c10d's -1 ms "unset") -> ``None``."""
    if timeout is None or timeout == _UNSET_TIMEOUT:  # the latter: what c10d passes by default
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return seconds if seconds > 0 else None


def _reduce_op(op) -> tuple[int, float]:
    """``ReduceOp`` / ``RedOpType`` / int -> (RedOpType number, PREMUL_SUM factor)."""
    if op is None:
        return SUM, 1.0
    kind = getattr(op, "op", op)  # a ReduceOp instance carries its RedOpType in .op
    try:
        code = kind.value if type(kind) is _RED_OP_TYPE else int(kind)  # .value: the cheaper read
    except (TypeError, ValueError):
        raise TypeError(f"op: expected a torch.distributed.ReduceOp, got {op!r}") from None
    if not 0 <= code < len(_OP_NAMES):
        raise ValueError(f"op: unsupported reduce op {op!r}")
    if code != PREMUL_SUM:
        return code, 1.0
    try:
        factor = op.factor
    except (AttributeError, RuntimeError):
        raise ValueError("op: PREMUL_SUM needs a factor; build the op with "
                         "torch.distributed._make_nccl_premul_sum(factor)") from None
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise ValueError(f"op: PREMUL_SUM factor must be a scalar, got a tensor of shape {tuple(factor.shape)}")
        factor = factor.item()
    return code, float(factor)


def _check_op(op: int, buf: staging.HostBuffer, arg: str) -> None:
    """The core's dtype/op rules, checked before the call so that peers can be told."""
    dtype = buf.torch_dtype
    if (op, dtype) in _VALID_OP_DTYPES:  # seen and accepted before (the per-call fast path)
        return
    name = _OP_NAMES[op]
    if dtype.is_complex and op not in _COMPLEX_OPS:
        raise TypeError(f"{arg}: ReduceOp.{name} is not defined for complex dtype {dtype}; use SUM, AVG or PREMUL_SUM")
    if op in (BAND, BOR, BXOR) and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{arg}: ReduceOp.{name} needs an integer or bool tensor, got {dtype}")
    if op == PREMUL_SUM and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{arg}: ReduceOp.PREMUL_SUM needs a floating-point tensor, got {dtype}")
    if op == AVG and dtype == torch.bool:
        raise TypeError(f"{arg}: ReduceOp.AVG is not defined for bool tensors")
    _VALID_OP_DTYPES.add((op, dtype))


_VALID_OP_DTYPES: set = set()


def _same_dtype(bufs: Sequence, args: Sequence[str]) -> None:
    """All tensors of one call must share a dtype."""
    for buf, arg in zip(bufs[1:], args[1:]):
        if buf.torch_dtype != bufs[0].torch_dtype:
            raise TypeError(f"{arg}: dtype {buf.torch_dtype} differs from {args[0]}'s {bufs[0].torch_dtype}; "
                            "all tensors of one collective must have the same dtype")


def _tensor_list(value, arg: str, length: Optional[int] = None, hint: str = "") -> list:
    """Check that ``value`` is a list/tuple (of ``length`` items when given)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{arg}: expected a list of tensors, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise ValueError(f"{arg}: expected a list of {length} item(s), got {len(value)}{hint}")
    return list(value)


def _single(value, arg: str, hint: str = ""):
    """A bare tensor or a list holding exactly one tensor -> the tensor."""
    if isinstance(value, torch.Tensor):
        return value
    return _tensor_list(value, arg, 1, hint)[0]


class _Args:
    """The parsed options of one call: reduce op, factor, root rank and timeout."""

    __slots__ = ("op", "factor", "root", "timeout_s")

    def __init__(self, op: int, factor: float, root: int, timeout_s: Optional[float]):
        self.op, self.factor, self.root, self.timeout_s = op, factor, root, timeout_s


class _Validation:
    """Context manager around a call's argument checks and staging: if they raise
    (ValueError/TypeError for bad arguments), tell the peers through
    ``Communicator.fail`` so that they raise too instead of waiting; the error propagates."""

    __slots__ = ("comm", "name")

    def __init__(self, comm, name: str):
        self.comm, self.name = comm, name

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and issubclass(exc_type, Exception):
            with contextlib.suppress(Exception):  # the caller's error matters more
                self.comm.fail(self.name, f"{exc_type.__name__}: {exc}")
        return False


class ProcessGroupShm(dist.ProcessGroup):
    """Process group whose collectives go through one shared-memory segment of this node.

    Args:
        store: the group's store (``torch.distributed`` passes a ``PrefixStore`` private to
            the group); used once, to publish the segment path.
        rank: this process's rank in the group, ``0 <= rank < world_size``.
        world_size: number of ranks in the group (all on this node).
        timeout: the group's timeout (``timedelta`` or seconds) for attaching and for each
            collective unless the call's options give another one.

    Raises:
        ValueError: bad ``FLAGOS_SHM_DIR`` / ``FLAGOS_SHM_SLOT_BYTES`` (on rank 0).
        OSError: the segment directory is too small (on rank 0).
        RuntimeError: a peer did not attach in time, or rank 0 failed to create the segment.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int,
                 timeout=default_pg_timeout, group_name: str = ""):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
        super().__init__(rank, world_size)
        self._rank, self._world_size = rank, world_size
        self._group_name, self._group_desc = group_name, ""
        self._lock = threading.Lock()
        self._closed = False
        self._async = os.environ.get(ENV_ASYNC, "1").strip() != "0"
        timeout_s = _timeout_seconds(timeout) or default_pg_timeout.total_seconds()
        try:
            path, pids = _rendezvous(store, rank, world_size, timeout_s)
        except RuntimeError as exc:  # a store wait timed out, a rank exited, or rank 0 failed to create
            raise _with_context(exc, f"flagos_shm group {group_name!r} (rank {rank}/{world_size}): "
                                     f"setting up: {exc}") from exc
        try:
            self._comm = _core.Communicator(path, rank, world_size, timeout_s, pids)
        except FileNotFoundError as exc:  # the others removed it: they gave up before we attached
            raise RuntimeError(f"flagos_shm group {group_name!r} (rank {rank}/{world_size}): attaching to {path}: "
                               "the segment is gone: the other ranks gave up setting up the group before this "
                               f"rank attached (a rank exited, or the timeout passed) ({exc})") from exc
        except (RuntimeError, ValueError) as exc:
            raise type(exc)(f"flagos_shm group {group_name!r} (rank {rank}/{world_size}): "
                            f"attaching to {path}: {exc}") from exc

    # ---- identity -----------------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def __repr__(self) -> str:
        return f"ProcessGroupShm(group={self._group_name!r}, rank={self._rank}, world_size={self._world_size})"

    # ---- lifetime -----------------------------------------------------------------------

    def set_timeout(self, timeout) -> None:
        """Set the default timeout of later collectives (``timedelta`` or seconds > 0)."""
        seconds = _timeout_seconds(timeout)
        if seconds is None:
            raise ValueError(f"timeout: expected a positive duration, got {timeout!r}")
        self._comm.set_timeout(seconds)

    def abort(self) -> None:
        """Mark the group aborted: waiting peers wake up and every later call raises RuntimeError."""
        if not self._closed:
            self._comm.abort()

    def shutdown(self) -> None:
        """Release the shared memory (idempotent); later calls raise RuntimeError.

        A collective still running on this rank (in another thread) is cut short: the group
        is aborted first, so that call raises RuntimeError at once, as do the peers' calls,
        instead of holding the segment until the timeout."""
        if not self._closed:
            self._closed = True
            if self._lock.acquire(blocking=False):  # no collective in flight on this rank
                self._lock.release()
            else:
                self._comm.abort()
            self._comm.close()

    # ---- the per-call path --------------------------------------------------------------

    def _validating(self, name: str) -> "_Validation":
        """Context for a call's argument checks and staging (see :class:`_Validation`)."""
        if self._closed:
            raise RuntimeError(f"flagos_shm {name}: process group {self._group_name!r} has been shut down")
        return _Validation(self._comm, name)

    def _args(self, opts, loose: Optional[str] = None, *, op=None, root=None, timeout=None) -> _Args:
        """Read a c10d options object, or the loose (op/root/timeout) arguments of the overloads."""
        fields = _OPTION_FIELDS.get(type(opts))  # exact type: a dict lookup, not 3 isinstance calls
        if fields is None and isinstance(opts, _OPTIONS):  # a subclass
            fields = next(f for t, f in _OPTION_FIELDS.items() if isinstance(opts, t))
        if fields is not None:
            timeout = opts.timeout
            has_op, has_root, has_root_tensor = fields
            if has_op:
                op = opts.reduceOp
            if has_root:
                root = opts.rootRank
                if has_root_tensor and opts.rootTensor != 0:
                    raise ValueError(f"opts.rootTensor: expected 0 (one tensor per rank), got {opts.rootTensor}")
        elif isinstance(opts, timedelta):
            timeout = opts
        elif hasattr(opts, "timeout"):  # an options class this module does not know (newer torch)
            op, root, timeout = getattr(opts, "reduceOp", op), getattr(opts, "rootRank", root), opts.timeout
        elif opts is not None:
            if loose == "op":
                op = opts
            elif loose == "root":
                root = opts
            else:
                raise TypeError(f"opts: expected a torch.distributed options object, got {type(opts).__name__}")
        code, factor = _reduce_op(op)
        if root is None:
            root = 0
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self._world_size:
            raise ValueError(f"root: expected a group rank in [0, {self._world_size}), got {root!r}")
        return _Args(code, factor, root, _timeout_seconds(timeout))

    def _run(self, name: str, outputs: list, buffers: Sequence[staging.HostBuffer],
             calls: Sequence[Callable], opts=None, after: Optional[Callable[[], None]] = None,
             can_async: bool = True) -> ShmWork:
        """Issue the core calls of one collective and return its ShmWork.

        Args:
            calls: each issues one core call, given the ``done`` argument to pass on to it
                (``None``: run inline; a callable: queue it on the progress thread).
            opts: the call's options; ``opts.asyncOp`` (c10d sets it from ``async_op``, and
                it defaults to True for C++ callers such as DDP) selects the asynchronous
                path unless ``FLAGOS_SHM_ASYNC=0`` or ``can_async`` is False.
            after: run once every call has succeeded, before the write-back (e.g. copying a
                scratch buffer out into the caller's list of tensors).

        Validation is over when this is called; errors raised by the transfer are stored in
        the work (``wait()`` re-raises them), prefixed with the group.
        """
        if can_async and self._async and getattr(opts, "asyncOp", False) is True:
            return self._run_async(name, outputs, buffers, calls, after)
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the process group has been shut down")
                for call in calls:
                    call(None)
                if after is not None:
                    after()
                staging.finish(buffers)
        except Exception as exc:
            return ShmWork(outputs, self._error(name, exc))
        return ShmWork(outputs)

    def _run_async(self, name: str, outputs: list, buffers: Sequence[staging.HostBuffer],
                   calls: Sequence[Callable], after: Optional[Callable[[], None]]) -> ShmWork:
        """Queue ``calls`` on the progress thread; the work completes after the last one.

        The completion callback runs on the progress thread (GIL held): it runs ``after``
        and the write-back, then completes the work and its future. The callback holds the
        buffers (and so the caller's tensors and pinned staging memory) until then.
        """
        tickets = [0]
        comm = self._comm
        work = ShmWork(outputs, pending=True, abort=self.abort, help=lambda: comm.wait_ticket(tickets[0]))
        # The core only holds raw addresses: everything the calls read or write (captured
        # by the ``calls`` closures: inputs, scratch and packed buffers) must stay alive
        # until the last call has finished.
        keep_alive = [calls, buffers, after]
        left = [len(calls)]
        errors: list = []
        lock = threading.Lock()

        def done(error, count: int = 1) -> None:
            with lock:
                if error is not None:
                    errors.append(error)
                left[0] -= count
                last = left[0] == 0
            if not last:
                return
            first = errors[0] if errors else None
            keep_alive.clear()
            if first is None:
                try:
                    if after is not None:
                        after()
                    staging.finish(buffers)
                except Exception as exc:
                    first = exc
            work._complete(None if first is None else self._error(name, first))

        if not calls:
            work._complete()
            return work
        with self._lock:
            for i, call in enumerate(calls):
                try:
                    if self._closed:
                        raise RuntimeError("the process group has been shut down")
                    tickets[0] = max(tickets[0], call(done) or 0)
                except Exception as exc:  # not queued: this and the later calls never report
                    done(exc, len(calls) - i)
                    break
        return work

    def _error(self, name: str, exc: Exception) -> Exception:
        """Re-create ``exc`` with the group, rank and collective in its message."""
        message = f"flagos_shm {name} on group {self._group_name!r} (rank {self._rank}/{self._world_size}): {exc}"
        try:
            wrapped = type(exc)(message)
        except Exception:
            return exc
        wrapped.__cause__ = exc
        return wrapped

    def _stage_pair(self, output, input, out_arg: str, in_arg: str):
        """Stage an (output, input) pair of one dtype; copy the input if it overlaps the output."""
        out = staging.stage(output, out_arg, read=False, write=True)
        inp = staging.stage(input, in_arg, read=True)
        _same_dtype([out, inp], [out_arg, in_arg])
        if inp.overlaps(out):  # e.g. FSDP's in-place all-gather: the input is a slice of the output
            inp = staging.stage(inp.host.clone(), in_arg)
        return out, inp

    # ---- allreduce / broadcast / reduce -------------------------------------------------

    def allreduce(self, tensors, opts=None, timeout=None) -> ShmWork:
        """Reduce ``tensors[0]`` (or a bare tensor) in place across the group.

        Args:
            tensors: a list with one tensor, or a tensor (DDP's join path).
            opts: ``AllreduceOptions``, or a ``ReduceOp`` (older overload).
        """
        name = "allreduce"
        with self._validating(name):
            a = self._args(opts, "op", timeout=timeout)
            buf = staging.stage(_single(tensors, "tensors", " (use allreduce_coalesced for several tensors)"),
                                "tensors[0]", read=True, write=True)
            _check_op(a.op, buf, "tensors[0]")
        comm = self._comm
        return self._run(name, [buf.tensor], [buf], [lambda done: comm.allreduce(
            buf.ptr, buf.nbytes, buf.numel, buf.dtype, a.op, a.factor, a.timeout_s, done)], opts)

    def allreduce_coalesced(self, tensors, opts=None) -> ShmWork:
        """Reduce each tensor of ``tensors`` (one dtype) in place; one collective per tensor."""
        name = "allreduce_coalesced"
        with self._validating(name):
            a = self._args(opts, "op")
            tensors = _tensor_list(tensors, "tensors")
            args = [f"tensors[{i}]" for i in range(len(tensors))]
            bufs = [staging.stage(t, arg, read=True, write=True) for t, arg in zip(tensors, args)]
            _same_dtype(bufs, args)
            for buf, arg in zip(bufs, args):
                _check_op(a.op, buf, arg)
        comm = self._comm
        calls = [lambda done, b=buf: comm.allreduce(b.ptr, b.nbytes, b.numel, b.dtype, a.op, a.factor,
                                                     a.timeout_s, done)
                 for buf in bufs]
        return self._run(name, tensors, bufs, calls, opts)

    def broadcast(self, tensors, opts=None, timeout=None) -> ShmWork:
        """Copy the root's ``tensors[0]`` into every rank's ``tensors[0]``.

        Args:
            tensors: a list with one tensor, or a tensor.
            opts: ``BroadcastOptions`` (``rootRank``; ``rootTensor`` must be 0), or the root
                rank (older overload).
        """
        name = "broadcast"
        with self._validating(name):
            a = self._args(opts, "root", timeout=timeout)
            is_root = a.root == self._rank
            buf = staging.stage(_single(tensors, "tensors"), "tensors[0]", read=is_root, write=not is_root)
        comm = self._comm
        return self._run(name, [buf.tensor], [buf], [lambda done: comm.broadcast(
            buf.ptr, buf.nbytes, buf.numel, buf.dtype, a.root, a.timeout_s, done)], opts)

    def reduce(self, tensors, opts=None, op=None, timeout=None) -> ShmWork:
        """Reduce every rank's ``tensors[0]`` into the root's ``tensors[0]`` (others unchanged).

        Args:
            opts: ``ReduceOptions`` (``reduceOp``, ``rootRank``), or the root rank followed by
                ``op`` (older overload).
        """
        name = "reduce"
        with self._validating(name):
            a = self._args(opts, "root", op=op, timeout=timeout)
            buf = staging.stage(_single(tensors, "tensors"), "tensors[0]", read=True, write=a.root == self._rank)
            _check_op(a.op, buf, "tensors[0]")
        comm = self._comm
        return self._run(name, [buf.tensor], [buf], [lambda done: comm.reduce(
            buf.ptr, buf.nbytes, buf.numel, buf.dtype, a.op, a.root, a.factor, a.timeout_s, done)], opts)

    # ---- allgather ----------------------------------------------------------------------

    def allgather(self, output_tensors, input_tensors, opts=None, timeout=None) -> ShmWork:
        """Gather every rank's ``input_tensors[0]`` into ``output_tensors[0][r]`` for each rank r.

        Args:
            output_tensors: ``[[t_0, ..., t_{n-1}]]`` of the input's dtype; ``t_r`` receives
                rank r's input, so ``t_rank`` has the input's element count. Ranks may
                contribute different element counts (padded internally).
            input_tensors: ``[tensor]``; or a bare tensor with a flat output list (older overload).
        """
        name = "allgather"
        with self._validating(name):
            if isinstance(input_tensors, torch.Tensor):
                output_tensors, input_tensors = [output_tensors], [input_tensors]
            a = self._args(opts, timeout=timeout)
            inp = staging.stage(_single(input_tensors, "input_tensors"), "input_tensors[0]")
            outs = _tensor_list(_single(output_tensors, "output_tensors"), "output_tensors[0]", self._world_size)
            self._check_list(outs, "output_tensors[0]", inp, write=True)
            counts = [t.numel() for t in outs]
            if counts[self._rank] != inp.tensor.numel():
                raise ValueError(f"output_tensors[0][{self._rank}]: expected {inp.tensor.numel()} elements "
                                 f"(this rank's input), got {counts[self._rank]}")
        comm, n, count = self._comm, self._world_size, max(counts)
        src = inp if inp.tensor.numel() == count else staging.pack([inp.host], count)
        dst = staging.scratch(n * count, inp.torch_dtype)
        return self._run(name, outs, [], [lambda done: comm.allgather(src.ptr, src.nbytes, dst.ptr, dst.nbytes,
                                                                      src.numel, src.dtype, a.timeout_s, done)],
                         opts, after=lambda: staging.unpack(dst, outs, count))

    @staticmethod
    def _check_list(tensors: list, arg: str, like: staging.HostBuffer, write: bool) -> None:
        """Validate a list of tensors that are packed/unpacked by copy: ``like``'s dtype, CPU."""
        for i, t in enumerate(tensors):
            staging.check(t, f"{arg}[{i}]", write=write)
            if t.dtype != like.torch_dtype:
                raise TypeError(f"{arg}[{i}]: dtype {t.dtype} differs from {like.torch_dtype}; "
                                "all tensors of one collective must have the same dtype")

    def all_gather_single(self, output, input, opts=None) -> ShmWork:
        """Gather every rank's ``input`` into ``output`` (``world_size * input.numel()``
        elements, rank r's data at ``[r * numel, (r + 1) * numel)`` of the flattened output)."""
        name = "all_gather_single"
        with self._validating(name):
            a = self._args(opts)
            out, inp = self._stage_pair(output, input, "output", "input")
            if out.numel != self._world_size * inp.numel:
                raise ValueError(f"output: expected world_size * input.numel() = {self._world_size} * "
                                 f"{inp.tensor.numel()} elements, got {output.numel()}")
        comm = self._comm
        return self._run(name, [output], [out], [lambda done: comm.allgather(
            inp.ptr, inp.nbytes, out.ptr, out.nbytes, inp.numel, inp.dtype, a.timeout_s, done)], opts)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_list, opts=None) -> ShmWork:
        """Gather each ``input_list[i]`` of every rank: ``output_lists[r][i]`` receives rank
        r's ``input_list[i]`` (torch's layout: ``world_size`` lists of ``len(input_list)``
        tensors). One collective per input tensor."""
        name = "allgather_coalesced"
        with self._validating(name):
            a = self._args(opts)
            inputs = _tensor_list(input_list, "input_list")
            output_lists = _tensor_list(output_lists, "output_lists", self._world_size)
            rows = [_tensor_list(row, f"output_lists[{r}]", len(inputs)) for r, row in enumerate(output_lists)]
            jobs = []
            for i, t in enumerate(inputs):
                inp = staging.stage(t, f"input_list[{i}]")
                outs = [row[i] for row in rows]
                self._check_list(outs, f"output_lists[*][{i}]", inp, write=True)
                if any(o.numel() != t.numel() for o in outs):
                    raise ValueError(f"output_lists[r][{i}]: every rank's tensor must have input_list[{i}]'s "
                                     f"{t.numel()} elements")
                jobs.append((outs, inp))
        comm, n = self._comm, self._world_size
        dsts = [staging.scratch(n * inp.tensor.numel(), inp.torch_dtype) for _, inp in jobs]
        calls = [lambda done, inp=inp, dst=dst: comm.allgather(inp.ptr, inp.nbytes, dst.ptr, dst.nbytes,
                                                               inp.numel, inp.dtype, a.timeout_s, done)
                 for (_, inp), dst in zip(jobs, dsts)]

        def after():
            for (outs, inp), dst in zip(jobs, dsts):
                staging.unpack(dst, outs, inp.tensor.numel())
        return self._run(name, [o for row in rows for o in row], [], calls, opts, after=after)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> ShmWork:
        """``all_gather_single`` of each ``(outputs[i], inputs[i])`` pair (one collective each)."""
        name = "all_gather_single_coalesced"
        with self._validating(name):
            a = self._args(opts)
            pairs = self._stage_pairs(outputs, inputs)
            for i, (out, inp) in enumerate(pairs):
                if out.numel != self._world_size * inp.numel:
                    raise ValueError(f"outputs[{i}]: expected world_size * inputs[{i}].numel() = "
                                     f"{self._world_size * inp.tensor.numel()} elements, got {out.tensor.numel()}")
        comm = self._comm
        calls = [lambda done, out=out, inp=inp: comm.allgather(inp.ptr, inp.nbytes, out.ptr, out.nbytes,
                                                               inp.numel, inp.dtype, a.timeout_s, done)
                 for out, inp in pairs]
        return self._run(name, list(outputs), [out for out, _ in pairs], calls, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _stage_pairs(self, outputs, inputs) -> list:
        inputs = _tensor_list(inputs, "inputs")
        outputs = _tensor_list(outputs, "outputs", len(inputs))
        return [self._stage_pair(o, t, f"outputs[{i}]", f"inputs[{i}]")
                for i, (o, t) in enumerate(zip(outputs, inputs))]

    # ---- reduce-scatter -----------------------------------------------------------------

    def reduce_scatter(self, output_tensors, input_tensors, opts=None, timeout=None) -> ShmWork:
        """Reduce ``input_tensors[0][r]`` over all ranks into rank r's ``output_tensors[0]``.

        Args:
            output_tensors: ``[tensor]``; or a bare tensor with a flat input list (older overload,
                then ``opts`` may be a ``ReduceOp``).
            input_tensors: ``[[t_0, ..., t_{n-1}]]``, each with the output's element count.
        """
        name = "reduce_scatter"
        with self._validating(name):
            if isinstance(output_tensors, torch.Tensor):
                output_tensors, input_tensors = [output_tensors], [input_tensors]
            a = self._args(opts, "op", timeout=timeout)
            out = staging.stage(_single(output_tensors, "output_tensors"), "output_tensors[0]",
                                read=False, write=True)
            ins = _tensor_list(_single(input_tensors, "input_tensors"), "input_tensors[0]", self._world_size)
            self._check_list(ins, "input_tensors[0]", out, write=False)
            for i, t in enumerate(ins):
                if t.numel() != out.tensor.numel():
                    raise ValueError(f"input_tensors[0][{i}]: expected the output's {out.tensor.numel()} "
                                     f"elements, got {t.numel()}")
            _check_op(a.op, out, "output_tensors[0]")
        comm = self._comm
        src = staging.pack(ins, out.tensor.numel())
        return self._run(name, [out.tensor], [out], [lambda done: comm.reduce_scatter(
            src.ptr, src.nbytes, out.ptr, out.nbytes, out.numel, out.dtype, a.op, a.factor, a.timeout_s, done)], opts)

    def reduce_scatter_single(self, output, input, opts=None) -> ShmWork:
        """Reduce ``input`` (``world_size * output.numel()`` elements) over all ranks; rank r
        receives the reduction of slice ``[r * numel, (r + 1) * numel)`` in ``output``."""
        name = "reduce_scatter_single"
        with self._validating(name):
            a = self._args(opts, "op")
            out, inp = self._stage_pair(output, input, "output", "input")
            if inp.numel != self._world_size * out.numel:
                raise ValueError(f"input: expected world_size * output.numel() = {self._world_size} * "
                                 f"{output.numel()} elements, got {input.numel()}")
            _check_op(a.op, out, "output")
        comm = self._comm
        return self._run(name, [output], [out], [lambda done: comm.reduce_scatter(
            inp.ptr, inp.nbytes, out.ptr, out.nbytes, out.numel, out.dtype, a.op, a.factor, a.timeout_s, done)], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None) -> ShmWork:
        """``reduce_scatter_single`` of each ``(outputs[i], inputs[i])`` pair (one collective each)."""
        name = "reduce_scatter_single_coalesced"
        with self._validating(name):
            a = self._args(opts, "op")
            pairs = self._stage_pairs(outputs, inputs)
            for i, (out, inp) in enumerate(pairs):
                if inp.numel != self._world_size * out.numel:
                    raise ValueError(f"inputs[{i}]: expected world_size * outputs[{i}].numel() = "
                                     f"{self._world_size * out.tensor.numel()} elements, got {inp.tensor.numel()}")
                _check_op(a.op, out, f"outputs[{i}]")
        comm = self._comm
        calls = [lambda done, out=out, inp=inp: comm.reduce_scatter(inp.ptr, inp.nbytes, out.ptr, out.nbytes,
                                                                    out.numel, out.dtype, a.op, a.factor,
                                                                    a.timeout_s, done)
                 for out, inp in pairs]
        return self._run(name, list(outputs), [out for out, _ in pairs], calls, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- all-to-all ---------------------------------------------------------------------

    def all_to_all_single(self, output, input, output_split_sizes=(), input_split_sizes=(),
                          opts=None) -> ShmWork:
        """Send slice r of ``input`` to rank r; receive rank r's slice into slice r of ``output``.

        Args:
            output, input: tensors of one dtype, split along dim 0.
            output_split_sizes, input_split_sizes: rows per rank along dim 0. Both empty means
                equal splits (dim 0 of both divisible by world size, same element count),
                exchanged in place. Otherwise ranks exchange padded blocks (one extra small
                allreduce agrees on the block size), so every rank must then pass split sizes
                (ranks that disagree raise ValueError).
        """
        name = "all_to_all_single"
        with self._validating(name):
            a = self._args(opts)
            out, inp = self._stage_pair(output, input, "output", "input")
            n = self._world_size
            uniform = not output_split_sizes and not input_split_sizes
            if uniform:
                if (input.numel() != output.numel() or input.dim() == 0 or output.dim() == 0
                        or input.shape[0] % n or output.shape[0] % n):
                    raise ValueError(f"input/output: without split sizes both need the same element count and "
                                     f"dim 0 divisible by world size {n}; got shapes {tuple(input.shape)} and "
                                     f"{tuple(output.shape)}")
            else:
                if input.dim() == 0 or output.dim() == 0 or input.shape[1:].numel() != output.shape[1:].numel():
                    raise ValueError(f"input/output: with split sizes both must have dim >= 1 and rows of the "
                                     f"same size; got shapes {tuple(input.shape)} and {tuple(output.shape)}")
                row = input.shape[1:].numel()
                in_rows = self._splits(input_split_sizes, input, "input_split_sizes")
                out_rows = self._splits(output_split_sizes, output, "output_split_sizes")
                src_parts = list(inp.host.reshape(-1).split([r * row for r in in_rows]))
                dst_parts = list(out.host.reshape(-1).split([r * row for r in out_rows]))
        comm = self._comm
        if uniform:
            return self._run(name, [output], [out], [lambda done: comm.alltoall(
                inp.ptr, inp.nbytes, out.ptr, out.nbytes, inp.numel // n, inp.dtype, a.timeout_s, done)], opts)
        # Uneven splits: Python decides between the size exchange and the data exchange,
        # so this one runs inline (its work is complete when returned).
        return self._run(name, [output], [out], [lambda _: self._alltoall_padded(dst_parts, src_parts, a)],
                         can_async=False)

    alltoall_base = all_to_all_single

    def _splits(self, sizes, tensor: torch.Tensor, arg: str) -> list:
        """Per-rank row counts along dim 0 (equal split when ``sizes`` is empty)."""
        rows = tensor.shape[0]
        n = self._world_size
        if not sizes:
            if rows % n:
                raise ValueError(f"{arg}: empty means an equal split, but dim 0 ({rows}) is not divisible by {n}")
            return [rows // n] * n
        sizes = [int(s) for s in sizes]
        if len(sizes) != n or any(s < 0 for s in sizes) or sum(sizes) != rows:
            raise ValueError(f"{arg}: expected {n} non-negative row counts summing to dim 0 ({rows}), got {sizes}")
        return sizes

    def _alltoall_padded(self, dst_parts: list, src_parts: list, a: _Args) -> None:
        """All-to-all of per-peer pieces of any sizes: allgather every rank's piece sizes,
        check that what each rank sends to a peer is what that peer expects (ValueError on
        every rank otherwise: all ranks see the same sizes and decide alike, before any data
        moves), exchange blocks of the largest piece's size, copy the pieces out."""
        comm, n, me = self._comm, self._world_size, self._rank
        mine = torch.tensor([p.numel() for p in src_parts] + [p.numel() for p in dst_parts], dtype=torch.int64)
        sizes = torch.empty(n, 2 * n, dtype=torch.int64)
        comm.allgather(mine.data_ptr(), mine.numel() * mine.element_size(),
                       sizes.data_ptr(), sizes.numel() * sizes.element_size(), 2 * n, "int64", a.timeout_s)
        sends, expects = sizes[:, :n], sizes[:, n:]  # sends[p][q]: p -> q; expects[q][p]: q <- p
        bad = [(p, q) for p in range(n) for q in range(n) if sends[p, q] != expects[q, p]]
        if bad:
            p, q = bad[0]
            raise ValueError(f"split sizes disagree between ranks: rank {p} sends {int(sends[p, q])} elements to "
                             f"rank {q}, which expects {int(expects[q, p])} from it ({len(bad)} such pair(s)); "
                             f"no data was exchanged (this rank is {me})")
        count = int(sizes.max()) if sizes.numel() else 0
        src = staging.pack(src_parts, count)
        dst = staging.scratch(n * count, src.torch_dtype)
        comm.alltoall(src.ptr, src.nbytes, dst.ptr, dst.nbytes, src.numel // n, src.dtype, a.timeout_s)
        staging.unpack(dst, dst_parts, count)

    def alltoall(self, output_tensors, input_tensors, opts=None) -> ShmWork:
        """Send ``input_tensors[r]`` to rank r and receive rank r's piece into ``output_tensors[r]``.

        Pieces may differ in size (exchanged as padded blocks after one small allreduce).
        """
        name = "alltoall"
        with self._validating(name):
            a = self._args(opts)
            ins = _tensor_list(input_tensors, "input_tensors", self._world_size)
            outs = _tensor_list(output_tensors, "output_tensors", self._world_size)
            first = staging.stage(ins[0], "input_tensors[0]")
            self._check_list(ins, "input_tensors", first, write=False)
            self._check_list(outs, "output_tensors", first, write=True)
        return self._run(name, outs, [], [lambda _: self._alltoall_padded(outs, ins, a)], can_async=False)

    # ---- gather / scatter ---------------------------------------------------------------

    def gather(self, output_tensors, input_tensors, opts=None, timeout=None) -> ShmWork:
        """Gather every rank's ``input_tensors[0]`` into the root's ``output_tensors[0][r]``.

        Args:
            output_tensors: on the root ``[[t_0, ..., t_{n-1}]]`` (each of the input's element
                count and dtype); elsewhere ``[]`` (or ``[[]]``).
            input_tensors: ``[tensor]``; or a bare tensor with a flat output list followed by
                the root rank (older overload).
        """
        name = "gather"
        with self._validating(name):
            if isinstance(input_tensors, torch.Tensor):
                output_tensors, input_tensors = ([output_tensors] if output_tensors else []), [input_tensors]
            a = self._args(opts, "root", timeout=timeout)
            inp = staging.stage(_single(input_tensors, "input_tensors"), "input_tensors[0]")
            outs = self._root_list(output_tensors, "output_tensors", a.root, inp, write=True)
        comm, count = self._comm, inp.tensor.numel()
        dst = staging.scratch(self._world_size * count, inp.torch_dtype) if outs else None
        return self._run(name, outs, [], [lambda done: comm.gather(
            inp.ptr, inp.nbytes, dst.ptr if outs else 0, dst.nbytes if outs else 0,
            inp.numel, inp.dtype, a.root, a.timeout_s, done)],
            opts, after=(lambda: staging.unpack(dst, outs, count)) if outs else None)

    def _root_list(self, lists, arg: str, root: int, like: staging.HostBuffer, write: bool) -> list:
        """The root's list of ``world_size`` tensors shaped like ``like``; [] on other ranks."""
        lists = _tensor_list(lists, arg)
        if self._rank != root:
            if any(not isinstance(item, (list, tuple)) or len(item) for item in lists):
                raise ValueError(f"{arg}: only the root (rank {root}) passes tensors here; "
                                 f"expected [] on rank {self._rank}")
            return []
        tensors = _tensor_list(_single(lists, arg), f"{arg}[0]", self._world_size)
        self._check_list(tensors, f"{arg}[0]", like, write)
        for i, t in enumerate(tensors):
            if t.numel() != like.tensor.numel():
                raise ValueError(f"{arg}[0][{i}]: expected {like.tensor.numel()} elements, got {t.numel()}")
        return tensors

    def scatter(self, output_tensors, input_tensors, opts=None, timeout=None) -> ShmWork:
        """Copy the root's ``input_tensors[0][r]`` into rank r's ``output_tensors[0]``.

        Args:
            output_tensors: ``[tensor]``; or a bare tensor with a flat input list followed by the
                root rank (older overload).
            input_tensors: on the root ``[[t_0, ..., t_{n-1}]]`` (each of the output's element
                count and dtype); elsewhere ``[]`` (or ``[[]]``).
        """
        name = "scatter"
        with self._validating(name):
            if isinstance(output_tensors, torch.Tensor):
                output_tensors, input_tensors = [output_tensors], ([input_tensors] if input_tensors else [])
            a = self._args(opts, "root", timeout=timeout)
            out = staging.stage(_single(output_tensors, "output_tensors"), "output_tensors[0]",
                                read=False, write=True)
            ins = self._root_list(input_tensors, "input_tensors", a.root, out, write=False)
        comm = self._comm
        src = staging.pack(ins, out.tensor.numel()) if ins else None
        return self._run(name, [out.tensor], [out], [lambda done: comm.scatter(
            src.ptr if ins else 0, src.nbytes if ins else 0, out.ptr, out.nbytes,
            out.numel, out.dtype, a.root, a.timeout_s, done)], opts)

    # ---- barrier, point-to-point --------------------------------------------------------

    def barrier(self, opts=None, timeout=None) -> ShmWork:
        """Wait until every rank of the group has called ``barrier``."""
        name = "barrier"
        with self._validating(name):
            a = self._args(opts, timeout=timeout)
        comm = self._comm
        return self._run(name, [], [], [lambda done: comm.barrier(a.timeout_s, done)], opts)

    def _no_p2p(self, name: str):
        raise NotImplementedError(f"flagos_shm does not implement point-to-point {name}; "
                                  "use collectives, or another backend (e.g. gloo) for send/recv")

    def send(self, tensors, dstRank, tag=0):
        self._no_p2p("send")

    def recv(self, tensors, srcRank, tag=0):
        self._no_p2p("recv")

    def recv_anysource(self, tensors, tag=0):
        self._no_p2p("recv_anysource")


def _requested_device_backends() -> dict:
    """The ``device -> backend`` map of the ``init_process_group``/``new_group`` call that is
    creating a group right now, read from torch's ``_new_process_group_helper`` frame
    (``backend_config``); empty when it cannot be found (another torch layout)."""
    frame = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            break
        config = frame.f_locals.get("backend_config")
        if config is not None and hasattr(config, "get_device_backend_map"):
            return {str(d): str(b) for d, b in config.get_device_backend_map().items()}
        frame = frame.f_back
    return {}


def create_process_group(backend_opts, pg_options=None) -> ProcessGroupShm:
    """The creator registered with ``torch.distributed.Backend.register_backend(...,
    extended_api=True)``: build the group from ``_DistributedBackendOptions`` (``store``,
    ``group_rank``, ``group_size``, ``timeout``, ``group_id``). ``pg_options`` is unused.

    torch (2.13) makes a Python process group such as this one the *whole* group, for
    tensors of every device. A per-device backend string that gives another device to
    another backend (``"cpu:gloo,flagos:flagos_shm"``) would therefore silently send that
    device's tensors through flagos_shm as well; this is refused.

    Raises:
        ValueError: the backend string maps some device to another backend.
    """
    others = {d: b for d, b in _requested_device_backends().items() if b.lower() != BACKEND_NAME}
    if others:
        pairs = ",".join(f"{d}:{b}" for d, b in others.items())
        raise ValueError(
            f"backend: flagos_shm cannot share a process group with other backends ({pairs}): torch "
            f"gives a Python process group every device of its group, so those tensors would go through "
            f"flagos_shm instead. Use backend='{BACKEND_NAME}' (serves CPU and device tensors alike), or "
            f"create a separate group with dist.new_group(backend=...) for the other backend.")
    return ProcessGroupShm(backend_opts.store, backend_opts.group_rank, backend_opts.group_size,
                           backend_opts.timeout, group_name=str(getattr(backend_opts, "group_id", "") or ""))
