"""Reductions: allreduce, reduce, reduce-scatter, and the coalesced batches of allreduce and
reduce-scatter (one core collective per batch). ``allreduce`` hands a sparse tensor to
:mod:`.sparse`."""

from __future__ import annotations

from typing import Callable

import torch
from torch._C import _distributed_c10d as c10d

from ... import staging
from ...work import ShmWork
from .. import options
from .base import SLOW, fast_dtype
from .sparse import SparseReduction

_ALLREDUCE_OPTIONS = c10d.AllreduceOptions
_REDUCE_SCATTER_OPTIONS = c10d.ReduceScatterOptions
_UNSET_TIMEOUT = options._UNSET_TIMEOUT


def _naming(where: Callable[[], str], call):
    """``call`` (one core call, given its ``done`` argument, as :meth:`~.base.CollectiveBase._run`
    takes it) with each ``ValueError`` it raises or reports (ranks that disagree) prefixed
    with ``where()``, the caller's argument (built only then); other errors (timeouts,
    aborts) unchanged."""
    def rename(exc):
        if not isinstance(exc, ValueError):
            return exc
        named = ValueError(f"{where()}: {exc}")
        named.__cause__ = exc
        return named

    def named_call(done):
        report = None if done is None else (
            lambda error, *rest, **kw: done(None if error is None else rename(error), *rest, **kw))
        try:
            return call(report)
        except ValueError as exc:
            raise rename(exc) from exc

    return named_call


