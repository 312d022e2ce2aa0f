//! The single-copy collectives (`process_vm_readv` and `process_vm_writev`, see `cma`):
//! allreduce, allgather, reduce-scatter, broadcast and all-to-all of large messages. Each
//! publishes the address of its buffer with the descriptor step, then reads the peers'
//! buffers straight from their processes (the broadcast's root and the allreduce's second
//! phase write into them instead); a last step keeps every buffer untouched until all
//! transfers into or from it are done (after a failure, see `Communicator::fail_midway`).
//! Nothing goes through the segment's slots.

use crate::algorithms::{slice_bounds, CMA_CHUNK_BYTES};
use crate::cma::{self, Way};
use crate::desc::{Desc, Kind};
use crate::error::{Error, Result};
use crate::group::Communicator;
use crate::reduce::{reduce_raw, Reduction};
use crate::sync;
use std::ptr::copy_nonoverlapping;

/// Ranks `0..n`, or `n-1` down to 0 (`backward`).
fn order(n: usize, backward: bool) -> impl Iterator<Item = usize> {
    (0..n).map(move |i| if backward { n - 1 - i } else { i })
}

/// Reads `len` bytes of process `peer.0` at `peer.1` into `local`, front to back or
/// (`backward`) back to front ([`cma::transfer`]).
///
/// # Safety
/// As [`cma::read`].
unsafe fn read(backward: bool, peer: (u32, u64), local: *mut u8, len: usize) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { cma::transfer(Way::Read, peer.0, peer.1, local, len, backward) }
}

/// Prefixes a single-copy read error with the peer rank it was reading from.
fn of_rank(q: usize, e: Error) -> Error {
    match e {
        Error::PeerDied(m) => Error::PeerDied(format!("ranks [{q}] did not finish: rank {q} exited ({m})")),
        other => other,
    }
}

impl Communicator {
    /// Publishes `addr` for peers, runs the descriptor step and returns every rank's
    /// (pid, address).
    ///
    /// Also flips this rank's direction (`backward`): each single-copy collective goes
    /// through its transfers in the opposite order of the one before (`cma::transfer`
    /// says why).
    fn publish(&mut self, addr: *const u8, d: &Desc) -> Result<Vec<(u32, u64)>> {
        self.backward = !self.backward;
        sync::publish_addr(&self.seg, self.rank, addr as u64);
        self.sync(Some(d))?;
        Ok(sync::peer_addrs(&self.seg))
    }

    /// Turns a failure in the middle of a single-copy collective into an aborted group:
    /// the peers are waiting at the next step and must not wait in vain.
    ///
    /// A peer that saw the original failure (say, a rank that died) aborts the group and
    /// may exit before this rank's read from it ends, so the read fails naming that peer:
    /// the message then leads with the rank that aborted the group and lists every rank
    /// whose process is gone.
    ///
    /// The failing rank returns at once, without the last step, so a write into its buffer
    /// already under way still lands after the error: the broadcast root's slice for it, or
    /// the chunk an allreduce's owner is writing (owners check for an abort before each
    /// chunk of `CMA_CHUNK_BYTES` and stop). A failed collective's buffer holds no defined
    /// result in any case, and the group is unusable after it.
    fn fail_midway<T>(&mut self, what: Kind, r: Result<T>) -> Result<T> {
        r.map_err(|e| {
            let first = sync::aborted_by(&self.seg).filter(|&q| q != self.rank);
            sync::abort(&self.seg, self.rank);
            let head = format!("{} #{} (rank {}, step {})", what.name(), self.seq.saturating_sub(1), self.rank, self.step + 1);
            let gone = sync::exited(&self.seg, 0..self.n);
            let gone = if gone.is_empty() { String::new() } else { format!("; exited: {}", gone.join(", ")) };
            let stopped = matches!(&e, Error::Aborted(m) if m.is_empty());
            let msg = match first {
                Some(q) if stopped => {
                    format!("{head}: the group was aborted by rank {q} (see its error); this rank's transfers stopped{gone}")
                }
                None if stopped => format!("{head}: the group was aborted from this process; its transfers stopped{gone}"),
                Some(q) => {
                    format!("{head}: the group was aborted by rank {q} (see its error), then a single-copy transfer failed: {e}{gone}")
                }
                None => format!("{head}: single-copy transfer failed: {e}{gone}"),
            };
            self.broken = Some(msg.clone());
            match (first, e) {
                (None, Error::PeerDied(_)) => Error::PeerDied(msg),
                _ => Error::Aborted(msg),
            }
        })
    }

