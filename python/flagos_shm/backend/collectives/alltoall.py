"""All-to-all: all_to_all_single (even and uneven splits) and alltoall of tensor lists.

Uneven splits and lists of pieces of any sizes are one core collective, ``alltoallv``: the
per-peer element counts travel in its first step, where every rank checks that what each
rank sends a peer is what that peer expects (ValueError on every rank otherwise, before any
data moves), so it runs asynchronously like every other collective.
"""

from __future__ import annotations

import torch
from torch._C import _distributed_c10d as c10d

from ... import staging
from ...work import ShmWork
from .. import options
from .base import SLOW, CollectiveBase, fast_dtype

_ALLTOALL_OPTIONS = c10d.AllToAllOptions
_UNSET_TIMEOUT = options._UNSET_TIMEOUT


def _per_value(dtype: torch.dtype) -> int:
    """Core elements per tensor element (a complex value travels as 2 reals)."""
    return 2 if dtype.is_complex else 1


class AllToAll(CollectiveBase):
    """all_to_all_single, alltoall."""

    def all_to_all_single(self, output, input, output_split_sizes=(), input_split_sizes=(),
                          opts=None) -> ShmWork:
        """Send slice r of ``input`` to rank r; receive rank r's slice into slice r of ``output``.

        Args:
            output, input: tensors of one dtype, split along dim 0.
            output_split_sizes, input_split_sizes: rows per rank along dim 0. Both empty means
                equal splits (dim 0 of both divisible by world size, same element count).
                Otherwise (one may be empty: an equal split of its tensor) the rows of each
                piece may differ; what rank p sends rank q must be what q expects from p
                (ValueError on every rank otherwise, naming the pair).

        Raises:
            ValueError: shapes or split sizes that do not fit the tensors, or split sizes
                that disagree between ranks (on every rank; the group stays usable).
            TypeError: unsupported or different dtypes.
        """
        if not output_split_sizes and not input_split_sizes:
            done = self._all_to_all_single_fast(output, input, opts)
            if done is not SLOW:
                return done
        name = "all_to_all_single"
        with self._validating(name, (output, input)):
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
                row = input.shape[1:].numel() * _per_value(input.dtype)
                send = [r * row for r in self._splits(input_split_sizes, input, "input_split_sizes")]
                recv = [r * row for r in self._splits(output_split_sizes, output, "output_split_sizes")]
        comm = self._comm
        if uniform:
            return self._run(name, [output], [out], [lambda done: comm.alltoall(
                inp.ptr, inp.nbytes, out.ptr, out.nbytes, inp.numel // n, inp.dtype, a.timeout_s, done)], opts)
        return self._run(name, [output], [out], [lambda done: comm.alltoallv(
            inp.ptr, inp.nbytes, out.ptr, out.nbytes, send, recv, inp.dtype, a.timeout_s, done)], opts)

    def _all_to_all_single_fast(self, output, input, opts):
        """The common case of :meth:`all_to_all_single` without split sizes (MoE token
        dispatch, torch's ``dist.all_to_all_single(out, inp)``): two tensors that
        :func:`~.base.fast_dtype` takes, of one dtype and element count, not empty, with
        dim 0 divisible by the world size, not overlapping, at addresses aligned to the
        element size; exact ``AllToAllOptions`` without a per-call timeout, nothing
        pending or coalescing, an open group. The same checks as the full path, spelled
        out for this case; returns what :meth:`all_to_all_single` would, or
        :data:`~.base.SLOW` (nothing done) for any other call (which the full path then
        checks, stages or refuses)."""
        if type(opts) is not _ALLTOALL_OPTIONS:
            return SLOW
        dtype = fast_dtype(input)
        if dtype is None or fast_dtype(output) is None or output.dtype != input.dtype or opts.timeout != _UNSET_TIMEOUT:
            return SLOW
        n, numel = self._world_size, input.numel()
        if numel == 0 or output.numel() != numel or input.dim() == 0 or output.dim() == 0 \
                or input.shape[0] % n or output.shape[0] % n:
            return SLOW
        es = input.element_size()
        in_ptr, out_ptr = input.data_ptr(), output.data_ptr()
        if (in_ptr | out_ptr) % es:
            return SLOW  # not aligned to the element size: the full path stages them
        return self._all_to_all_single_digested(output, input, in_ptr, out_ptr, numel * es, numel // n, dtype,
                                                opts.asyncOp)

    def _all_to_all_single_digested(self, output, input, in_ptr: int, out_ptr: int, nbytes: int, count: int,
                                    dtype: str, async_op: bool):
        """The common all-to-all once both tensors (CPU, strided, contiguous, no lazy bits, one
        core dtype, aligned, of ``nbytes`` each, not empty, dim 0 divisible by the world size)
        and the options (no split sizes, no per-call timeout) are checked, by the c10d adapter
        in C++ or by :meth:`_all_to_all_single_fast`; ``count`` is the elements per peer.
        Overlap and the group's state are checked here. Returns what
        :meth:`all_to_all_single` would, or :data:`~.base.SLOW` (nothing done)."""
        if ((self._pending and self._writing_back()) or self._closed or self._coalesced is not None
                or (in_ptr < out_ptr + nbytes and out_ptr < in_ptr + nbytes)):
            return SLOW  # overlapping: the full path copies the input first
        comm = self._comm
        return self._fast_call("all_to_all_single", [output], lambda done: comm.alltoall(
            in_ptr, nbytes, out_ptr, nbytes, count, dtype, None, done), async_op, (input,))

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

    def alltoall(self, output_tensors, input_tensors, opts=None) -> ShmWork:
        """Send ``input_tensors[r]`` to rank r and receive rank r's piece into ``output_tensors[r]``.

        Args:
            output_tensors, input_tensors: ``world_size`` tensors each, of one dtype; pieces
                may differ in size (and shape): ``output_tensors[q]`` on rank p must have as
                many elements as ``input_tensors[p]`` on rank q.

        The pieces are packed into one host buffer, exchanged by one core ``alltoallv``
        and unpacked (asynchronously with ``async_op=True``).

        Raises:
            ValueError: lists of the wrong length, or sizes that disagree between ranks (on
                every rank, naming the pair; the group stays usable).
            TypeError: unsupported or different dtypes.
        """
        name = "alltoall"
        with self._validating(name, (output_tensors, input_tensors)):
            a = self._args(opts)
            ins = options.tensor_list(input_tensors, "input_tensors", self._world_size)
            outs = options.tensor_list(output_tensors, "output_tensors", self._world_size)
            first = staging.stage(ins[0], "input_tensors[0]")
            options.check_list(ins, "input_tensors", first, write=False)
            options.check_list(outs, "output_tensors", first, write=True)
            per = _per_value(first.torch_dtype)
            send, recv = [t.numel() * per for t in ins], [t.numel() * per for t in outs]
        comm = self._comm
        src = staging.concat(ins, first.torch_dtype)
        dst = staging.scratch(sum(t.numel() for t in outs), first.torch_dtype)
        return self._run(name, outs, [], [lambda done: comm.alltoallv(
            src.ptr, src.nbytes, dst.ptr, dst.nbytes, send, recv, src.dtype, a.timeout_s, done)],
            opts, after=lambda: staging.split_into(dst, outs))
