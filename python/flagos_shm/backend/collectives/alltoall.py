"""All-to-all: all_to_all_single (even and uneven splits) and alltoall of tensor lists."""

from __future__ import annotations

import torch

from ... import staging
from ...work import ShmWork
from .. import options
from .base import CollectiveBase


class AllToAll(CollectiveBase):
    """all_to_all_single, alltoall."""

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

    def _alltoall_padded(self, dst_parts: list, src_parts: list, a: options.Args) -> None:
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
        with self._validating(name, (output_tensors, input_tensors)):
            a = self._args(opts)
            ins = options.tensor_list(input_tensors, "input_tensors", self._world_size)
            outs = options.tensor_list(output_tensors, "output_tensors", self._world_size)
            first = staging.stage(ins[0], "input_tensors[0]")
            options.check_list(ins, "input_tensors", first, write=False)
            options.check_list(outs, "output_tensors", first, write=True)
        return self._run(name, outs, [], [lambda _: self._alltoall_padded(outs, ins, a)], can_async=False)