    /// Per-rank chunk buffers of `bytes` each, 8-byte aligned.
    fn chunk_buffers(&mut self, bytes: usize) -> Vec<*mut u8> {
        let words = bytes.div_ceil(8);
        if self.scratch.len() < words * self.n {
            self.scratch = vec![0u64; words * self.n];
        }
        let base = self.scratch.as_mut_ptr();
        // SAFETY: q * words + words <= scratch.len().
        (0..self.n).map(|q| unsafe { base.add(q * words) } as *mut u8).collect()
    }

    /// Reduces element range `[a, b)` of every rank's buffer (`addrs[q]` in process q; our
    /// own at `own`) in rank order into `dst`, `CMA_CHUNK_BYTES` at a time, front to back
    /// or (`backward`) from the last chunk. After each chunk, `done(offset, bytes)` gets
    /// the chunk's place in `dst` (bytes from `dst`) while it is still in this core's
    /// cache; an error from it ends the reduction.
    ///
    /// # Safety
    /// `own` readable and `dst` writable for `b - a` elements from their starts; `dst`
    /// may equal `own` (the kernels read an element of every source before writing it
    /// when the output is source 0 or 1; for other ranks `own` is copied first).
    #[allow(clippy::too_many_arguments)]
    unsafe fn reduce_range_from_peers(
        &mut self,
        red: &Reduction,
        peers: &[(u32, u64)],
        own: *const u8,
        dst: *mut u8,
        (a, b): (usize, usize),
        backward: bool,
        mut done: impl FnMut(usize, usize) -> Result<()>,
    ) -> Result<()> {
        let es = red.dtype.size();
        let chunk = (CMA_CHUNK_BYTES / es).max(1);
        let bufs = self.chunk_buffers(chunk * es);
        let in_place_ok = self.rank < 2 || !std::ptr::eq(own, dst);
        let mut srcs = vec![std::ptr::null::<u8>(); self.n];
        for k in order((b - a).div_ceil(chunk), backward) {
            // A peer that failed returns without waiting for us: stop writing into it (see
            // `fail_midway`; the empty message says the abort was seen here).
            if sync::aborted_by(&self.seg).is_some() {
                return Err(Error::Aborted(String::new()));
            }
            let x = a + k * chunk;
            let len = chunk.min(b - x);
            let off = (x - a) * es;
            for (q, s) in srcs.iter_mut().enumerate() {
                if q == self.rank {
                    // SAFETY: off + len * es <= (b - a) * es, inside `own`; `bufs[q]` holds
                    // `chunk` elements.
                    unsafe {
                        if in_place_ok {
                            *s = own.add(off);
                        } else {
                            copy_nonoverlapping(own.add(off), bufs[q], len * es);
                            *s = bufs[q];
                        }
                    }
                } else {
                    let (pid, addr) = peers[q];
                    // SAFETY: `bufs[q]` is ours and holds `chunk >= len` elements.
                    unsafe { cma::read(pid, addr.wrapping_add((x * es) as u64), bufs[q], len * es) }.map_err(|e| of_rank(q, e))?;
                    *s = bufs[q];
                }
            }
            // SAFETY: every source holds `len` elements (above); the destination range is
            // inside `dst` by this function's contract.
            unsafe { reduce_raw(red, dst.add(off), &srcs, len) };
            done(off, len * es)?;
        }
        Ok(())
    }

