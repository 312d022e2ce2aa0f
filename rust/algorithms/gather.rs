//! Allgather, gather and scatter through the slots: every rank (scatter: the root) copies
//! its chunk in; all ranks (gather: the root; scatter: each its own piece) copy out.

use super::chunks;
use crate::cma;
use crate::desc::{Kind, Transfer};
use crate::error::Result;
use crate::group::Communicator;
use crate::reduce::DType;
use std::ptr::copy_nonoverlapping;

impl Communicator {
    /// Allgather: `input` holds `count` elements; `output` receives `n * count`, rank r's
    /// at `[r * count, (r + 1) * count)`. `input` may be rank `rank`'s part of `output`.
    /// With `root = Some(q)` this is gather: only rank q's `output` is written (others may
    /// pass null).
    ///
    /// # Safety
    /// `input` readable for `count` aligned elements of `dtype`; `output` (every rank for
    /// allgather, the root for gather) writable for `n * count`; neither accessed by
    /// anything else during the call.
    unsafe fn gather_impl(&mut self, input: *const u8, output: *mut u8, count: usize, dtype: DType, root: Option<usize>) -> Result<()> {
        if let Some(q) = root {
            self.check_root(q)?;
        }
        let kind = if root.is_some() { Kind::Gather } else { Kind::Allgather };
        let mut d = self.begin(kind, dtype, None, count, root.unwrap_or(0))?;
        let es = dtype.size();
        if self.n == 1 {
            // Alone (see `algorithms`): this rank's piece is the whole output (the root's,
            // for gather: rank 0, the only one `check_root` accepts).
            // SAFETY: `input` readable and `output` writable for `count` elements (the
            // contract); `copy_local` allows them equal (in place) or overlapping.
            unsafe { cma::copy_local(input, output, count * es, false, self.streams_local(count * es)) };
            return Ok(());
        }
        if root.is_none() && self.single_copy(Kind::Allgather, self.n * count * es) {
            d.route(Transfer::SingleCopy, count * es);
            // SAFETY: forwarded from this function's contract.
            return unsafe { self.allgather_single_copy(input, output, count * es, &d) };
        }
        let per = self.seg.slot_bytes() / es;
        d.route(Transfer::Slots, per * es);
        for ch in chunks(count, per) {
            let p = self.next_parity();
            let at = |c: &Self, r| c.slot_at(r, p, ch.len * es); // the call's place (`rotation`)
                                                                 // SAFETY: range inside the caller's input; len * es <= slot_bytes, so the
                                                                 // destination lies in our slot.
            unsafe { self.to_slot(at(self, self.rank), input.add(ch.off * es), ch.len * es) };
            self.sync(ch.first().then_some(&d))?;
            if root.is_none_or(|q| q == self.rank) {
                for r in 0..self.n {
                    // SAFETY: the destination range lies in `output` (n * count elements).
                    let dst = unsafe { output.add((r * count + ch.off) * es) };
                    if r == self.rank {
                        let src = input.wrapping_add(ch.off * es);
                        if !std::ptr::eq(dst, src) {
                            // Our own piece comes from where it lies, not back from our slot.
                            // SAFETY: the source range is inside `input`; the destination
                            // overlaps it only when equal (the contract), excluded here.
                            unsafe { copy_nonoverlapping(src, dst, ch.len * es) };
                        } // else in place (FSDP's all-gather): our piece is already there
                        continue;
                    }
                    // SAFETY: rank r's slot of step p was published by the sync; the
                    // destination, in rank r's piece of `output`, does not overlap `input`.
                    unsafe { copy_nonoverlapping(at(self, r), dst, ch.len * es) };
                }
            }
        }
        Ok(())
    }

    /// Allgather; see [`Self::gather_impl`].
    ///
    /// # Safety
    /// As [`Self::gather_impl`].
    pub(crate) unsafe fn allgather_ptrs(&mut self, input: *const u8, output: *mut u8, count: usize, dtype: DType) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.gather_impl(input, output, count, dtype, None) }
    }

    /// Gather to `root`; see [`Self::gather_impl`].
    ///
    /// # Safety
    /// As [`Self::gather_impl`].
    pub(crate) unsafe fn gather_ptrs(&mut self, input: *const u8, output: *mut u8, count: usize, dtype: DType, root: usize) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.gather_impl(input, output, count, dtype, Some(root)) }
    }

    /// Scatter from `root`: the root's `input` holds `n * count` elements; rank r receives
    /// `[r * count, (r + 1) * count)` in `output` (`count` elements). Non-roots may pass a
    /// null `input`.
    ///
    /// # Safety
    /// The root's `input` readable for `n * count` aligned elements of `dtype`; `output`
    /// writable for `count`; neither accessed by anything else during the call.
    pub(crate) unsafe fn scatter_ptrs(&mut self, input: *const u8, output: *mut u8, count: usize, dtype: DType, root: usize) -> Result<()> {
        self.check_root(root)?;
        let mut d = self.begin(Kind::Scatter, dtype, None, count, root)?;
        let es = dtype.size();
        if self.n == 1 {
            // Alone (see `algorithms`): this rank is the root; its one piece is its output.
            // SAFETY: the root's `input` readable and `output` writable for `count`
            // elements (the contract); `copy_local` allows any overlap.
            unsafe { cma::copy_local(input, output, count * es, false, self.streams_local(count * es)) };
            return Ok(());
        }
        let per = self.seg.slot_bytes() / es / self.n;
        d.route(Transfer::Slots, per * es);
        for ch in chunks(count, per) {
            let (off, len) = (ch.off, ch.len);
            let p = self.next_parity();
            if self.rank == root {
                for r in 0..self.n {
                    // SAFETY: n * len * es <= slot_bytes; source inside the root's input.
                    unsafe { self.to_slot(self.slot(root, p).add(r * len * es), input.add((r * count + off) * es), len * es) };
                }
            }
            self.sync(ch.first().then_some(&d))?;
            // SAFETY: the root's slot of step p was published by the sync above; the
            // destination is inside `output`.
            unsafe { std::ptr::copy(self.slot(root, p).add(self.rank * len * es), output.add(off * es), len * es) };
        }
        Ok(())
    }
}
