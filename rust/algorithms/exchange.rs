//! Reduce-scatter and alltoall through the slots: each rank copies the chunk of each of
//! its n - 1 peers' pieces in; rank r reduces (alltoall: copies) piece r from every peer's
//! slot and its own input.

use super::{chunks, CMA_CHUNK_BYTES};
use crate::cma;
use crate::desc::{Kind, Transfer};
use crate::error::Result;
use crate::group::Communicator;
use crate::reduce::{reduce_raw, DType, ReduceOp, Reduction};
use std::ptr::copy_nonoverlapping;

impl Communicator {
    /// Shared body of reduce-scatter (`red = Some`) and alltoall (`red = None`): `input`
    /// holds n pieces of `count` elements; reduce-scatter writes the reduction of every
    /// rank's piece `rank` into `output` (`count` elements), alltoall writes rank q's piece
    /// `rank` to `output[q * count ..]` (`n * count` elements).
    ///
    /// # Safety
    /// `input` readable for `n * count` aligned elements of `dtype`, `output` writable for
    /// the elements above; they do not overlap and nothing else accesses them during the
    /// call.
    unsafe fn exchange(&mut self, input: *const u8, output: *mut u8, count: usize, dtype: DType, red: Option<Reduction>) -> Result<()> {
        let kind = if red.is_some() { Kind::ReduceScatter } else { Kind::Alltoall };
        let mut d = self.begin(kind, dtype, red.as_ref(), count, 0)?;
        let es = dtype.size();
        if self.n == 1 {
            // Alone (see `algorithms`): the one piece of `input` is the result.
            // SAFETY: `input` readable and `output` writable for `count` elements, apart
            // (the contract).
            unsafe {
                match &red {
                    Some(red) => reduce_raw(red, output, &[input], count),
                    None => cma::copy_local(input, output, count * es, false, self.streams_local(count * es)),
                }
            }
            return Ok(());
        }
        if let Some(red) = red.as_ref().filter(|_| self.single_copy(Kind::ReduceScatter, self.n * count * es)) {
            d.route(Transfer::SingleCopy, CMA_CHUNK_BYTES);
            // SAFETY: forwarded from this function's contract.
            return unsafe { self.reduce_scatter_single_copy(input, output, count, red, &d) };
        }
        if red.is_none() && self.single_copy(Kind::Alltoall, self.n * count * es) {
            d.route(Transfer::SingleCopy, count * es);
            // SAFETY: forwarded from this function's contract.
            return unsafe { self.alltoall_single_copy(input, output, count, es, &d) };
        }
        let per = self.seg.slot_bytes() / es / self.n;
        d.route(Transfer::Slots, per * es);
        let mut srcs = vec![std::ptr::null::<u8>(); self.n];
        for ch in chunks(count, per) {
            let (off, len) = (ch.off, ch.len);
            let p = self.next_parity();
            // Our own piece never goes through the slot: the peers do not read it, and we
            // read it where it lies (docs/design.md, "A rank's own data stays where it lies").
            let me = self.rank;
            for q in (0..self.n).filter(|&q| q != me) {
                // SAFETY: n * len * es <= slot_bytes; source inside `input`.
                unsafe { self.to_slot(self.slot(self.rank, p).add(q * len * es), input.add((q * count + off) * es), len * es) };
            }
            self.sync(ch.first().then_some(&d))?;
            for (q, s) in srcs.iter_mut().enumerate() {
                // SAFETY: (rank + 1) * len * es <= slot_bytes; off + len <= count, so our
                // own piece's chunk lies inside `input`.
                *s = unsafe {
                    if q == self.rank {
                        input.add((q * count + off) * es)
                    } else {
                        self.slot(q, p).add(self.rank * len * es)
                    }
                };
            }
            match &red {
                // SAFETY: every peer slot of step p is published, our own source is the
                // caller's input; the output range is inside `output`, which overlaps none
                // of the sources.
                Some(red) => unsafe { reduce_raw(red, output.add(off * es), &srcs, len) },
                None => {
                    for (q, s) in srcs.iter().enumerate() {
                        // SAFETY: as above.
                        unsafe { copy_nonoverlapping(*s, output.add((q * count + off) * es), len * es) };
                    }
                }
            }
        }
        Ok(())
    }

    /// Reduce-scatter: `input` holds `n * count` elements; `output` (`count` elements)
    /// receives the reduction over ranks of piece `rank`.
    ///
    /// # Safety
    /// As [`Self::exchange`].
    pub(crate) unsafe fn reduce_scatter_ptrs(
        &mut self,
        input: *const u8,
        output: *mut u8,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        factor: f64,
    ) -> Result<()> {
        let red = self.reduction(dtype, op, factor)?;
        // SAFETY: forwarded.
        unsafe { self.exchange(input, output, count, dtype, Some(red)) }
    }

    /// All-to-all: `input` and `output` hold `n * count` elements each; piece q of this
    /// rank's input goes to rank q, and rank q's piece `rank` lands in output piece q.
    ///
    /// # Safety
    /// As [`Self::exchange`].
    pub(crate) unsafe fn alltoall_ptrs(&mut self, input: *const u8, output: *mut u8, count: usize, dtype: DType) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.exchange(input, output, count, dtype, None) }
    }
}
