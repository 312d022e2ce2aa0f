//! The collectives, built on the segment's chunk slots and the step protocol of `sync.rs`:
//! this module holds their public, bounds-checked face, the thresholds that choose an
//! algorithm, and the chunk iterator every slot algorithm streams through; each family
//! of slot algorithms is one file below it (`allreduce`, `rooted`: broadcast and reduce,
//! `gather`: allgather, gather and scatter, `exchange`: reduce-scatter and alltoall,
//! `alltoallv`: all-to-all with per-peer counts, `coalesced`: batches of allreduces,
//! allgathers or reduce-scatters as one operation, `table`: the per-call tables these
//! two publish in their first step), and the single-copy ones are in `crate::single_copy`.
//!
//! With peers (n > 1; alone, see "n = 1" below), every collective streams its message
//! through the per-rank chunk slots, one chunk per step (two for the large allreduce), or
//! moves it single-copy, so any message size fits a segment of a fixed size. The first step
//! of every collective also exchanges a *descriptor* (kind, dtype, count,
//! reduce op, root, sequence number, and the transfer path and bytes per step the rank
//! chose, [`Transfer`]): before reading any peer data, each rank compares all
//! descriptors, so ranks that issued different collectives at the same position of the
//! group's sequence, ranks that would move the data differently (say, with different
//! single-copy thresholds), or a rank whose arguments failed validation ([`Communicator::fail`]),
//! make every rank raise `Mismatch` after that one step. All ranks then have taken the
//! same number of steps and the group stays usable. A timeout, a dead peer or an interrupt
//! leaves the ranks at different steps, so it aborts the group for everyone instead.
//!
//! Algorithms (n = group size, S = message bytes, per-rank slot of `slot_bytes`):
//! Which algorithm a call takes at which size S is the group's [`Plan`] (measured per
//! machine by the c10d backend; [`Plan::FALLBACK`] until one is set).
//!
//! - allreduce, S <= the plan's `one_shot_max`: one step per chunk: every rank copies its
//!   chunk into its slot, then reduces the n - 1 peer slots and its own buffer, in rank
//!   order, into its output (the buffer itself). A chunk
//!   of at most half a slot goes to the call's place in the slot
//!   (`Communicator::rotation`: up to 16 places, by sequence number), so back-to-back
//!   small allreduces do not rewrite the lines the peers have just read.
//! - allreduce, larger: the reduce-scatter + allgather decomposition of ring allreduce
//!   (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
//!   workstations", JPDC 2009), done directly in shared memory, where every rank can read
//!   every slot, so the n-1 ring steps of each phase collapse into one: step A, every rank
//!   copies the pieces of its chunk that its peers reduce into its slot and reduces its own
//!   1/n slice from the n - 1 peer slots and its own buffer (in rank order) into its other
//!   slot; step B, every rank copies all n reduced slices out. Each element
//!   is reduced by exactly one rank in rank order, so all ranks get the same bits.
//! - allgather / gather: every rank copies its chunk in; all ranks (gather: the root) copy
//!   all n chunks out. broadcast: the root copies in, the others copy out. Small chunks
//!   take the call's place in the slot, as in the one-shot allreduce.
//! - reduce: as the one-shot allreduce, only the root reduces (its own data is read from
//!   its buffer and never copied into its slot).
//! - reduce-scatter / alltoall: each rank copies the chunk of each of its peers' n - 1
//!   pieces in; rank r reduces (alltoall: copies) piece r from every peer's slot and, in
//!   rank order, its own input (which never goes through a slot). scatter: the root copies
//!   the chunk of each piece in, rank r copies piece r out.
//! - n = 1 (alone): allreduce, reduce, broadcast, allgather, gather, scatter, reduce-scatter
//!   and all-to-all take their descriptor (the abort check, the sequence number) and then
//!   work where the data lies, with no step: the broadcast returns, the reductions reduce
//!   the one input (`reduce_raw` with one source: the same bits as through the slots; a
//!   float32 or float64 SUM, PRODUCT, MIN or MAX in place touches nothing, the other
//!   reductions make one pass), the others copy their input to their output. Through the
//!   slots each copied the message into the rank's own slot and out again: on the Intel
//!   Xeon VM (2026-12-05, `dist.*` at world size 1, median of 200 calls) a 16 MiB
//!   `broadcast` took 1,015 us and now 6.9 (torch's floor), `all_reduce` 1,133 and now
//!   6.7, `all_gather_into_tensor` 1,925 and now 962 (one copy). The batched calls
//!   (`coalesced`, `alltoallv`) still go through the slots.

