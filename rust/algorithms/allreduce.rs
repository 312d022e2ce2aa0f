//! Allreduce through the slots: one-shot for small messages (every rank reduces every
//! chunk), two-step above the plan's `one_shot_max` (reduce-scatter, then allgather of the
//! reduced slices; see the `algorithms` module docs).

use super::{chunks, slice_bounds, CMA_CHUNK_BYTES};
use crate::desc::{Kind, Transfer};
use crate::error::Result;
use crate::group::Communicator;
use crate::reduce::{reduce_raw, DType, ReduceOp};
use std::ptr::copy_nonoverlapping;

/// Bytes of the two-step allreduce's own slice reduced before they are copied out to the
/// caller's buffer (from L1: well under the 32 KiB L1 data cache of current x86 cores).
const SUB_BLOCK_BYTES: usize = 16 * 1024;

impl Communicator {
    /// In-place allreduce of `count` elements at `buf`.
    ///
    /// # Safety
    /// `buf` must be valid for reads and writes of `count` elements of `dtype`, aligned to
    /// the element size, and not accessed by anything else during the call.
    pub(crate) unsafe fn allreduce_ptrs(&mut self, buf: *mut u8, count: usize, dtype: DType, op: ReduceOp, factor: f64) -> Result<()> {
        let red = self.reduction(dtype, op, factor)?;
        let mut d = self.begin(Kind::Allreduce, dtype, Some(&red), count, 0)?;
        if self.n == 1 {
            // Alone (see `algorithms`): the reduction of this rank's buffer, where it lies.
            // SAFETY: `buf` holds `count` elements (the contract); one source, `dst` itself.
            unsafe { reduce_raw(&red, buf, &[buf], count) };
            return Ok(());
        }
        let es = dtype.size();
        if self.single_copy(Kind::Allreduce, count * es) {
            d.route(Transfer::SingleCopy, CMA_CHUNK_BYTES);
            // SAFETY: forwarded from this function's contract.
            return unsafe { self.allreduce_single_copy(buf, count, &red, &d) };
        }
        let two_step = !self.one_shot(count * es);
        let per = self.seg.slot_bytes() / es;
        d.route(if two_step { Transfer::SlotsTwoStep } else { Transfer::Slots }, per * es);
        let mut srcs = vec![std::ptr::null::<u8>(); self.n];
        for ch in chunks(count, per) {
            let (off, len) = (ch.off, ch.len);
            let p = self.next_parity();
            // One-shot chunks that a slot holds several times over take the call's place
            // in it (`rotation`); two-step chunks use whole slots.
            let at = |c: &Self, r| if two_step { c.slot(r, p) } else { c.slot_at(r, p, len * es) };
            let mine = at(self, self.rank);
            let (a, b) = slice_bounds(len, self.n, self.rank);
            if !two_step {
                // SAFETY: off + len <= count, so the source range is inside the caller's
                // buffer; len * es <= slot_bytes, so the destination is in our slot.
                unsafe { self.to_slot(mine, buf.add(off * es), len * es) };
            } else {
                // Peers read every piece of our chunk except our own slice [a, b), which
                // we reduce straight from `buf`. SAFETY: as above, both ranges lie in
                // [0, len) of the chunk.
                unsafe {
                    self.to_slot(mine, buf.add(off * es), a * es);
                    self.to_slot(mine.add(b * es), buf.add((off + b) * es), (len - b) * es);
                }
            }
            self.sync(ch.first().then_some(&d))?;
            for (r, s) in srcs.iter_mut().enumerate() {
                *s = at(self, r);
            }
            if !two_step {
                // Our own contribution is read where it lies, in the caller's buffer (which
                // is also the destination: allowed, as one source exactly), not from our
                // slot while the peers read it there.
                // SAFETY: every peer slot holds `len` elements of step p (published by the
                // sync above); the range [off, off + len) is inside the caller's buffer.
                let own = unsafe { buf.add(off * es) };
                srcs[self.rank] = own;
                // SAFETY: as above; `own` is the destination itself, which `reduce_raw`
                // allows.
                unsafe { reduce_raw(&red, own, &srcs, len) };
                continue;
            }
            let reduced = self.slot(self.rank, 1 - p);
            let sub = (SUB_BLOCK_BYTES / es).max(1);
            if self.scratch.len() * 8 < sub * es {
                self.scratch = vec![0u64; (sub * es).div_ceil(8)];
            }
            let mut sliced = vec![std::ptr::null::<u8>(); self.n];
            for s0 in (a..b).step_by(sub) {
                let k = sub.min(b - s0);
                for (r, src) in sliced.iter_mut().enumerate() {
                    // SAFETY: s0 + k <= b <= len, so each offset stays inside its slot
                    // and, for our own slice, inside the caller's buffer (off + len <= count).
                    *src = unsafe {
                        if r == self.rank {
                            buf.add((off + s0) * es)
                        } else {
                            srcs[r].add(s0 * es)
                        }
                    };
                }
                if self.streamer.streams(k * es) {
                    // Streaming stores (crate::stream): reduce into private scratch, in L1,
                    // then stream the block into our slot and copy it to `buf`.
                    let tmp = self.scratch.as_mut_ptr().cast::<u8>();
                    // SAFETY: as below for the sources; the scratch holds SUB_BLOCK_BYTES
                    // (sized before the loop) >= k * es and overlaps nothing else.
                    unsafe { reduce_raw(&red, tmp, &sliced, k) };
                    // SAFETY: the block just reduced; our slot of the other parity is ours
                    // to write now (as below); the destination is inside the caller's buffer.
                    unsafe {
                        self.to_slot(reduced.add(s0 * es), tmp, k * es);
                        copy_nonoverlapping(tmp, buf.add((off + s0) * es), k * es);
                    }
                    continue;
                }
                // SAFETY: [s0, s0 + k) lies inside the chunk; peers' slots hold it
                // (published by the sync above), our own slice is read from the caller's
                // buffer; our slot of the other parity is ours to write now (every rank has
                // left the step that last read it) and overlaps none of the sources.
                unsafe { reduce_raw(&red, reduced.add(s0 * es), &sliced, k) };
                // Our own reduced slice goes to `buf` at once, block by block, while its
                // lines are in this CPU's L1 and before the peers start reading them
                // (after the sync below, the copy competed with their reads: slower).
                // SAFETY: the block just written above; the destination is inside the
                // caller's buffer, and the reduction has finished reading it.
                unsafe { copy_nonoverlapping(reduced.add(s0 * es), buf.add((off + s0) * es), k * es) };
            }
            self.sync(None)?;
            for r in (0..self.n).filter(|&r| r != self.rank) {
                let (a, b) = slice_bounds(len, self.n, r);
                // SAFETY: rank r's reduced slice [a, b) of this chunk was published by the
                // sync above; the destination is inside the caller's buffer.
                unsafe { copy_nonoverlapping(self.slot(r, 1 - p).add(a * es), buf.add((off + a) * es), (b - a) * es) };
            }
        }
        Ok(())
    }
}
