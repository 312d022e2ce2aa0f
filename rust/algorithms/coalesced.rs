//! Coalesced batches: allreduce, allgather or reduce-scatter of several tensors (each
//! with its own dtype and count) as one synchronised operation.
//!
//! First step: one descriptor for the whole batch (kind, the number of tensors, reduce op
//! and factor) and, at the start of every rank's slot, the batch's table: one word per
//! tensor, `count << 8 | dtype code`. After the step every rank compares all ranks'
//! tables with rank 0's, so all raise the same `Mismatch` (naming the first tensor and
//! rank that differ) before any output is written, and the group stays usable. Then the
//! tensors stream back to back through the slots, the pieces of several tensors sharing
//! one step (a flat view over the batch; the first step carries data after the table):
//! a batch of 64 tensors of 4 KiB takes 2 steps instead of 64 collectives. Each piece is
//! reduced with its own tensor's dtype rules (the same kernels, so the same bits as the
//! single-tensor collectives).
//!
//! Tensors whose message is larger than [`COALESCE_MAX_BYTES`] are better served by the
//! single-tensor algorithms (two-step allreduce, single-copy transfers): they run after
//! the batch's slot steps, one collective each. Which tensors those are follows from the
//! table, so every rank agrees. A batch with more tensors than a slot's table holds is
//! run as several batches.

use super::{table, ONE_SHOT_MAX_BYTES};
use crate::buffer::{check_disjoint, Buf};
use crate::desc::{Kind, Transfer};
use crate::error::{Error, Result};
use crate::group::Communicator;
use crate::reduce::{reduce_raw, DType, ReduceOp, Reduction};

/// Tensors whose message (allreduce: the tensor; allgather: the output; reduce-scatter:
/// the input) exceeds this many bytes leave the batch's slot steps and run as their own
/// collective, after them (where the single-tensor thresholds take over).
pub const COALESCE_MAX_BYTES: usize = ONE_SHOT_MAX_BYTES;

/// Counts must fit in the table word's upper 56 bits.
const MAX_COUNT: usize = (1 << 56) - 1;

/// One tensor of a batch, as the slot steps see it.
#[derive(Clone, Copy)]
struct Item {
    input: *const u8,
    output: *mut u8,
    count: usize,
    dtype: DType,
}

/// A piece of tensor `item`, elements `[off, off + len)`, at byte `at` of the step's slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    pub item: usize,
    pub off: usize,
    pub len: usize,
    pub at: usize,
}

/// Cuts a batch (element counts and sizes) into steps of `slot_bytes`: each piece takes
/// `width * len * es` bytes (width: pieces per element range, n for reduce-scatter) from a
/// cache-line boundary. Every rank with the same table makes the same steps.
pub(crate) struct Planner<'a> {
    sizes: &'a [(usize, usize)],
    width: usize,
    slot_bytes: usize,
    item: usize,
    off: usize,
}

