"""Gathers: allgather in its list, single-tensor and coalesced forms, and gather to a root."""

from __future__ import annotations

import torch
from torch._C import _distributed_c10d as c10d

from ... import _core, staging
from ...work import ShmWork
from .. import options
from .base import SLOW, CollectiveBase

_ALLGATHER_OPTIONS = c10d.AllgatherOptions
_CORE_COMM = _core.Communicator


class Gathering(CollectiveBase):
    """allgather, all_gather_single, allgather_coalesced, all_gather_single_coalesced, gather."""

    def allgather(self, output_tensors, input_tensors, opts=None, timeout=None) -> ShmWork:
        """Gather every rank's ``input_tensors[0]`` into ``output_tensors[0][r]`` for each rank r.

        Args:
            output_tensors: ``[[t_0, ..., t_{n-1}]]`` of the input's dtype; ``t_r`` receives
                rank r's input, so ``t_rank`` has the input's element count. Ranks may
                contribute different element counts (padded internally).
            input_tensors: ``[tensor]``; or a bare tensor with a flat output list (older overload).
        """
        name = "allgather"
        with self._validating(name, (output_tensors, input_tensors)):
            if isinstance(input_tensors, torch.Tensor):
                output_tensors, input_tensors = [output_tensors], [input_tensors]
            a = self._args(opts, timeout=timeout)
            inp = staging.stage(options.single(input_tensors, "input_tensors"), "input_tensors[0]")
            outs = options.tensor_list(options.single(output_tensors, "output_tensors"), "output_tensors[0]",
                                       self._world_size)
            options.check_list(outs, "output_tensors[0]", inp, write=True)
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

    def all_gather_single(self, output, input, opts=None) -> ShmWork:
        """Gather every rank's ``input`` into ``output`` (``world_size * input.numel()``
        elements, rank r's data at ``[r * numel, (r + 1) * numel)`` of the flattened output)."""
        done = self._all_gather_single_fast(output, input, opts)
        if done is not SLOW:
            return done
        name = "all_gather_single"
        with self._validating(name, (output, input)):
            a = self._args(opts)
            out, inp = self._stage_pair(output, input, "output", "input", own_piece=True)
            if out.numel != self._world_size * inp.numel:
                raise ValueError(f"output: expected world_size * input.numel() = {self._world_size} * "
                                 f"{inp.tensor.numel()} elements, got {output.numel()}")
        comm = self._comm
        return self._run(name, [output], [out], [lambda done: comm.allgather(
            inp.ptr, inp.nbytes, out.ptr, out.nbytes, inp.numel, inp.dtype, a.timeout_s, done)], opts)


    def _all_gather_single_fast(self, output, input, opts):
        """The common case of :meth:`all_gather_single` (FSDP2's parameter all-gather): two
        tensors that :func:`~.base.fast_dtype` takes, of one dtype, ``output`` exactly
        ``world_size`` times ``input``, not overlapping it, or (on a single-node group)
        ``input`` exactly this rank's piece of ``output`` (in place, as
        :meth:`~.base.CollectiveBase._stage_pair` allows); exact ``AllgatherOptions``, no
        per-call timeout, nothing pending or coalescing, an open group. Returns what
        :meth:`all_gather_single` would, or :data:`~.base.SLOW` (nothing done)."""
        dtype = self._fast_pair(opts, _ALLGATHER_OPTIONS, input, output)
        if dtype is None:
            return SLOW
        numel, es = input.numel(), input.element_size()
        in_ptr, out_ptr = input.data_ptr(), output.data_ptr()
        if (in_ptr | out_ptr) % es:
            return SLOW  # not aligned to the element size: the full path stages them
        return self._all_gather_single_digested(output, input, in_ptr, numel * es, out_ptr, output.numel() * es,
                                                numel, dtype, opts.asyncOp)

    def _all_gather_single_digested(self, output, input, in_ptr: int, in_bytes: int, out_ptr: int, out_bytes: int,
                                    numel: int, dtype: str, async_op: bool):
        """The common all-gather once both tensors (CPU, strided, contiguous, no lazy bits, one
        core dtype, aligned; ``input`` not empty, ``output`` ``world_size`` times it) and the
        options (no per-call timeout) are checked, by the c10d adapter in C++ or by
        :meth:`_all_gather_single_fast`: overlap and the group's state are checked here. Returns
        what :meth:`all_gather_single` would, or :data:`~.base.SLOW` (nothing done)."""
        if (self._pending and self._writing_back()) or self._closed or self._coalesced is not None:
            return SLOW
        if (in_ptr < out_ptr + out_bytes and out_ptr < in_ptr + in_bytes
                and not (in_ptr == out_ptr + self._rank * in_bytes and type(self._comm) is _CORE_COMM)):
            return SLOW  # overlapping other than in place: the full path copies the input first
        comm = self._comm
        return self._fast_call("all_gather_single", [output], lambda done: comm.allgather(
            in_ptr, in_bytes, out_ptr, out_bytes, numel, dtype, None, done), async_op, (input,))

    def allgather_coalesced(self, output_lists, input_list, opts=None) -> ShmWork:
        """Gather each ``input_list[i]`` of every rank: ``output_lists[r][i]`` receives rank
        r's ``input_list[i]`` (torch's layout: ``world_size`` lists of ``len(input_list)``
        tensors). One core batch (see :meth:`all_gather_single_coalesced`)."""
        name = "allgather_coalesced"
        with self._validating(name, (output_lists, input_list)):
            a = self._args(opts)
            inputs = options.tensor_list(input_list, "input_list")
            output_lists = options.tensor_list(output_lists, "output_lists", self._world_size)
            rows = [options.tensor_list(row, f"output_lists[{r}]", len(inputs)) for r, row in enumerate(output_lists)]
            jobs = []
            for i, t in enumerate(inputs):
                inp = staging.stage(t, f"input_list[{i}]")
                outs = [row[i] for row in rows]
                options.check_list(outs, f"output_lists[*][{i}]", inp, write=True)
                if any(o.numel() != t.numel() for o in outs):
                    raise ValueError(f"output_lists[r][{i}]: every rank's tensor must have input_list[{i}]'s "
                                     f"{t.numel()} elements")
                jobs.append((outs, inp))
        comm, n = self._comm, self._world_size
        ins = [inp for _, inp in jobs]
        dsts = [staging.scratch(n * inp.tensor.numel(), inp.torch_dtype) for inp in ins]

        def after():
            for (outs, inp), dst in zip(jobs, dsts):
                staging.unpack(dst, outs, inp.tensor.numel())
        return self._run(name, [o for row in rows for o in row], [], [lambda done: comm.allgather_coalesced(
            [i.ptr for i in ins], [i.nbytes for i in ins], [d.ptr for d in dsts], [d.nbytes for d in dsts],
            [i.numel for i in ins], [i.dtype for i in ins], a.timeout_s, done)], opts, after=after)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> ShmWork:
        """``all_gather_single`` of each ``(outputs[i], inputs[i])`` pair, as one core batch:
        one descriptor and a table of the tensors' sizes, then the tensors back to back
        through the shared slots (tensors above the core's ``COALESCE_MAX_BYTES`` run as
        their own collective within it). Pairs may differ in dtype.

        Raises:
            TypeError: a pair of different dtypes.
            ValueError: ``outputs[i]`` not ``world_size`` times ``inputs[i]``, or ranks whose
                batches differ (on every rank, naming the tensor).
        """
        name = "all_gather_single_coalesced"
        with self._validating(name, (outputs, inputs)):
            a = self._args(opts)
            pairs = self._stage_pairs(outputs, inputs)
            for i, (out, inp) in enumerate(pairs):
                if out.numel != self._world_size * inp.numel:
                    raise ValueError(f"outputs[{i}]: expected world_size * inputs[{i}].numel() = "
                                     f"{self._world_size * inp.tensor.numel()} elements, got {out.tensor.numel()}")
        comm = self._comm
        return self._run(name, list(outputs), [out for out, _ in pairs], [lambda done: comm.allgather_coalesced(
            [i.ptr for _, i in pairs], [i.nbytes for _, i in pairs], [o.ptr for o, _ in pairs],
            [o.nbytes for o, _ in pairs], [i.numel for _, i in pairs], [i.dtype for _, i in pairs],
            a.timeout_s, done)], opts)


    def gather(self, output_tensors, input_tensors, opts=None, timeout=None) -> ShmWork:
        """Gather every rank's ``input_tensors[0]`` into the root's ``output_tensors[0][r]``.

        Args:
            output_tensors: on the root ``[[t_0, ..., t_{n-1}]]`` (each of the input's element
                count and dtype); elsewhere ``[]`` (or ``[[]]``).
            input_tensors: ``[tensor]``; or a bare tensor with a flat output list followed by
                the root rank (older overload).
        """
        name = "gather"
        with self._validating(name, (output_tensors, input_tensors)):
            if isinstance(input_tensors, torch.Tensor):
                output_tensors, input_tensors = ([output_tensors] if output_tensors else []), [input_tensors]
            a = self._args(opts, "root", timeout=timeout)
            inp = staging.stage(options.single(input_tensors, "input_tensors"), "input_tensors[0]")
            outs = self._root_list(output_tensors, "output_tensors", a.root, inp, write=True)
        comm, count = self._comm, inp.tensor.numel()
        dst = staging.scratch(self._world_size * count, inp.torch_dtype) if outs else None
        return self._run(name, outs, [], [lambda done: comm.gather(
            inp.ptr, inp.nbytes, dst.ptr if outs else 0, dst.nbytes if outs else 0,
            inp.numel, inp.dtype, a.root, a.timeout_s, done)],
            opts, after=(lambda: staging.unpack(dst, outs, count)) if outs else None)