mod allreduce;
mod alltoallv;
mod coalesced;
mod exchange;
mod gather;
mod rooted;
mod table;

use crate::buffer::{check_disjoint, Buf};
use crate::error::Result;
pub use crate::plan::Plan;
use crate::reduce::{DType, ReduceOp};
use crate::segment;
use std::path::Path;

pub use crate::desc::{check_peer_desc, Desc, Kind, Transfer};
pub use crate::group::{AbortHandle, Communicator, InterruptHook, ATTACH_STEPS};
pub use coalesced::COALESCE_MAX_BYTES;

/// The fallback plan's one-shot allreduce limit ([`Plan::FALLBACK`]; the group's own is
/// [`Communicator::plan`]).
pub const ONE_SHOT_MAX_BYTES: usize = Plan::FALLBACK.one_shot_max;

/// The fallback plan's single-copy threshold of allgather and reduce-scatter
/// ([`Plan::FALLBACK`]); a group measures its own (`crate::plan`).
pub const CMA_MIN_BYTES: usize = Plan::FALLBACK.single_copy[1].min;

/// Bytes per peer read at a time by the single-copy reductions (64 KiB to 1 MiB measured
/// within noise of each other).
pub const CMA_CHUNK_BYTES: usize = 128 * 1024;

/// One chunk of a message streamed through the slots: elements `[off, off + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// 0 for the first chunk, whose step also exchanges the descriptor.
    pub index: usize,
    pub off: usize,
    pub len: usize,
}

impl Chunk {
    /// Whether this chunk's step carries the descriptor (the first one).
    pub fn first(&self) -> bool {
        self.index == 0
    }
}

/// The chunks of a message of `count` elements, `per` elements per chunk: at least one
/// (an empty message still takes one step, which exchanges the descriptor), the last one
/// possibly shorter. The one chunk loop of every slot algorithm.
pub(crate) fn chunks(count: usize, per: usize) -> impl Iterator<Item = Chunk> {
    let per = per.max(1);
    let steps = count.div_ceil(per).max(1);
    (0..steps).map(move |index| {
        let off = index * per;
        Chunk { index, off, len: per.min(count - off.min(count)) }
    })
}

impl Communicator {
    // ----- collectives: the public, bounds-checked face -----------------------------
    // Each checks every buffer it uses on this rank against what the call moves (see
    // `Buf::check`) before touching anything. A buffer that is too small (or null,
    // misaligned, read-only where written) makes this rank join the call's position of
    // the sequence as a failing rank (peers raise `Mismatch` naming it, as after `fail`)
    // and return `InvalidArgument` naming the argument; nothing is written.

    /// In-place allreduce of `count` elements of `dtype` in `buf` (`nbytes`).
    pub fn allreduce(&mut self, buf: Buf<'_>, count: usize, dtype: DType, op: ReduceOp, factor: f64) -> Result<()> {
        self.reduction(dtype, op, factor)?;
        if let Err(e) = buf.check("nbytes", count, dtype.size(), 1, true) {
            return self.reject(Kind::Allreduce, e);
        }
        // SAFETY: `buf` is valid for reads and writes of its length (`Buf` contract),
        // which the check above showed holds `count` aligned elements.
        self.timed(Kind::Allreduce, count * dtype.size(), |c| unsafe { c.allreduce_ptrs(buf.as_mut_ptr(), count, dtype, op, factor) })
    }