impl<'a> Planner<'a> {
    pub fn new(sizes: &'a [(usize, usize)], width: usize, slot_bytes: usize) -> Planner<'a> {
        Planner { sizes, width, slot_bytes, item: 0, off: 0 }
    }
    /// Whether every element has been planned.
    pub fn done(&self) -> bool {
        self.sizes[self.item..].iter().enumerate().all(|(k, &(c, _))| c == if k == 0 { self.off } else { 0 })
    }
    /// The pieces of the next step, whose slot starts with `reserved` bytes of table.
    pub fn step(&mut self, reserved: usize) -> Vec<Piece> {
        let mut pieces = Vec::new();
        let mut at = reserved.div_ceil(64) * 64;
        while let Some(&(count, es)) = self.sizes.get(self.item) {
            let room = self.slot_bytes.saturating_sub(at) / (self.width * es);
            let len = (count - self.off).min(room);
            if count > self.off && len == 0 {
                break; // the step is full
            }
            if len > 0 {
                pieces.push(Piece { item: self.item, off: self.off, len, at });
                at = (at + self.width * len * es).div_ceil(64) * 64;
            }
            self.off += len;
            if self.off == count {
                (self.item, self.off) = (self.item + 1, 0);
            }
        }
        pieces
    }
}

/// The table word of a tensor.
fn word(count: usize, dtype: DType) -> u64 {
    (count as u64) << 8 | dtype as u64
}

fn describe_word(w: u64) -> String {
    let dtype = DType::from_code((w & 0xff) as u32).map_or_else(|| format!("<dtype {}>", w & 0xff), |d| d.name().to_string());
    format!("{dtype} x {} elements", w >> 8)
}

/// The first (tensor, rank) whose table word differs from rank 0's, as a message; `None`
/// when all tables are equal. Pure, so every rank reading the same tables says the same.
pub(crate) fn disagreement(tables: &[Vec<u64>]) -> Option<String> {
    let m = tables.first()?.len();
    let (i, r) = (0..m).flat_map(|i| (1..tables.len()).map(move |r| (i, r))).find(|&(i, r)| tables[r][i] != tables[0][i])?;
    Some(format!(
        "ranks disagree on tensor {i} of the batch: rank 0 has {}, rank {r} has {}",
        describe_word(tables[0][i]),
        describe_word(tables[r][i])
    ))
}

/// The checks every coalesced call makes on its lists, before joining the sequence.
fn check_lists(counts: &[usize], dtypes: &[DType], lens: &[(&str, usize)]) -> Result<()> {
    for &(name, len) in lens {
        if len != counts.len() {
            return Err(Error::InvalidArgument(format!("{name}: expected {} entries (one per tensor), got {len}", counts.len())));
        }
    }
    if dtypes.len() != counts.len() {
        return Err(Error::InvalidArgument(format!("dtypes: expected {} entries (one per tensor), got {}", counts.len(), dtypes.len())));
    }
    if let Some(i) = counts.iter().position(|&c| c > MAX_COUNT) {
        return Err(Error::InvalidArgument(format!("numels[{i}]: {} elements exceed the batch limit of 2^56 - 1", counts[i])));
    }
    Ok(())
}

impl Communicator {
    /// Tensors per batch: a batch's table must fit in one slot next to some data.
    fn batch_limit(&self) -> usize {
        (self.seg.slot_bytes() / 2 / 8).max(1)
    }

