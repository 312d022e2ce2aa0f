//! Broadcast and reduce through the slots: the root copies in and the others copy out
//! (broadcast), or every rank but the root copies in and the root reduces them with its
//! own buffer (reduce), one chunk per step.

use super::chunks;
use crate::desc::{Kind, Transfer};
use crate::error::Result;
use crate::group::Communicator;
use crate::reduce::{reduce_raw, DType, ReduceOp};
use std::ptr::copy_nonoverlapping;

impl Communicator {
    /// In-place broadcast of `count` elements at `buf` from group rank `root`.
    ///
    /// # Safety
    /// `buf`: `count` aligned elements of `dtype`, readable on the root and writable
    /// elsewhere, not accessed by anything else during the call.
    pub(crate) unsafe fn broadcast_ptrs(&mut self, buf: *mut u8, count: usize, dtype: DType, root: usize) -> Result<()> {
        self.check_root(root)?;
        let mut d = self.begin(Kind::Broadcast, dtype, None, count, root)?;
        if self.n == 1 {
            return Ok(()); // alone (see `algorithms`): the root's buffer is the result
        }
        let es = dtype.size();
        if self.single_copy(Kind::Broadcast, count * es) {
            d.route(Transfer::SingleCopy, count * es);
            // SAFETY: forwarded from this function's contract.
            return unsafe { self.broadcast_single_copy(buf, count * es, root, &d) };
        }
        let per = self.seg.slot_bytes() / es;
        d.route(Transfer::Slots, per * es);
        for ch in chunks(count, per) {
            let p = self.next_parity();
            if self.rank == root {
                // SAFETY: range inside the caller's buffer; len * es <= slot_bytes, so the
                // destination lies in our slot at the call's place.
                unsafe { self.to_slot(self.slot_at(root, p, ch.len * es), buf.add(ch.off * es), ch.len * es) };
            }
            self.sync(ch.first().then_some(&d))?;
            if self.rank != root {
                // SAFETY: the root's slot of step p was published by the sync above; the
                // destination range is inside the caller's buffer.
                unsafe { copy_nonoverlapping(self.slot_at(root, p, ch.len * es), buf.add(ch.off * es), ch.len * es) };
            }
        }
        Ok(())
    }

    /// In-place reduce of `count` elements at `buf` to group rank `root`; only the root's
    /// buffer is written.
    ///
    /// # Safety
    /// `buf`: `count` aligned elements of `dtype`, readable everywhere and writable on
    /// the root, not accessed by anything else during the call.
    pub(crate) unsafe fn reduce_ptrs(
        &mut self,
        buf: *mut u8,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        factor: f64,
        root: usize,
    ) -> Result<()> {
        self.check_root(root)?;
        let red = self.reduction(dtype, op, factor)?;
        let mut d = self.begin(Kind::Reduce, dtype, Some(&red), count, root)?;
        if self.n == 1 {
            // Alone (see `algorithms`): this rank is the root.
            // SAFETY: `buf` holds `count` elements, writable on the root (the contract).
            unsafe { reduce_raw(&red, buf, &[buf], count) };
            return Ok(());
        }
        let es = dtype.size();
        let per = self.seg.slot_bytes() / es;
        d.route(Transfer::Slots, per * es);
        for ch in chunks(count, per) {
            let p = self.next_parity();
            // SAFETY: range inside the caller's buffer.
            let own = unsafe { buf.add(ch.off * es) };
            if self.rank != root {
                // Only the root reads the slots; its own data stays in its buffer.
                // SAFETY: len * es <= slot_bytes, so the destination lies in our slot at
                // the call's place; the source is `own`, inside the caller's buffer.
                unsafe { self.to_slot(self.slot_at(self.rank, p, ch.len * es), own, ch.len * es) };
            }
            self.sync(ch.first().then_some(&d))?;
            if self.rank == root {
                let srcs: Vec<*const u8> =
                    (0..self.n).map(|r| if r == root { own as *const u8 } else { self.slot_at(r, p, ch.len * es) as *const u8 }).collect();
                // SAFETY: every peer slot of step p holds `len` elements (published by the
                // sync above); our own source is the output range itself, inside the root's
                // buffer, which `reduce_raw` allows (one source equal to the destination).
                unsafe { reduce_raw(&red, own, &srcs, ch.len) };
            }
        }
        Ok(())
    }
}
