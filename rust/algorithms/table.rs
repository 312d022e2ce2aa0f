//! Per-call tables published in the first step of a collective whose shape does not fit
//! a descriptor (alltoallv's per-peer counts, the tensors of a coalesced batch): each
//! rank writes its table as `u64` words at the start of its slot, next to the
//! descriptor, and after the step reads every peer's. Peer words are untrusted: they are
//! only compared with this rank's own, or used as loop bounds that every rank computes
//! alike from the same words; never as a size of a copy into or out of a caller buffer.

/// Bytes that `words` table words take at the start of a slot (rounded up to a cache
/// line, so the data after it starts aligned for every dtype).
pub(crate) fn table_bytes(words: usize) -> usize {
    (words * 8).div_ceil(64) * 64
}

/// Writes `words` at `slot`.
///
/// # Safety
/// `slot` is this rank's slot of the step about to be published, 8-byte aligned and at
/// least `words.len() * 8` bytes long.
pub(crate) unsafe fn write(slot: *mut u8, words: &[u64]) {
    // SAFETY: forwarded from the contract; `words` is a live slice, not in the segment.
    unsafe { std::ptr::copy_nonoverlapping(words.as_ptr(), slot.cast::<u64>(), words.len()) };
}

/// Reads `len` words from the start of `slot`.
///
/// # Safety
/// `slot` is a rank's slot of a step every rank has published (the `sync` of the step
/// returned), 8-byte aligned and at least `len * 8` bytes long.
pub(crate) unsafe fn read(slot: *const u8, len: usize) -> Vec<u64> {
    let mut out = vec![0u64; len];
    // SAFETY: forwarded; `out` has room for `len` words.
    unsafe { std::ptr::copy_nonoverlapping(slot.cast::<u64>(), out.as_mut_ptr(), len) };
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn tables_take_whole_cache_lines() {
        assert_eq!(super::table_bytes(0), 0);
        assert_eq!(super::table_bytes(1), 64);
        assert_eq!(super::table_bytes(8), 64);
        assert_eq!(super::table_bytes(9), 128);
    }
}
