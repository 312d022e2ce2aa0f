//! All-to-all with per-peer counts (alltoallv) through the slots, as one collective.
//!
//! Rank p sends `send_counts[q]` elements to rank q, taken back to back from its input
//! (piece q starts after pieces 0..q), and receives `recv_counts[q]` elements from rank q
//! into its output the same way. First step: every rank publishes its descriptor and, at
//! the start of its slot, its table `send_counts ++ recv_counts` (2n words). After the
//! step every rank reads all n tables, so all see the same n x n matrix and decide alike:
//! if what p sends to q differs from what q expects from p, every rank raises `Mismatch`
//! naming the first such pair, before any data moved (the group stays usable). Then the
//! pieces stream through the slots: each rank's slot is cut into n sub-slots, one per
//! destination, and step k carries elements `[k * per, (k + 1) * per)` of every piece
//! (the first step also carries data, after the table). The number of steps follows from
//! the largest piece, the same on every rank; each rank copies only within its own
//! checked counts.

use super::table;
use crate::buffer::Buf;
use crate::desc::{Kind, Transfer};
use crate::error::{Disagreement, Error, Result};
use crate::group::Communicator;
use crate::reduce::DType;

/// Elements of one piece carried per step when a slot of `slot_bytes` starts with
/// `reserved` bytes of table and is cut into `n` sub-slots of whole cache lines.
pub(crate) fn per_step(slot_bytes: usize, reserved: usize, n: usize, es: usize) -> usize {
    (slot_bytes.saturating_sub(reserved) / n / 64 * 64) / es
}

/// Sum of `counts` (argument `name`), which must have one count per rank.
fn total(name: &str, counts: &[usize], n: usize) -> Result<usize> {
    if counts.len() != n {
        return Err(Error::InvalidArgument(format!("{name}: expected {n} counts (one per rank), got {}", counts.len())));
    }
    counts
        .iter()
        .try_fold(0usize, |acc, &c| acc.checked_add(c))
        .ok_or_else(|| Error::InvalidArgument(format!("{name}: the counts overflow the address space")))
}

/// The first pair (p, q), p-major, where `tables[p]` (rank p's `send ++ recv` words) says
/// p sends a different count to q than `tables[q]` says q expects from p, as a message
/// naming it and the number of such pairs, and as fields; `None` when every pair agrees.
/// Pure, so every rank, reading the same tables, returns the same.
pub(crate) fn disagreement(tables: &[Vec<u64>]) -> Option<(String, Disagreement)> {
    let n = tables.len();
    let bad: Vec<(usize, usize)> =
        (0..n).flat_map(|p| (0..n).map(move |q| (p, q))).filter(|&(p, q)| tables[p][q] != tables[q][n + p]).collect();
    let &(p, q) = bad.first()?;
    let (got, expected, pairs) = (tables[p][q], tables[q][n + p], bad.len());
    let message = format!(
        "split sizes disagree between ranks: rank {p} sends {got} elements to rank {q}, which expects {expected} from it \
         ({pairs} such pair(s))"
    );
    Some((message, Disagreement::Counts { rank: p, peer: q, expected, got, pairs }))
}

/// Offsets of pieces laid back to back with `counts` elements each.
fn displacements(counts: &[usize]) -> Vec<usize> {
    counts.iter().scan(0, |acc, &c| Some(std::mem::replace(acc, *acc + c))).collect()
}

impl Communicator {
    /// Alltoallv: piece q of `input` (`send_counts[q]` elements, pieces back to back) goes
    /// to rank q; rank q's piece for this rank lands in piece q of `output`
    /// (`recv_counts[q]` elements, back to back). Counts are in elements of `dtype`, one
    /// per rank; `input` and `output` must not overlap.
    ///
    /// Errors: `InvalidArgument` naming the argument (a count list of the wrong length,
    /// a buffer too small for the sum of its counts, overlapping buffers): this rank joins
    /// the call as a failing rank, so its peers raise `Mismatch`; `Mismatch` on every rank
    /// when some rank's send count to a peer differs from that peer's receive count (no
    /// data moved; the group stays usable).
    pub fn alltoallv(&mut self, input: Buf<'_>, output: Buf<'_>, send_counts: &[usize], recv_counts: &[usize], dtype: DType) -> Result<()> {
        let es = dtype.size();
        let checked = (|| {
            let sent = total("send_counts", send_counts, self.n)?;
            let recv = total("recv_counts", recv_counts, self.n)?;
            input.check("in_nbytes", sent, es, 1, false)?;
            output.check("out_nbytes", recv, es, 1, true)?;
            let (i, o) = (input.as_ptr() as usize, output.as_ptr() as usize);
            if sent > 0 && recv > 0 && i < o + recv * es && o < i + sent * es {
                return Err(Error::InvalidArgument("out_ptr: the output of alltoallv overlaps its input".into()));
            }
            Ok(())
        })();
        if let Err(e) = checked {
            return self.reject(Kind::Alltoallv, e);
        }
        // SAFETY: the buffers hold the sums of their counts (checked above, `Buf`
        // contract) and do not overlap.
        unsafe { self.alltoallv_ptrs(input.as_ptr(), output.as_mut_ptr(), send_counts, recv_counts, dtype) }
    }