    /// In-place broadcast of `count` elements of `dtype` in `buf` (`nbytes`) from group
    /// rank `root`: read on the root, written elsewhere.
    pub fn broadcast(&mut self, buf: Buf<'_>, count: usize, dtype: DType, root: usize) -> Result<()> {
        self.check_root(root)?;
        if let Err(e) = buf.check("nbytes", count, dtype.size(), 1, self.rank != root) {
            return self.reject(Kind::Broadcast, e);
        }
        // SAFETY: as in `allreduce`; the root only reads `buf`.
        self.timed(Kind::Broadcast, count * dtype.size(), |c| unsafe { c.broadcast_ptrs(buf.as_ptr() as *mut u8, count, dtype, root) })
    }

    /// In-place reduce of `count` elements in `buf` (`nbytes`) to group rank `root`;
    /// only the root's buffer is written.
    pub fn reduce(&mut self, buf: Buf<'_>, count: usize, dtype: DType, op: ReduceOp, factor: f64, root: usize) -> Result<()> {
        self.check_root(root)?;
        self.reduction(dtype, op, factor)?;
        if let Err(e) = buf.check("nbytes", count, dtype.size(), 1, self.rank == root) {
            return self.reject(Kind::Reduce, e);
        }
        // SAFETY: as in `allreduce`; non-roots only read `buf`.
        self.timed(Kind::Reduce, count * dtype.size(), |c| unsafe {
            c.reduce_ptrs(buf.as_ptr() as *mut u8, count, dtype, op, factor, root)
        })
    }

    /// Allgather: `input` (`in_nbytes`) holds `count` elements; `output` (`out_nbytes`)
    /// receives `n * count`, rank r's at `[r * count, (r + 1) * count)`. `input` may be
    /// this rank's piece of `output`.
    pub fn allgather(&mut self, input: Buf<'_>, output: Buf<'_>, count: usize, dtype: DType) -> Result<()> {
        let es = dtype.size();
        let own = self.rank * count * es; // no overflow once the output's check passed
        if let Err(e) = input
            .check("in_nbytes", count, es, 1, false)
            .and_then(|()| output.check("out_nbytes", count, es, self.n, true))
            .and_then(|()| check_disjoint("allgather", &input, count * es, &output, self.n * count * es, Some(own)))
        {
            return self.reject(Kind::Allgather, e);
        }
        // SAFETY: both buffers are valid for their checked lengths (`Buf` contract).
        self.timed(Kind::Allgather, self.n * count * es, |c| unsafe { c.allgather_ptrs(input.as_ptr(), output.as_mut_ptr(), count, dtype) })
    }

    /// Gather to `root`: `input` holds `count` elements; the root's `output` receives
    /// `n * count` (non-roots may pass an empty `output`, which is not touched).
    pub fn gather(&mut self, input: Buf<'_>, output: Buf<'_>, count: usize, dtype: DType, root: usize) -> Result<()> {
        self.check_root(root)?;
        let es = dtype.size();
        let out_ok = if self.rank == root {
            output
                .check("out_nbytes", count, es, self.n, true)
                .and_then(|()| check_disjoint("gather", &input, count * es, &output, self.n * count * es, Some(self.rank * count * es)))
        } else {
            Ok(())
        };
        if let Err(e) = input.check("in_nbytes", count, es, 1, false).and(out_ok) {
            return self.reject(Kind::Gather, e);
        }
        // SAFETY: as in `allgather`; non-roots never touch `output`.
        self.timed(Kind::Gather, self.n * count * es, |c| unsafe {
            c.gather_ptrs(input.as_ptr(), output.as_ptr() as *mut u8, count, dtype, root)
        })
    }