    /// In-place allreduce of every `bufs[i]` (`counts[i]` elements of `dtypes[i]`) with
    /// one op, as one synchronised batch (module docs). Results are those of `allreduce`
    /// on each tensor.
    ///
    /// Errors: `InvalidArgument` naming the argument (`nbytes[i]`, lists of different
    /// lengths), `Unsupported` for an op not defined on some tensor's dtype: this rank
    /// joins as a failing rank (peers raise `Mismatch`); `Mismatch` on every rank when the
    /// ranks' batches differ (nothing written; the group stays usable).
    pub fn allreduce_coalesced(&mut self, bufs: &[Buf<'_>], counts: &[usize], dtypes: &[DType], op: ReduceOp, factor: f64) -> Result<()> {
        let checked = (|| {
            check_lists(counts, dtypes, &[("bufs", bufs.len())])?;
            for (i, ((b, &c), &d)) in bufs.iter().zip(counts).zip(dtypes).enumerate() {
                b.check(&format!("nbytes[{i}]"), c, d.size(), 1, true)?;
            }
            dtypes.iter().map(|&d| self.reduction(d, op, factor)).collect::<Result<Vec<_>>>()
        })();
        let reds = match checked {
            Ok(r) => r,
            Err(e) => return self.reject(Kind::AllreduceCoalesced, e),
        };
        let items: Vec<Item> = (0..counts.len())
            .map(|i| Item { input: bufs[i].as_ptr(), output: bufs[i].as_mut_ptr(), count: counts[i], dtype: dtypes[i] })
            .collect();
        // SAFETY: every buffer holds its count (checked above).
        unsafe { self.coalesced(Kind::AllreduceCoalesced, &items, &reds, op, factor) }
    }

    /// Allgather of every `inputs[i]` (`counts[i]` elements of `dtypes[i]`) into
    /// `outputs[i]` (`n * counts[i]`, rank r's at `[r * count, (r + 1) * count)`), as one
    /// batch. An input may be this rank's part of its own output. Errors as
    /// [`Self::allreduce_coalesced`] (`in_nbytes[i]`, `out_nbytes[i]`); an input that
    /// overlaps its output otherwise is refused (`InvalidArgument` naming `out_ptr`).
    pub fn allgather_coalesced(&mut self, inputs: &[Buf<'_>], outputs: &[Buf<'_>], counts: &[usize], dtypes: &[DType]) -> Result<()> {
        let n = self.n;
        let checked = (|| {
            check_lists(counts, dtypes, &[("inputs", inputs.len()), ("outputs", outputs.len())])?;
            for (i, (&c, &d)) in counts.iter().zip(dtypes).enumerate() {
                inputs[i].check(&format!("in_nbytes[{i}]"), c, d.size(), 1, false)?;
                outputs[i].check(&format!("out_nbytes[{i}]"), c, d.size(), n, true)?;
                let bytes = c * d.size();
                check_disjoint(
                    &format!("allgather_coalesced item {i}"),
                    &inputs[i],
                    bytes,
                    &outputs[i],
                    n * bytes,
                    Some(self.rank * bytes),
                )?;
            }
            Ok(())
        })();
        if let Err(e) = checked {
            return self.reject(Kind::AllgatherCoalesced, e);
        }
        let items: Vec<Item> = (0..counts.len())
            .map(|i| Item { input: inputs[i].as_ptr(), output: outputs[i].as_mut_ptr(), count: counts[i], dtype: dtypes[i] })
            .collect();
        // SAFETY: every buffer holds what the call moves (checked above).
        unsafe { self.coalesced(Kind::AllgatherCoalesced, &items, &[], ReduceOp::Sum, 1.0) }
    }

    /// Reduce-scatter of every `inputs[i]` (`n * counts[i]` elements of `dtypes[i]`)
    /// into `outputs[i]` (`counts[i]`: the reduction of piece `rank`), with one op, as one
    /// batch. Errors as [`Self::allreduce_coalesced`] (`in_nbytes[i]`, `out_nbytes[i]`); an
    /// output that overlaps its input is refused (`InvalidArgument` naming `out_ptr`).
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_scatter_coalesced(
        &mut self,
        inputs: &[Buf<'_>],
        outputs: &[Buf<'_>],
        counts: &[usize],
        dtypes: &[DType],
        op: ReduceOp,
        factor: f64,
    ) -> Result<()> {
        let n = self.n;
        let checked = (|| {
            check_lists(counts, dtypes, &[("inputs", inputs.len()), ("outputs", outputs.len())])?;
            for (i, (&c, &d)) in counts.iter().zip(dtypes).enumerate() {
                inputs[i].check(&format!("in_nbytes[{i}]"), c, d.size(), n, false)?;
                outputs[i].check(&format!("out_nbytes[{i}]"), c, d.size(), 1, true)?;
                let bytes = c * d.size();
                check_disjoint(&format!("reduce_scatter_coalesced item {i}"), &inputs[i], n * bytes, &outputs[i], bytes, None)?;
            }
            dtypes.iter().map(|&d| self.reduction(d, op, factor)).collect::<Result<Vec<_>>>()
        })();
        let reds = match checked {
            Ok(r) => r,
            Err(e) => return self.reject(Kind::ReduceScatterCoalesced, e),
        };
        let items: Vec<Item> = (0..counts.len())
            .map(|i| Item { input: inputs[i].as_ptr(), output: outputs[i].as_mut_ptr(), count: counts[i], dtype: dtypes[i] })
            .collect();
        // SAFETY: every buffer holds what the call moves (checked above).
        unsafe { self.coalesced(Kind::ReduceScatterCoalesced, &items, &reds, op, factor) }
    }

    /// Runs `items` as batches of at most [`Self::batch_limit`] tensors (one for an empty
    /// list, so that ranks with and without tensors still meet and compare).
    ///
    /// # Safety
    /// Every item's buffers hold what `kind` moves for its count and dtype; nothing else
    /// accesses them during the call. `reds[i]` is item i's reduction (reducing kinds).
    unsafe fn coalesced(&mut self, kind: Kind, items: &[Item], reds: &[Reduction], op: ReduceOp, factor: f64) -> Result<()> {
        let limit = self.batch_limit();
        if items.is_empty() {
            // SAFETY: nothing to access.
            return unsafe { self.batch(kind, &[], &[], op, factor) };
        }
        for (k, batch) in items.chunks(limit).enumerate() {
            let r = if reds.is_empty() { &[][..] } else { &reds[k * limit..k * limit + batch.len()] };
            // SAFETY: forwarded.
            unsafe { self.batch(kind, batch, r, op, factor)? };
        }
        Ok(())
    }

    /// One batch: table step, slot steps of the small tensors, then the large ones.
    ///
    /// # Safety
    /// As [`Self::coalesced`]; `items.len() <= batch_limit()`.
    unsafe fn batch(&mut self, kind: Kind, items: &[Item], reds: &[Reduction], op: ReduceOp, factor: f64) -> Result<()> {
        let (n, me) = (self.n, self.rank);
        let mut d = self.begin(kind, items.first().map_or(DType::U8, |i| i.dtype), None, items.len(), 0)?;
        if kind != Kind::AllgatherCoalesced {
            d.op = op as u32;
            d.factor = if op == ReduceOp::PremulSum { factor.to_bits() } else { 0 };
        }
        let slot_bytes = self.seg.slot_bytes();
        d.route(Transfer::Slots, slot_bytes);
        let width = if kind == Kind::ReduceScatterCoalesced { n } else { 1 };
        let message =
            |it: &Item| it.count.saturating_mul(it.dtype.size()).saturating_mul(if kind == Kind::AllreduceCoalesced { 1 } else { n });
        let in_batch: Vec<bool> = items.iter().map(|it| message(it) <= COALESCE_MAX_BYTES).collect();
        let small: Vec<usize> = (0..items.len()).filter(|&i| in_batch[i]).collect();
        let sizes: Vec<(usize, usize)> = small.iter().map(|&i| (items[i].count, items[i].dtype.size())).collect();
        let mine: Vec<u64> = items.iter().map(|it| word(it.count, it.dtype)).collect();
        let mut plan = Planner::new(&sizes, width, slot_bytes);
        let mut first = true;
        let mut srcs = vec![std::ptr::null::<u8>(); n];
        loop {
            let p = self.next_parity();
            let slot = self.slot(me, p);
            let pieces = plan.step(if first { table::table_bytes(mine.len()) } else { 0 });
            if first {
                // SAFETY: items.len() <= slot_bytes / 16 words: the table fits the slot.
                unsafe { table::write(slot, &mine) };
            }
            for pc in &pieces {
                let it = &items[small[pc.item]];
                let es = it.dtype.size();
                for q in 0..width {
                    // SAFETY: the planner keeps at + width * len * es <= slot_bytes; the
                    // source lies in the item's input (block q for reduce-scatter).
                    unsafe { std::ptr::copy(it.input.add((q * it.count + pc.off) * es), slot.add(pc.at + q * pc.len * es), pc.len * es) };
                }
            }
            self.sync(first.then_some(&d))?;
            if first {
                // SAFETY: every rank published its table in this step (the descriptors
                // agree, so every rank wrote `items.len()` words).
                let tables: Vec<Vec<u64>> = (0..n).map(|r| unsafe { table::read(self.slot(r, p), mine.len()) }).collect();
                if let Some(m) = disagreement(&tables) {
                    return Err(Error::Mismatch(format!("{}: {m}; no output was written and the group is still usable", d.describe())));
                }
            }
            for pc in &pieces {
                let i = small[pc.item];
                let it = &items[i];
                let es = it.dtype.size();
                match kind {
                    Kind::AllgatherCoalesced => {
                        for r in 0..n {
                            // SAFETY: rank r's slot holds this piece (same plan: equal
                            // tables); the destination lies in block r of the output.
                            unsafe { std::ptr::copy(self.slot(r, p).add(pc.at), it.output.add((r * it.count + pc.off) * es), pc.len * es) };
                        }
                    }
                    _ => {
                        let sub = if kind == Kind::ReduceScatterCoalesced { me * pc.len * es } else { 0 };
                        for (r, s) in srcs.iter_mut().enumerate() {
                            // SAFETY: inside rank r's published slot (same plan).
                            *s = unsafe { self.slot(r, p).add(pc.at + sub) };
                        }
                        // SAFETY: the sources are `len` elements in published slots; the
                        // destination lies in the item's output, which no slot overlaps.
                        unsafe { reduce_raw(&reds[i], it.output.add(pc.off * es), &srcs, pc.len) };
                    }
                }
            }
            first = false;
            if plan.done() {
                break;
            }
        }
        for (i, it) in items.iter().enumerate().filter(|&(i, _)| !in_batch[i]) {
            // SAFETY: forwarded from this function's contract.
            unsafe {
                match kind {
                    Kind::AllgatherCoalesced => self.allgather_ptrs(it.input, it.output, it.count, it.dtype)?,
                    Kind::ReduceScatterCoalesced => self.reduce_scatter_ptrs(it.input, it.output, it.count, it.dtype, op, factor)?,
                    _ => self.allreduce_ptrs(it.output, it.count, reds[i].dtype, op, factor)?,
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_covers_every_element_once_in_cache_line_pieces() {
        // (count, element size): a zero-length tensor, one that spans steps, small ones
        let sizes = [(0, 4), (3000, 4), (5, 8), (17, 2), (0, 1), (1, 1)];
        for width in [1, 3] {
            let mut plan = Planner::new(&sizes, width, 4096);
            let mut seen = vec![0usize; sizes.len()];
            let mut steps = 0;
            loop {
                let reserved = if steps == 0 { 6 * 8 } else { 0 };
                let pieces = plan.step(reserved);
                steps += 1;
                let mut end = reserved;
                for pc in &pieces {
                    assert!(pc.at % 64 == 0 && pc.at >= end, "{pc:?}");
                    end = pc.at + width * pc.len * sizes[pc.item].1;
                    assert!(end <= 4096, "{pc:?}");
                    assert_eq!(pc.off, seen[pc.item]);
                    seen[pc.item] += pc.len;
                }
                if plan.done() {
                    break;
                }
                assert!(!pieces.is_empty() && steps < 100);
            }
            assert_eq!(seen, sizes.iter().map(|s| s.0).collect::<Vec<_>>());
            assert_eq!(steps, if width == 1 { 3 } else { 9 });
        }
        let mut empty = Planner::new(&[], 1, 4096);
        assert!(empty.done() && empty.step(0).is_empty());
    }

    #[test]
    fn table_disagreements_name_the_tensor_and_both_ranks() {
        let a = vec![word(4, DType::F32), word(8, DType::I64)];
        let b = vec![word(4, DType::F32), word(8, DType::F64)];
        assert_eq!(disagreement(&[a.clone(), a.clone()]), None);
        let m = disagreement(&[a.clone(), a.clone(), b]).unwrap();
        assert!(m.contains("tensor 1") && m.contains("rank 0 has int64 x 8") && m.contains("rank 2 has float64 x 8"), "{m}");
        assert!(describe_word(0xff).contains("<dtype 255>"));
    }

    #[test]
    fn lists_of_different_lengths_and_huge_counts_are_refused_by_name() {
        let e = check_lists(&[1, 2], &[DType::F32; 2], &[("bufs", 1)]).unwrap_err().to_string();
        assert!(e.contains("bufs: expected 2 entries"), "{e}");
        let e = check_lists(&[1], &[], &[]).unwrap_err().to_string();
        assert!(e.contains("dtypes:"), "{e}");
        let e = check_lists(&[1 << 57], &[DType::U8], &[]).unwrap_err().to_string();
        assert!(e.contains("numels[0]"), "{e}");
    }
}