class Reduction(SparseReduction):
    """allreduce, allreduce_coalesced, reduce, reduce_scatter, reduce_scatter_single(_coalesced);
    allreduce_sparse from :class:`~.sparse.SparseReduction`."""

    def allreduce(self, tensors, opts=None, timeout=None) -> ShmWork:
        """Reduce ``tensors[0]`` (or a bare tensor) in place across the group.

        Args:
            tensors: a list with one tensor, or a tensor (DDP's join path). A sparse COO
                tensor goes to :meth:`~.sparse.SparseReduction.allreduce_sparse`.
            opts: ``AllreduceOptions``, or a ``ReduceOp`` (older overload).
            timeout: the call's timeout (``timedelta`` or seconds) where ``opts`` is not an
                options object (one carries its own); None: the group's.
        """
        if timeout is None:
            done = self._allreduce_fast(tensors, opts)  # one contiguous CPU tensor
            if done is not SLOW:
                return done
        tensor = tensors if isinstance(tensors, torch.Tensor) else (
            tensors[0] if isinstance(tensors, (list, tuple)) and len(tensors) == 1 else None)
        if isinstance(tensor, torch.Tensor) and tensor.layout != torch.strided:
            return self.allreduce_sparse([tensor], opts)
        name = "allreduce"
        with self._validating(name, (tensors,)):
            a = self._args(opts, "op", timeout=timeout)
            buf = staging.stage(options.single(tensors, "tensors", " (use allreduce_coalesced for several tensors)"),
                                "tensors[0]", read=True, write=True)
            options.check_op(a.op, buf, "tensors[0]")
        comm = self._comm
        return self._run(name, [buf.tensor], [buf], [lambda done: comm.allreduce(
            buf.ptr, buf.nbytes, buf.numel, buf.dtype, a.op, a.factor, a.timeout_s, done)], opts)

    def _allreduce_fast(self, tensors, opts):
        """The common case of :meth:`allreduce`, with the same checks spelled out for it:
        a list of one tensor that :func:`~.base.fast_dtype` takes, exact
        ``AllreduceOptions`` with an op already accepted for that dtype (not PREMUL_SUM), no
        per-call timeout, nothing pending or coalescing, an open group. Runs the core call
        inline or queued (:meth:`~.base.CollectiveBase._fast_call`); returns what
        :meth:`allreduce` would, or :data:`~.base.SLOW` (nothing done) for any other call."""
        if (type(tensors) is not list or len(tensors) != 1 or type(opts) is not _ALLREDUCE_OPTIONS
                or (self._pending and self._writing_back()) or self._closed
                or self._coalesced is not None):
            return SLOW
        t = tensors[0]
        dtype = fast_dtype(t)
        if dtype is None or opts.timeout != _UNSET_TIMEOUT:
            return SLOW
        op, _ = options.reduce_op(opts.reduceOp)
        if op == options.PREMUL_SUM or (op, t.dtype) not in options._VALID_OP_DTYPES:
            return SLOW
        ptr, es = t.data_ptr(), t.element_size()
        if ptr % es:
            return SLOW  # not aligned to its element size: the full path stages it
        numel, comm = t.numel(), self._comm
        return self._fast_call("allreduce", tensors, lambda done: comm.allreduce(
            ptr, numel * es, numel, dtype, op, 1.0, None, done), opts.asyncOp)

    def _allreduce_digested(self, tensors, ptr: int, nbytes: int, numel: int, dtype: str, op: int, async_op: bool):
        """:meth:`_allreduce_fast` for a call the c10d adapter has already taken apart: it has
        checked the tensor (``tensors[0]``: CPU, strided, contiguous, no lazy bits, of a core
        dtype, aligned) and the options (no per-call timeout, an ``op`` that
        :func:`fast_op_table` allows for ``dtype``) in C++ and passes the numbers: the group's
        own state is all that is left to check here. Returns what :meth:`allreduce` would,
        or :data:`~.base.SLOW` (nothing done: the adapter then calls :meth:`allreduce`)."""
        if (self._pending and self._writing_back()) or self._closed or self._coalesced is not None:
            return SLOW
        comm = self._comm
        return self._fast_call("allreduce", tensors, lambda done: comm.allreduce(
            ptr, nbytes, numel, dtype, op, 1.0, None, done), async_op)

    def _can_stage_directly(self) -> bool:
        """Whether the c10d adapter may stage a synchronous call itself right now: the group
        is open and not coalescing, and no earlier asynchronous call of it has still to write
        into memory (the adapter's copy out would read a tensor before that write)."""
        if self._closed or self._coalesced is not None or (self._pending and self._writing_back()):
            return False
        if self._inflight:
            self._prune_inflight()
        return not self._inflight

    def _allreduce_staged(self, tensors, dtype: str, op: int, async_op: bool):
        """:meth:`allreduce` of a device tensor the c10d adapter has already checked in C++
        (``tensors[0]``: on an accelerator, strided, contiguous, no lazy bits, of a core dtype;
        no per-call timeout, an ``op`` that :func:`~flagos_shm.backend.options.fast_op_table`
        allows for ``dtype``): the same call as the full path's, without taking the options
        and the tensor apart again. Returns what :meth:`allreduce` would, or
        :data:`~.base.SLOW` while coalescing (the adapter then calls :meth:`allreduce`)."""
        if self._coalesced is not None:
            return SLOW
        name = "allreduce"
        with self._validating(name, (tensors,)):  # a staging failure reaches the peers too
            buf = staging.stage_device(tensors[0], dtype, read=True, write=True)
        comm = self._comm
        return self._run(name, tensors, [buf], [lambda done: comm.allreduce(
            buf.ptr, buf.nbytes, buf.numel, dtype, op, 1.0, None, done)], async_op=async_op)

    def allreduce_coalesced(self, tensors, opts=None) -> ShmWork:
        """Reduce each tensor of ``tensors`` (one dtype, any sizes) in place, as one core
        batch: one descriptor and a table of the tensors' sizes, then the tensors back to
        back through the shared slots (tensors above the core's ``COALESCE_MAX_BYTES`` run
        as their own collective within it).

        Raises:
            TypeError: tensors of different dtypes, or an op undefined for the dtype.
            ValueError: ranks whose batches differ (on every rank, naming the tensor).
        """
        name = "allreduce_coalesced"
        with self._validating(name, (tensors,)):
            a = self._args(opts, "op")
            tensors = options.tensor_list(tensors, "tensors")
            args = [f"tensors[{i}]" for i in range(len(tensors))]
            bufs = [staging.stage(t, arg, read=True, write=True) for t, arg in zip(tensors, args)]
            options.same_dtype(bufs, args)
            for buf, arg in zip(bufs, args):
                options.check_op(a.op, buf, arg)
        comm = self._comm
        return self._run(name, tensors, bufs, [lambda done: comm.allreduce_coalesced(
            [b.ptr for b in bufs], [b.nbytes for b in bufs], [b.numel for b in bufs], [b.dtype for b in bufs],
            a.op, a.factor, a.timeout_s, done)], opts)

    def reduce(self, tensors, opts=None, op=None, timeout=None) -> ShmWork:
        """Reduce every rank's ``tensors[0]`` into the root's ``tensors[0]`` (others unchanged).

        Args:
            opts: ``ReduceOptions`` (``reduceOp``, ``rootRank``), or the root rank followed by
                ``op`` (older overload).
        """
        name = "reduce"
        with self._validating(name, (tensors,)):
            a = self._args(opts, "root", op=op, timeout=timeout)
            buf = staging.stage(options.single(tensors, "tensors"), "tensors[0]", read=True, write=a.root == self._rank)
            options.check_op(a.op, buf, "tensors[0]")
        comm = self._comm
        return self._run(name, [buf.tensor], [buf], [lambda done: comm.reduce(
            buf.ptr, buf.nbytes, buf.numel, buf.dtype, a.op, a.root, a.factor, a.timeout_s, done)], opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None, timeout=None) -> ShmWork:
        """Reduce ``input_tensors[0][r]`` over all ranks into rank r's ``output_tensors[0]``.

        Args:
            output_tensors: ``[tensor]``; or a bare tensor with a flat input list (older overload,
                then ``opts`` may be a ``ReduceOp``).
            input_tensors: ``[[t_0, ..., t_{n-1}]]``: ``t_r`` holds rank r's part, with rank
                r's output element count; the counts may differ between ranks (as Gloo
                allows), but every rank must pass the same list of counts.

        Raises:
            ValueError: ``input_tensors[0][rank]`` does not have the output's element count;
                ranks whose lists of counts or dtypes differ (on every rank, naming
                ``input_tensors[0]`` and this rank's part sizes; the group stays usable).

        Uneven counts run as one coalesced allreduce of all n parts (each rank keeps its
        own): n times the bytes of an even reduce-scatter, for a call that is rare; the
        coalesced call's table makes ranks with different lists fail instead of mixing
        parts.
        """
        name = "reduce_scatter"
        with self._validating(name, (output_tensors, input_tensors)):
            if isinstance(output_tensors, torch.Tensor):
                output_tensors, input_tensors = [output_tensors], [input_tensors]
            a = self._args(opts, "op", timeout=timeout)
            out = staging.stage(options.single(output_tensors, "output_tensors"), "output_tensors[0]",
                                read=False, write=True)
            ins = options.tensor_list(options.single(input_tensors, "input_tensors"), "input_tensors[0]",
                                      self._world_size)
            options.check_list(ins, "input_tensors[0]", out, write=False)
            mine = ins[self._rank].numel()
            if mine != out.tensor.numel():
                raise ValueError(f"input_tensors[0][{self._rank}]: expected the output's {out.tensor.numel()} "
                                 f"elements (this rank's part), got {mine}")
            options.check_op(a.op, out, "output_tensors[0]")
        comm = self._comm
        # Even and uneven lists are different core calls: a rank whose list differs from
        # the others' is told so by the core in terms of those calls; name the argument.
        def where() -> str:
            return f"input_tensors[0] (parts of {[t.numel() for t in ins]} elements of {out.tensor.dtype} on this rank)"
        if any(t.numel() != mine for t in ins):
            return self._reduce_scatter_uneven(name, out, ins, a, opts, where)
        src = staging.pack(ins, out.tensor.numel())
        return self._run(name, [out.tensor], [out], [_naming(where, lambda done: comm.reduce_scatter(
            src.ptr, src.nbytes, out.ptr, out.nbytes, out.numel, out.dtype, a.op, a.factor, a.timeout_s, done))],
            opts)

    def _reduce_scatter_uneven(self, name, out, ins, a, opts, where: Callable[[], str]) -> ShmWork:
        """:meth:`reduce_scatter` with parts of different sizes: every part reduced by one
        ``allreduce_coalesced`` of copies of them (the caller's inputs stay unchanged), this
        rank's part then copied into ``out``."""
        parts = [staging.pack([t], t.numel()) for t in ins]
        comm, own = self._comm, parts[self._rank]
        return self._run(name, [out.tensor], [out], [_naming(where, lambda done: comm.allreduce_coalesced(
            [b.ptr for b in parts], [b.nbytes for b in parts], [b.numel for b in parts], [b.dtype for b in parts],
            a.op, a.factor, a.timeout_s, done))], opts, after=lambda: staging.copy_into(out.host, own.host))

    def reduce_scatter_single(self, output, input, opts=None) -> ShmWork:
        """Reduce ``input`` (``world_size * output.numel()`` elements) over all ranks; rank r
        receives the reduction of slice ``[r * numel, (r + 1) * numel)`` in ``output``."""
        done = self._reduce_scatter_single_fast(output, input, opts)
        if done is not SLOW:
            return done
        name = "reduce_scatter_single"
        with self._validating(name, (output, input)):
            a = self._args(opts, "op")
            out, inp = self._stage_pair(output, input, "output", "input")
            if inp.numel != self._world_size * out.numel:
                raise ValueError(f"input: expected world_size * output.numel() = {self._world_size} * "
                                 f"{output.numel()} elements, got {input.numel()}")
            options.check_op(a.op, out, "output")
        comm = self._comm
        return self._run(name, [output], [out], [lambda done: comm.reduce_scatter(
            inp.ptr, inp.nbytes, out.ptr, out.nbytes, out.numel, out.dtype, a.op, a.factor, a.timeout_s, done)], opts)


    def _reduce_scatter_single_fast(self, output, input, opts):
        """The common case of :meth:`reduce_scatter_single` (FSDP2's gradient
        reduce-scatter): two tensors that :func:`~.base.fast_dtype` takes, of one dtype,
        ``input`` exactly ``world_size`` times ``output`` and not overlapping it, exact
        ``ReduceScatterOptions`` with an op already accepted for that dtype (not
        PREMUL_SUM), no per-call timeout, nothing pending or coalescing, an open group.
        Returns what :meth:`reduce_scatter_single` would, or :data:`~.base.SLOW`."""
        dtype = self._fast_pair(opts, _REDUCE_SCATTER_OPTIONS, output, input)
        if dtype is None:
            return SLOW
        numel = output.numel()
        op, _ = options.reduce_op(opts.reduceOp)
        if op == options.PREMUL_SUM or (op, output.dtype) not in options._VALID_OP_DTYPES:
            return SLOW
        es = output.element_size()
        out_ptr, in_ptr = output.data_ptr(), input.data_ptr()
        if (in_ptr | out_ptr) % es:
            return SLOW  # not aligned to the element size: the full path stages them
        return self._reduce_scatter_single_digested(output, input, in_ptr, input.numel() * es, out_ptr, numel * es,
                                                    numel, dtype, op, opts.asyncOp)

    def _reduce_scatter_single_digested(self, output, input, in_ptr: int, in_bytes: int, out_ptr: int,
                                        out_bytes: int, numel: int, dtype: str, op: int, async_op: bool):
        """The common reduce-scatter once both tensors (CPU, strided, contiguous, no lazy bits,
        one core dtype, aligned; ``output`` not empty, of ``numel`` elements and ``out_bytes``
        bytes, ``input`` ``world_size`` times it) and the options (no per-call timeout, an
        ``op`` that :func:`~flagos_shm.backend.options.fast_op_table` allows for ``dtype``)
        are checked, by the c10d adapter in C++ (FSDP2's ``reduce_scatter_tensor``) or by
        :meth:`_reduce_scatter_single_fast`: overlap and the group's state are checked here.
        Returns what :meth:`reduce_scatter_single` would, or :data:`~.base.SLOW` (nothing
        done)."""
        if (self._pending and self._writing_back()) or self._closed or self._coalesced is not None:
            return SLOW
        if in_ptr < out_ptr + out_bytes and out_ptr < in_ptr + in_bytes:
            return SLOW  # overlapping: the full path copies the input first
        comm = self._comm
        return self._fast_call("reduce_scatter_single", [output], lambda done: comm.reduce_scatter(
            in_ptr, in_bytes, out_ptr, out_bytes, numel, dtype, op, 1.0, None, done), async_op, (input,))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None) -> ShmWork:
        """``reduce_scatter_single`` of each ``(outputs[i], inputs[i])`` pair, as one core
        batch (see :meth:`allreduce_coalesced`); pairs may differ in dtype.

        Raises:
            TypeError: a pair of different dtypes, or an op undefined for a pair's dtype.
            ValueError: ``inputs[i]`` not ``world_size`` times ``outputs[i]``, or ranks
                whose batches differ (on every rank).
        """
        name = "reduce_scatter_single_coalesced"
        with self._validating(name, (outputs, inputs)):
            a = self._args(opts, "op")
            pairs = self._stage_pairs(outputs, inputs)
            for i, (out, inp) in enumerate(pairs):
                if inp.numel != self._world_size * out.numel:
                    raise ValueError(f"inputs[{i}]: expected world_size * outputs[{i}].numel() = "
                                     f"{self._world_size * out.tensor.numel()} elements, got {inp.tensor.numel()}")
                options.check_op(a.op, out, f"outputs[{i}]")
        comm = self._comm
        return self._run(name, list(outputs), [out for out, _ in pairs], [lambda done: comm.reduce_scatter_coalesced(
            [i.ptr for _, i in pairs], [i.nbytes for _, i in pairs], [o.ptr for o, _ in pairs],
            [o.nbytes for o, _ in pairs], [o.numel for o, _ in pairs], [o.dtype for o, _ in pairs],
            a.op, a.factor, a.timeout_s, done)], opts)
