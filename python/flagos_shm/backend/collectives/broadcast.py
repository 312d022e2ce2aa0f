"""One-to-all: broadcast and scatter from a root."""

from __future__ import annotations

import torch
from torch._C import _distributed_c10d as c10d

from ... import staging
from ...work import ShmWork
from .. import options
from .base import SLOW, CollectiveBase, fast_dtype

_BROADCAST_OPTIONS = c10d.BroadcastOptions
_UNSET_TIMEOUT = options._UNSET_TIMEOUT


class OneToAll(CollectiveBase):
    """broadcast, scatter."""

    def broadcast(self, tensors, opts=None, timeout=None) -> ShmWork:
        """Copy the root's ``tensors[0]`` into every rank's ``tensors[0]``.

        Args:
            tensors: a list with one tensor, or a tensor.
            opts: ``BroadcastOptions`` (``rootRank``; ``rootTensor`` must be 0), or the root
                rank (older overload).
        """
        if timeout is None:
            done = self._broadcast_fast(tensors, opts)
            if done is not SLOW:
                return done
        name = "broadcast"
        with self._validating(name, (tensors,)):
            a = self._args(opts, "root", timeout=timeout)
            is_root = a.root == self._rank
            buf = staging.stage(options.single(tensors, "tensors"), "tensors[0]", read=is_root, write=not is_root)
        comm = self._comm
        return self._run(name, [buf.tensor], [buf], [lambda done: comm.broadcast(
            buf.ptr, buf.nbytes, buf.numel, buf.dtype, a.root, a.timeout_s, done)], opts)

    def _broadcast_fast(self, tensors, opts):
        """The common case of :meth:`broadcast`: a list of one tensor that
        :func:`~.base.fast_dtype` takes, exact ``BroadcastOptions`` with ``rootTensor`` 0 and
        a root in the group, no per-call timeout, nothing pending or coalescing, an open
        group. Returns what :meth:`broadcast` would, or :data:`~.base.SLOW` (nothing done)."""
        if type(tensors) is not list or len(tensors) != 1 or type(opts) is not _BROADCAST_OPTIONS:
            return SLOW
        t = tensors[0]
        dtype = fast_dtype(t)
        if dtype is None or opts.rootTensor != 0 or opts.timeout != _UNSET_TIMEOUT:
            return SLOW
        ptr, es = t.data_ptr(), t.element_size()
        if ptr % es:
            return SLOW  # not aligned to its element size: the full path stages it
        numel = t.numel()
        return self._broadcast_digested(tensors, ptr, numel * es, numel, dtype, opts.rootRank, opts.asyncOp)

    def _broadcast_digested(self, tensors, ptr: int, nbytes: int, numel: int, dtype: str, root: int, async_op: bool):
        """The common broadcast once the tensor (``tensors[0]``: CPU, strided, contiguous, no
        lazy bits, of a core dtype, aligned) and the options (``rootTensor`` 0, no per-call
        timeout) are checked, by the c10d adapter in C++ or by :meth:`_broadcast_fast`: the
        root and the group's state are checked here, then the core is called. Returns what
        :meth:`broadcast` would, or :data:`~.base.SLOW` (nothing done: the caller then takes
        the full path of :meth:`broadcast`)."""
        if ((self._pending and self._writing_back()) or self._closed or self._coalesced is not None
                or not 0 <= root < self._world_size):
            return SLOW
        comm = self._comm
        return self._fast_call("broadcast", tensors, lambda done: comm.broadcast(
            ptr, nbytes, numel, dtype, root, None, done), async_op)

    def scatter(self, output_tensors, input_tensors, opts=None, timeout=None) -> ShmWork:
        """Copy the root's ``input_tensors[0][r]`` into rank r's ``output_tensors[0]``.

        Args:
            output_tensors: ``[tensor]``; or a bare tensor with a flat input list followed by the
                root rank (older overload).
            input_tensors: on the root ``[[t_0, ..., t_{n-1}]]`` (each of the output's element
                count and dtype); elsewhere ``[]`` (or ``[[]]``).
        """
        name = "scatter"
        with self._validating(name, (output_tensors, input_tensors)):
            if isinstance(output_tensors, torch.Tensor):
                output_tensors, input_tensors = [output_tensors], ([input_tensors] if input_tensors else [])
            a = self._args(opts, "root", timeout=timeout)
            out = staging.stage(options.single(output_tensors, "output_tensors"), "output_tensors[0]",
                                read=False, write=True)
            ins = self._root_list(input_tensors, "input_tensors", a.root, out, write=False)
        comm = self._comm
        src = staging.pack(ins, out.tensor.numel()) if ins else None
        return self._run(name, [out.tensor], [out], [lambda done: comm.scatter(
            src.ptr if ins else 0, src.nbytes if ins else 0, out.ptr, out.nbytes,
            out.numel, out.dtype, a.root, a.timeout_s, done)], opts)
