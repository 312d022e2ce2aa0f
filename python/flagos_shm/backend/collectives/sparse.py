"""Sparse allreduce (COO tensors, SUM), as Gloo does it.

Every rank's indices and values are gathered (an allgather of the shapes and ``nnz`` first,
then of the indices and values padded to the largest ``nnz``), the gathered entries are
concatenated in rank order and coalesced (duplicates summed), and the result is copied into
the caller's tensor (``copy_`` replaces its indices and values). Every rank coalesces the
same entries in the same order, so every rank's result is bitwise identical.

torch calls ``allreduce_sparse`` for a sparse tensor; a sparse tensor passed to
``allreduce`` (:class:`~.reduction.Reduction`) is sent here too.
"""

from __future__ import annotations

import torch

from ... import staging
from ...work import ShmWork
from .. import options
from .base import CollectiveBase

__all__ = ["SparseReduction"]

_MAX_DIMS = 16  # dimensions of a sparse tensor's shape carried in the first gather
_DTYPES = (*staging.CORE_DTYPES, torch.complex32, torch.complex64, torch.complex128)  # codes in the first gather


class SparseReduction(CollectiveBase):
    """allreduce of sparse COO tensors (SUM)."""

    def allreduce_sparse(self, tensors, opts=None) -> ShmWork:
        """Sum the sparse COO ``tensors[0]`` across the group, in place.

        Raises:
            ValueError: an op other than SUM, ranks whose tensors differ in shape, sparse
                or dense dimensions, or dtype (on every rank);
            TypeError: not a sparse COO tensor, or an unsupported dtype.
        """
        name = "allreduce_sparse"
        with self._validating(name, (tensors,)):
            if isinstance(tensors, (list, tuple)):
                if len(tensors) != 1:
                    raise ValueError(f"tensors: expected a list of 1 sparse tensor, got {len(tensors)}")
                tensor = tensors[0]
            else:
                tensor = tensors
            if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
                layout = getattr(tensor, "layout", type(tensor).__name__)
                raise TypeError(f"tensors[0]: expected a sparse COO tensor, got {layout}")
            a = self._args(opts, "op")
            if a.op != options.SUM:
                raise ValueError("flagos_shm sparse allreduce supports only ReduceOp.SUM (as Gloo)")
            staging.core_dtype(tensor.dtype, "tensors[0]")
            if tensor.dim() > _MAX_DIMS:
                raise ValueError(f"tensors[0]: at most {_MAX_DIMS} dimensions, got {tensor.dim()}")
        try:
            result = self._sparse_sum(tensor, a.timeout_s)
            with torch.no_grad():
                tensor.copy_(result.to(tensor.device))
        except Exception as exc:
            return ShmWork([tensor], self._error(name, exc))
        return ShmWork([tensor])

    def _gather(self, t: torch.Tensor, timeout_s) -> torch.Tensor:
        """Allgather of a contiguous CPU tensor of equal size on every rank: ``[n, *t.shape]``."""
        src = staging.stage(t.contiguous(), "sparse part")
        out = torch.empty((self._world_size, *t.shape), dtype=t.dtype)
        dst = staging.stage(out, "sparse part")
        with self._gate:
            self._comm.allgather(src.ptr, src.nbytes, dst.ptr, dst.nbytes, src.numel, src.dtype, timeout_s, None)
        return out

    def _sparse_sum(self, tensor: torch.Tensor, timeout_s) -> torch.Tensor:
        cpu = tensor.detach().cpu()
        indices, values = cpu._indices().contiguous(), cpu._values().contiguous()
        nnz = indices.shape[1]
        shape = list(cpu.shape) + [0] * (_MAX_DIMS - cpu.dim())
        dtype_code = _DTYPES.index(cpu.dtype)
        meta = torch.tensor([nnz, cpu.sparse_dim(), cpu.dense_dim(), cpu.dim(), dtype_code] + shape, dtype=torch.int64)
        metas = self._gather(meta, timeout_s)
        first = metas[0, 1:]
        for r in range(self._world_size):
            if not torch.equal(metas[r, 1:], first):
                def describe(m):
                    return (f"shape {m[5:5 + int(m[3])].tolist()}, sparse_dim {int(m[1])}, dense_dim {int(m[2])}, "
                            f"dtype {_DTYPES[int(m[4])]}")
                raise ValueError(f"ranks disagree on the sparse tensor: rank 0 has {describe(metas[0])}, "
                                 f"rank {r} has {describe(metas[r])}")
        counts = metas[:, 0].tolist()
        top = max(counts)
        dense_shape = tuple(values.shape[1:])
        if top == 0:
            return torch.sparse_coo_tensor(indices, values, cpu.shape).coalesce()
        pad_i = torch.zeros((indices.shape[0], top), dtype=torch.int64)
        pad_i[:, :nnz] = indices
        pad_v = torch.zeros((top, *dense_shape), dtype=values.dtype)
        pad_v[:nnz] = values
        all_i = self._gather(pad_i, timeout_s)
        all_v = self._gather(pad_v, timeout_s)
        cat_i = torch.cat([all_i[r, :, :c] for r, c in enumerate(counts)], dim=1)
        cat_v = torch.cat([all_v[r, :c] for r, c in enumerate(counts)], dim=0)
        return torch.sparse_coo_tensor(cat_i, cat_v, cpu.shape).coalesce()