    /// # Safety
    /// `input` readable for the sum of `send_counts` aligned elements of `dtype`, `output`
    /// writable for the sum of `recv_counts`; both lists have `n` entries; the buffers do
    /// not overlap and nothing else accesses them during the call.
    unsafe fn alltoallv_ptrs(&mut self, input: *const u8, output: *mut u8, send: &[usize], recv: &[usize], dtype: DType) -> Result<()> {
        let (n, me, es) = (self.n, self.rank, dtype.size());
        let mut d = self.begin(Kind::Alltoallv, dtype, None, 0, 0)?;
        let slot_bytes = self.seg.slot_bytes();
        let reserved = table::table_bytes(2 * n);
        let per_rest = per_step(slot_bytes, 0, n, es);
        d.route(Transfer::Slots, per_rest * es);
        let (sdis, rdis) = (displacements(send), displacements(recv));
        let mine: Vec<u64> = send.iter().chain(recv).map(|&c| c as u64).collect();
        // Element offset within every piece of the current step, and its capacity.
        let (mut off, mut per, mut first) = (0usize, per_step(slot_bytes, reserved, n, es), true);
        let mut largest = 0usize;
        loop {
            let p = self.next_parity();
            let base = if first { reserved } else { 0 };
            let sub = per * es; // bytes of one sub-slot this step
            let slot = self.slot(me, p);
            if first {
                // SAFETY: 2n words fit in `reserved` <= slot_bytes (64 bytes per rank).
                unsafe { table::write(slot, &mine) };
            }
            for (q, (&c, &at)) in send.iter().zip(&sdis).enumerate() {
                let len = c.saturating_sub(off).min(per);
                // SAFETY: the source lies in piece q of `input` (at + off + len <= at + c);
                // the destination is sub-slot q: base + (q + 1) * sub <= slot_bytes.
                unsafe { self.to_slot(slot.add(base + q * sub), input.add((at + off) * es), len * es) };
            }
            self.sync(first.then_some(&d))?;
            if first {
                // SAFETY: every rank published its table in this step (sync returned and
                // the descriptors agree, so every rank wrote 2n words).
                let tables: Vec<Vec<u64>> = (0..n).map(|r| unsafe { table::read(self.slot(r, p), 2 * n) }).collect();
                if let Some((m, on)) = disagreement(&tables) {
                    let message = format!("{}: {m}; no data was exchanged and the group is still usable", d.describe());
                    return Err(Error::Disagree { message, on });
                }
                largest = tables.iter().flat_map(|t| t[..n].iter()).map(|&c| usize::try_from(c).unwrap_or(usize::MAX)).max().unwrap_or(0);
            }
            for (q, (&c, &at)) in recv.iter().zip(&rdis).enumerate() {
                let len = c.saturating_sub(off).min(per);
                // SAFETY: rank q's slot of this step is published; its sub-slot `me` holds
                // min(per, its count to us - off) elements, and that count equals `c`
                // (checked above). The destination lies in piece q of `output`.
                unsafe { std::ptr::copy_nonoverlapping(self.slot(q, p).add(base + me * sub), output.add((at + off) * es), len * es) };
            }
            off += per;
            if off >= largest {
                return Ok(());
            }
            (per, first) = (per_rest, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_checked_per_rank_and_for_overflow() {
        assert_eq!(total("send_counts", &[1, 2, 3], 3).unwrap(), 6);
        let e = total("send_counts", &[1, 2], 3).unwrap_err().to_string();
        assert!(e.contains("send_counts") && e.contains("expected 3 counts"), "{e}");
        let e = total("recv_counts", &[usize::MAX, 1], 2).unwrap_err().to_string();
        assert!(e.contains("recv_counts") && e.contains("overflow"), "{e}");
    }

    #[test]
    fn disagreement_names_the_first_pair_and_counts_them() {
        // rank p's table: send counts to 0..n, then receive counts from 0..n
        let ok = vec![vec![0, 1, 0, 2], vec![2, 3, 1, 3]];
        assert_eq!(disagreement(&ok), None);
        let bad = vec![vec![0, 1, 0, 2], vec![5, 3, 1, 3]];
        let (m, on) = disagreement(&bad).unwrap();
        assert!(m.contains("rank 1 sends 5 elements to rank 0, which expects 2") && m.contains("1 such pair"), "{m}");
        assert_eq!(on, Disagreement::Counts { rank: 1, peer: 0, expected: 2, got: 5, pairs: 1 });
    }

    #[test]
    fn steps_carry_whole_cache_lines_per_peer() {
        assert_eq!(per_step(4096, 0, 4, 4), 256);
        assert_eq!(per_step(4096, 64, 4, 4), 240); // 1008 bytes -> 960 per sub-slot
        assert_eq!(per_step(256, 128, 4, 8), 0); // the table may leave no room: data follows
        assert_eq!(displacements(&[3, 0, 2]), vec![0, 3, 3]);
    }
}