    /// Single-copy allreduce (the reduce-scatter + allgather decomposition): rank r reduces
    /// slice r of every rank's buffer into its own buffer, reading the peers' slices from
    /// their processes a chunk at a time, and writes each reduced chunk into every peer's
    /// buffer (`process_vm_writev`) as soon as it is done, while the chunk is still in its
    /// cache. Where the probe found writes impossible, the ranks meet once all slices are
    /// reduced and each then reads the peers' reduced slices. Each byte crosses between
    /// processes once per phase, and nothing goes through the segment.
    ///
    /// Why no step between the two phases when writing: slice r of every buffer is read
    /// and written by rank r alone (it reads the peers' slice r, then writes the result
    /// back into it), and no rank reads its own buffer's slices of others; so a chunk may
    /// go back to the peers while they still reduce theirs. The last step keeps every
    /// buffer in use until all writes into it are done (after a failure: `fail_midway`).
    ///
    /// Why write rather than read: a reduced chunk was just written by its owner's core,
    /// so a reader would fetch every line from that core's cache, one modified line at a
    /// time. On the Intel Xeon 2-vCPU VM (Sapphire Rapids class, 2026-12-05, ranks pinned,
    /// medians of interleaved rounds of 200 calls, each path in the same processes) a 1 MiB
    /// `dist.all_reduce` took 83 us writing the whole slice after the reduction (SUM;
    /// MAX 117), where reading took 199 (MAX). Why each chunk as soon as it is reduced:
    /// a second pass over a slice that has outgrown the cache fetches it from memory
    /// again. Same VM, the kernels on slices (`reduce_direct`), runs alternating the two
    /// forms: 16 MiB took 1.13-1.15 ms against 1.56-1.59 after the whole reduction, 64 MiB
    /// 7.0-7.4 ms against 9.5-10.4 (the slot path: 9.9); at 1 MiB 63 us against 58 or 92.
    ///
    /// # Safety
    /// `buf` readable and writable for `count` aligned elements, untouched by anything
    /// else during the call.
    pub(crate) unsafe fn allreduce_single_copy(&mut self, buf: *mut u8, count: usize, red: &Reduction, d: &Desc) -> Result<()> {
        let es = red.dtype.size();
        let peers = self.publish(buf, d)?;
        let (n, me, back, writes) = (self.n, self.rank, self.backward, self.cma_write_ok);
        let (a, b) = slice_bounds(count, n, me);
        // SAFETY: a <= count.
        let own = unsafe { buf.add(a * es) };
        let push = |off: usize, len: usize| {
            if !writes {
                return Ok(());
            }
            order(n, back).filter(|&q| q != me).try_for_each(|q| {
                let (pid, addr) = peers[q];
                // SAFETY: [off, off + len) of slice `me` lies inside `buf`, ours, and is
                // only read here; rank q published its buffer of `count` elements (every
                // rank agreed on it) and touches no byte of its slice `me` during the call
                // (only this rank reads and writes it).
                unsafe { cma::transfer(Way::Write, pid, addr.wrapping_add((a * es + off) as u64), own.add(off), len, false) }
                    .map_err(|e| of_rank(q, e))
            })
        };
        // SAFETY: [a, b) is inside `buf`; in place is allowed.
        let r = unsafe { self.reduce_range_from_peers(red, &peers, own, own, (a, b), back, push) };
        self.fail_midway(Kind::Allreduce, r)?;
        if !writes {
            self.sync(None)?;
            for q in order(n, back).filter(|&q| q != me) {
                let (qa, qb) = slice_bounds(count, n, q);
                // SAFETY: [qa, qb) is inside `buf`, which is ours to write; rank q wrote its
                // slice before the step above and nobody writes it now.
                let r = unsafe { read(back, (peers[q].0, peers[q].1.wrapping_add((qa * es) as u64)), buf.add(qa * es), (qb - qa) * es) }
                    .map_err(|e| of_rank(q, e));
                self.fail_midway(Kind::Allreduce, r)?;
            }
        }
        self.sync(None)
    }

    /// Single-copy allgather: every rank reads each peer's input into its output.
    ///
    /// # Safety
    /// `input` readable for `bytes`, `output` writable for `n * bytes` (it may contain
    /// `input` as this rank's piece), untouched by anything else during the call.
    pub(crate) unsafe fn allgather_single_copy(&mut self, input: *const u8, output: *mut u8, bytes: usize, d: &Desc) -> Result<()> {
        let peers = self.publish(input, d)?;
        let (n, me, back) = (self.n, self.rank, self.backward);
        let stream = self.streams_local(bytes);
        // SAFETY: the destination is this rank's piece of `output`; it may be `input`
        // itself (in-place allgather), which `copy_local` allows.
        let own = || unsafe { cma::copy_local(input, output.add(me * bytes), bytes, back, stream) };
        if !back {
            own();
        }
        for q in order(n, back).filter(|&q| q != me) {
            // SAFETY: piece q of `output` is inside it and ours to write.
            let r = unsafe { read(back, peers[q], output.add(q * bytes), bytes) }.map_err(|e| of_rank(q, e));
            self.fail_midway(Kind::Allgather, r)?;
        }
        if back {
            own();
        }
        self.sync(None)
    }

    /// Single-copy reduce-scatter: rank r reduces piece r of every rank's input.
    ///
    /// # Safety
    /// `input` readable for `n * count` aligned elements, `output` writable for `count`,
    /// untouched by anything else during the call.
    pub(crate) unsafe fn reduce_scatter_single_copy(
        &mut self,
        input: *const u8,
        output: *mut u8,
        count: usize,
        red: &Reduction,
        d: &Desc,
    ) -> Result<()> {
        let peers = self.publish(input, d)?;
        let (a, b) = (self.rank * count, (self.rank + 1) * count);
        // SAFETY: a + count <= n * count.
        let own = unsafe { input.add(a * red.dtype.size()) };
        // SAFETY: `own` holds `count` elements, `output` takes `count`.
        let r = unsafe { self.reduce_range_from_peers(red, &peers, own, output, (a, b), self.backward, |_, _| Ok(())) };
        self.fail_midway(Kind::ReduceScatter, r)?;
        self.sync(None)
    }

