"""Options and argument checks shared by both c10d adapters.

c10d hands a collective its arguments as an options object (``AllreduceOptions``, ...)
or, through the older overloads, as loose ``op`` / ``root`` / ``timeout`` values;
:func:`parse` turns either into one :class:`Args`. The remaining helpers check the rules
every collective shares (a reduce op defined for the dtype, one dtype per call, list
lengths). Each raises ``TypeError``/``ValueError`` naming the argument.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from .. import _compat, _core, staging

# The reduce-op codes (torch's RedOpType numbering) and the ops each dtype takes: the core's
# (``_core.REDUCE_OPS``, ``_core.REDUCE_OP_DTYPES``).
SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM = (
    _core.REDUCE_OPS[n] for n in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"))
#: Op names by code.
OP_NAMES = tuple(sorted(_core.REDUCE_OPS, key=_core.REDUCE_OPS.__getitem__))
_OPS_OF = {name: frozenset(codes) for name, codes in _core.REDUCE_OP_DTYPES.items()}
#: Complex tensors reduce as (real, imag) pairs of their real dtype, which is right only for
#: the ops that act on each component alone (a rule of this layer: the core has no complex).
_COMPLEX_OPS = (SUM, AVG, PREMUL_SUM)
#: Why the core refuses an op on a dtype, by op (the rule itself is the core's).
_REFUSED = {BAND: "needs an integer or bool tensor, got {dtype}", BOR: "needs an integer or bool tensor, got {dtype}",
            BXOR: "needs an integer or bool tensor, got {dtype}",
            PREMUL_SUM: "needs a floating-point tensor, got {dtype}", AVG: "is not defined for {short} tensors"}
_RED_OP_TYPE = dist.ReduceOp.RedOpType

# c10d's options classes, grouped by the fields they carry (all have .timeout).
_REDUCE_OPTIONS = (c10d.AllreduceOptions, c10d.AllreduceCoalescedOptions, c10d.ReduceOptions,
                   c10d.ReduceScatterOptions)
_ROOT_OPTIONS = (c10d.BroadcastOptions, c10d.ReduceOptions, c10d.GatherOptions, c10d.ScatterOptions)
_OPTIONS = (*_REDUCE_OPTIONS, *_ROOT_OPTIONS, c10d.AllgatherOptions, c10d.BarrierOptions, c10d.AllToAllOptions)
# options type -> (has reduceOp, has rootRank, has rootTensor)
_OPTION_FIELDS = {t: (t in _REDUCE_OPTIONS, t in _ROOT_OPTIONS, t in (c10d.BroadcastOptions, c10d.ReduceOptions))
                  for t in _OPTIONS}

_UNSET_TIMEOUT = timedelta(milliseconds=-1)  # c10d's kUnsetTimeout
UNSET_TIMEOUT = _UNSET_TIMEOUT  # public name (collectives.barrier)


class Args:
    """The parsed options of one call: reduce op (RedOpType number), PREMUL_SUM factor,
    root group rank and timeout in seconds (``None``: the group's)."""

    __slots__ = ("op", "factor", "root", "timeout_s")

    def __init__(self, op: int, factor: float, root: int, timeout_s: Optional[float]):
        self.op, self.factor, self.root, self.timeout_s = op, factor, root, timeout_s


def parse(opts, world_size: int, loose: Optional[str] = None, *, op=None, root=None, timeout=None) -> Args:
    """Read a c10d options object, or the loose (op/root/timeout) arguments of the overloads.

    Args:
        opts: a c10d options object, a ``timedelta``, ``None``, or (older overloads) the
            reduce op (``loose="op"``) or the root rank (``loose="root"``).
        world_size: the group's size, bounding ``root``.

    Raises:
        TypeError: ``opts`` or the op is of an unknown type.
        ValueError: root out of range, ``rootTensor != 0``, an unsupported op.
    """
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
    code, factor = reduce_op(op)
    if root is None:
        root = 0
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < world_size:
        raise ValueError(f"root: expected a group rank in [0, {world_size}), got {root!r}")
    return Args(code, factor, root, timeout_seconds(timeout))


def timeout_seconds(timeout) -> Optional[float]:
    """A timedelta/seconds value -> seconds; ``None`` or <= 0 (c10d's -1 ms "unset") -> ``None``."""
    if timeout is None or timeout == _UNSET_TIMEOUT:  # the latter: what c10d passes by default
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return seconds if seconds > 0 else None


def reduce_op(op) -> tuple[int, float]:
    """``ReduceOp`` / ``RedOpType`` / int -> (RedOpType number, PREMUL_SUM factor).

    Raises:
        TypeError: not a reduce op.
        ValueError: an unknown op, or PREMUL_SUM without a scalar factor.
    """
    if op is None:
        return SUM, 1.0
    kind = getattr(op, "op", op)  # a ReduceOp instance carries its RedOpType in .op
    try:
        code = kind.value if type(kind) is _RED_OP_TYPE else int(kind)  # .value: the cheaper read
    except (TypeError, ValueError):
        raise TypeError(f"op: expected a torch.distributed.ReduceOp, got {op!r}") from None
    if not 0 <= code < len(OP_NAMES):
        raise ValueError(f"op: unsupported reduce op {op!r}")
    if code != PREMUL_SUM:
        return code, 1.0
    try:
        factor = _compat.premul_factor(op)
    except (AttributeError, RuntimeError):
        raise ValueError("op: PREMUL_SUM needs a factor; build the op with "
                         "torch.distributed._make_nccl_premul_sum(factor)") from None
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise ValueError(f"op: PREMUL_SUM factor must be a scalar, got a tensor of shape {tuple(factor.shape)}")
        factor = factor.item()
    return code, float(factor)


_VALID_OP_DTYPES: set = set()


def fast_op_table() -> dict:
    """What the c10d adapter may send down :meth:`Reduction._allreduce_digested` without the
    full path: ``{torch dtype: (core dtype name, bit mask of the ops the core's rules allow
    for it)}``, for the real core dtypes and every op but PREMUL_SUM (bit ``1 << op``, in
    torch's ``RedOpType`` numbering). Derived from :func:`check_op`, the one statement of
    the rules; any other call takes the full path, which raises the rule's error."""
    table = {}
    for dtype, name in staging.CORE_DTYPES.items():
        mask = 0
        for op in range(PREMUL_SUM):
            probe = staging.HostBuffer(None, torch.empty(0, dtype=dtype), name, write_back=False)
            try:
                check_op(op, probe, "probe")
            except TypeError:
                continue
            mask |= 1 << op
        table[dtype] = (name, mask)
    return table


def check_op(op: int, buf: staging.HostBuffer, arg: str) -> None:
    """The core's dtype/op rules, checked before the call so that peers can be told.

    Raises:
        TypeError: ``op`` is not defined for ``buf``'s dtype.
    """
    dtype = buf.torch_dtype
    if (op, dtype) in _VALID_OP_DTYPES:  # seen and accepted before (the per-call fast path)
        return
    name = OP_NAMES[op]
    if dtype.is_complex and op not in _COMPLEX_OPS:
        raise TypeError(f"{arg}: ReduceOp.{name} is not defined for complex dtype {dtype}; use SUM, AVG or PREMUL_SUM")
    if op not in _OPS_OF[buf.dtype]:  # complex: the rules of its real dtype
        why = _REFUSED.get(op, "is not defined for {dtype}")
        raise TypeError(f"{arg}: ReduceOp.{name} " + why.format(dtype=dtype, short=str(dtype).removeprefix("torch.")))
    _VALID_OP_DTYPES.add((op, dtype))


def same_dtype(bufs: Sequence, args: Sequence[str]) -> None:
    """All tensors of one call must share a dtype (``TypeError`` naming the first that differs)."""
    for buf, arg in zip(bufs[1:], args[1:]):
        if buf.torch_dtype != bufs[0].torch_dtype:
            raise TypeError(f"{arg}: dtype {buf.torch_dtype} differs from {args[0]}'s {bufs[0].torch_dtype}; "
                            "all tensors of one collective must have the same dtype")


def tensor_list(value, arg: str, length: Optional[int] = None, hint: str = "") -> list:
    """Check that ``value`` is a list/tuple (of ``length`` items when given)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{arg}: expected a list of tensors, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise ValueError(f"{arg}: expected a list of {length} item(s), got {len(value)}{hint}")
    return list(value)


def single(value, arg: str, hint: str = ""):
    """A bare tensor or a list holding exactly one tensor -> the tensor."""
    if isinstance(value, torch.Tensor):
        return value
    return tensor_list(value, arg, 1, hint)[0]


def check_list(tensors: list, arg: str, like: staging.HostBuffer, write: bool) -> None:
    """Validate a list of tensors that are packed/unpacked by copy: ``like``'s dtype, CPU-stageable."""
    for i, t in enumerate(tensors):
        staging.check(t, f"{arg}[{i}]", write=write)
        if t.dtype != like.torch_dtype:
            raise TypeError(f"{arg}[{i}]: dtype {t.dtype} differs from {like.torch_dtype}; "
                            "all tensors of one collective must have the same dtype")


def with_context(exc: Exception, message: str) -> Exception:
    """An exception of ``exc``'s type (RuntimeError if that type cannot be built from a
    message) carrying ``message``."""
    try:
        return type(exc)(message)
    except Exception:  # noqa: BLE001  an exception type with another constructor
        return RuntimeError(message)


def disagreement(message: str, kind: str, rank: int, peer: int, expected, got, pairs: int | None = None) -> ValueError:
    """``ValueError(message)`` with the fields the core's binding sets on a disagreement
    (``rust/binding/errors.rs``), for the hierarchy's own checks to raise the same shape.

    Args:
        kind: ``"counts"`` (per-peer counts) or ``"calls"`` (different calls at one position).
        rank, peer: the two ranks (group ranks; node indices between node leaders).
        expected, got: counts: elements ``peer`` expects from ``rank`` and ``rank`` sends it;
            calls: the collective kind names ``rank`` and ``peer`` called.
        pairs: counts only: how many pairs disagree.
    """
    exc = ValueError(message)
    exc.kind, exc.rank, exc.peer, exc.expected, exc.got = kind, rank, peer, expected, got
    if pairs is not None:
        exc.pairs = pairs
    return exc