    /// Scatter from `root`: the root's `input` holds `n * count` elements (non-roots may
    /// pass an empty one); rank r receives piece r in `output` (`count` elements).
    pub fn scatter(&mut self, input: Buf<'_>, output: Buf<'_>, count: usize, dtype: DType, root: usize) -> Result<()> {
        self.check_root(root)?;
        let es = dtype.size();
        let in_ok = if self.rank == root { input.check("in_nbytes", count, es, self.n, false) } else { Ok(()) };
        if let Err(e) = in_ok.and(output.check("out_nbytes", count, es, 1, true)) {
            return self.reject(Kind::Scatter, e);
        }
        // SAFETY: as in `allgather`; non-roots never touch `input`.
        self.timed(Kind::Scatter, self.n * count * es, |c| unsafe {
            c.scatter_ptrs(input.as_ptr(), output.as_mut_ptr(), count, dtype, root)
        })
    }

    /// Reduce-scatter: `input` holds `n * count` elements; `output` (`count` elements)
    /// receives the reduction over ranks of piece `rank`.
    pub fn reduce_scatter(&mut self, input: Buf<'_>, output: Buf<'_>, count: usize, dtype: DType, op: ReduceOp, factor: f64) -> Result<()> {
        self.reduction(dtype, op, factor)?;
        let es = dtype.size();
        if let Err(e) = input
            .check("in_nbytes", count, es, self.n, false)
            .and_then(|()| output.check("out_nbytes", count, es, 1, true))
            .and_then(|()| check_disjoint("reduce_scatter", &input, self.n * count * es, &output, count * es, None))
        {
            return self.reject(Kind::ReduceScatter, e);
        }
        // SAFETY: as in `allgather`.
        self.timed(Kind::ReduceScatter, self.n * count * es, |c| unsafe {
            c.reduce_scatter_ptrs(input.as_ptr(), output.as_mut_ptr(), count, dtype, op, factor)
        })
    }

    /// All-to-all: `input` and `output` hold `n * count` elements each and must not
    /// overlap; piece q of this rank's input goes to rank q, and rank q's piece `rank`
    /// lands in output piece q.
    pub fn alltoall(&mut self, input: Buf<'_>, output: Buf<'_>, count: usize, dtype: DType) -> Result<()> {
        let es = dtype.size();
        let ok = input.check("in_nbytes", count, es, self.n, false).and_then(|()| output.check("out_nbytes", count, es, self.n, true));
        let bytes = count * es * self.n; // no overflow once both checks passed
        if let Err(e) = ok.and_then(|()| check_disjoint("alltoall", &input, bytes, &output, bytes, None)) {
            return self.reject(Kind::Alltoall, e);
        }
        // SAFETY: as in `allgather`; the ranges do not overlap (checked above).
        self.timed(Kind::Alltoall, bytes, |c| unsafe { c.alltoall_ptrs(input.as_ptr(), output.as_mut_ptr(), count, dtype) })
    }
}

/// Rank `r`'s slice `[a, b)` of a chunk of `len` elements split across `n` ranks; slices
/// are multiples of 64 elements (whole cache lines for every dtype) except the last.
pub fn slice_bounds(len: usize, n: usize, r: usize) -> (usize, usize) {
    let per = len.div_ceil(n).div_ceil(64) * 64;
    let a = (r * per).min(len);
    (a, (a + per).min(len))
}

/// Convenience for tests and benches: creates a segment and attaches all ranks of a
/// group living in one process (threads as ranks).
pub fn create_segment(dir: &Path, world_size: usize, slot_bytes: usize) -> Result<std::path::PathBuf> {
    segment::create(dir, world_size, slot_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_message_once_and_an_empty_one_takes_one_step() {
        assert_eq!(chunks(0, 8).collect::<Vec<_>>(), vec![Chunk { index: 0, off: 0, len: 0 }]);
        for (count, per) in [(1, 8), (8, 8), (9, 8), (100, 7), (5, 0)] {
            let cs: Vec<Chunk> = chunks(count, per).collect();
            assert!(cs[0].first() && cs.iter().skip(1).all(|c| !c.first()));
            assert_eq!(cs.iter().map(|c| c.len).sum::<usize>(), count);
            assert!(cs.windows(2).all(|w| w[0].off + w[0].len == w[1].off));
        }
    }
}