    /// Single-copy broadcast, the root helping: the buffer is cut into `n` slices of whole
    /// 64-byte lines; each rank q but the root reads every slice but slice q from the root,
    /// while the root writes slice q into each of them (`process_vm_writev`). Every rank,
    /// the root included, moves (n - 1) / n of the message instead of the root waiting while
    /// the others move all of it: at world size 2 each side copies half, at the same time.
    /// A last step keeps every buffer untouched until all transfers into or from it are done.
    ///
    /// On the Intel Xeon 2-vCPU VM (Sapphire Rapids class, 2 MiB L2 per core; 2026-12-05,
    /// ranks pinned, medians of interleaved rounds of 200 calls) a 1 MiB broadcast took
    /// 45-50 us at the core (`Communicator::broadcast`) with the non-root reading it all and
    /// 20.5 us with the root writing half: each core moves half, and each core's lines
    /// (half the source, half the destination) now fit its L2 beside what the caller's
    /// Python touches between calls; through `dist.broadcast` 58 -> 26 us.
    ///
    /// # Safety
    /// `buf` readable for `bytes` on the root and writable elsewhere, untouched by
    /// anything else during the call.
    pub(crate) unsafe fn broadcast_single_copy(&mut self, buf: *mut u8, bytes: usize, root: usize, d: &Desc) -> Result<()> {
        let peers = self.publish(buf, d)?;
        let (n, me, back) = (self.n, self.rank, self.backward);
        // Without `process_vm_writev` (the probe found a rank that may not write a peer's
        // memory) every slice is empty: the root only waits and the others read everything.
        let (lines, helped) = (bytes.div_ceil(64), self.cma_write_ok);
        let slice = |q: usize| {
            let (a, b) = if helped { slice_bounds(lines, n, q) } else { (0, 0) };
            ((a * 64).min(bytes), (b * 64).min(bytes))
        };
        let r = if me == root {
            order(n, back).filter(|&q| q != root).map(|q| (q, slice(q))).filter(|&(_, (a, b))| a < b).try_for_each(|(q, (a, b))| {
                let (pid, addr) = peers[q];
                // SAFETY: [a, b) lies inside `buf`, which we only read; rank q published
                // its buffer for `bytes` bytes (every rank agreed on the length) to be
                // written here, and writes no byte of slice q itself.
                unsafe { cma::transfer(Way::Write, pid, addr.wrapping_add(a as u64), buf.add(a), b - a, back) }.map_err(|e| of_rank(q, e))
            })
        } else {
            // What this rank reads: everything but its own slice, in at most two ranges.
            let (a, b) = slice(me);
            let mut ranges = [(0, a), (b, bytes)];
            if back {
                ranges.reverse();
            }
            let (pid, addr) = peers[root];
            ranges.into_iter().filter(|&(x, y)| x < y).try_for_each(|(x, y)| {
                // SAFETY: [x, y) lies inside `buf`, ours to write; the root writes only
                // [a, b), which this range leaves out.
                unsafe { read(back, (pid, addr.wrapping_add(x as u64)), buf.add(x), y - x) }.map_err(|e| of_rank(root, e))
            })
        };
        self.fail_midway(Kind::Broadcast, r)?;
        self.sync(None)
    }

    /// Single-copy all-to-all: rank r reads piece r of every peer's input into the
    /// peer's piece of its output, and copies its own piece locally.
    ///
    /// # Safety
    /// `input` readable and `output` writable for `n * count` aligned elements of `es`
    /// bytes; they do not overlap and nothing else accesses them during the call.
    pub(crate) unsafe fn alltoall_single_copy(
        &mut self,
        input: *const u8,
        output: *mut u8,
        count: usize,
        es: usize,
        d: &Desc,
    ) -> Result<()> {
        let peers = self.publish(input, d)?;
        let (n, me, piece, back) = (self.n, self.rank, count * es, self.backward);
        let stream = self.streams_local(piece);
        // SAFETY: piece `me` of `input` and of `output` lie inside them (n * piece bytes
        // each) and do not overlap (the contract).
        let own = || unsafe { cma::copy_local(input.add(me * piece), output.add(me * piece), piece, back, stream) };
        if !back {
            own();
        }
        for q in order(n, back).filter(|&q| q != me) {
            let (pid, addr) = peers[q];
            // SAFETY: piece q of `output` is inside it and ours to write; the source is
            // piece `me` of rank q's input, which rank q published for n * piece bytes.
            let r = unsafe { read(back, (pid, addr.wrapping_add((me * piece) as u64)), output.add(q * piece), piece) }
                .map_err(|e| of_rank(q, e));
            self.fail_midway(Kind::Alltoall, r)?;
        }
        if back {
            own();
        }
        self.sync(None)
    }
}
