//! The pair segment: its layout (header, pair line, one control block per direction,
//! the rings) and its geometry checks. The file itself (header, creation, opening, sweep,
//! the creator's lock) is a file of [`FORMAT`] in the shared-memory file layer
//! (`crate::shm::file`), as the group segments are; the header's count is the number of
//! slots per direction.

use crate::buffer::Buf;
use crate::error::{Error, Result};
use crate::shm::file::{self, Format, HEADER_BYTES};
use crate::shm::{LINE, PAGE};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64};

/// `b"FLGOSP2P"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"FLGOSP2P");
/// Bumped whenever the pair layout or protocol changes.
pub const VERSION: u32 = 1;
/// File name prefix of pair segments (shares the group segments' `flagos_shm-` prefix, so
/// leak checks that look for `flagos_shm-*` see them too).
pub const NAME_PREFIX: &str = "flagos_shm-p2p-";
/// Bytes at the start of each slot holding the chunk header.
pub(super) const SLOT_HEADER: usize = 64;
/// Default slot size: 64 KiB.
pub const DEFAULT_SLOT_BYTES: usize = 64 * 1024;
/// Default slots per direction: 4 (so a pair segment is 4 KiB + 2 * 4 * 64 KiB = 516 KiB).
pub const DEFAULT_SLOTS: usize = 4;
/// Largest accepted slot count per direction.
pub(super) const MAX_SLOTS: usize = 1024;
/// Largest accepted slot size.
pub(super) const MAX_SLOT_BYTES: usize = 1 << 26;

pub(super) const ACK_OK: u64 = 0;
pub(super) const ACK_MISMATCH: u64 = 1;

/// The pair segment's file format.
pub(crate) static FORMAT: Format = Format {
    magic: MAGIC,
    version: VERSION,
    prefix: NAME_PREFIX,
    what: "p2p segment",
    noun: "p2p segment",
    count: "slots per direction",
    check_geometry,
    bytes: segment_bytes,
    hint: "lower FLAGOS_SHM_P2P_SLOT_BYTES",
};

#[repr(C)]
pub(super) struct PairLine {
    /// Number of sides that have mapped the segment.
    pub(super) attached: AtomicU32,
    /// Non-zero once a side aborted the pair; the value is that side + 1.
    pub(super) aborted: AtomicU32,
    /// Per side: non-zero once that side closed its end.
    pub(super) closed: [AtomicU32; 2],
}

#[repr(C)]
pub(super) struct DirCtrl {
    /// Chunks published by the writer (release).
    pub(super) head: AtomicU64,
    /// Futex word: bumped after a change when `sleepers` is non-zero.
    pub(super) bell: AtomicU32,
    pub(super) sleepers: AtomicU32,
    pub(super) _pad0: [u8; LINE - 16],
    /// Chunks consumed by the reader (release).
    pub(super) tail: AtomicU64,
    /// `(message + 1) << 2 | status` of the last message the reader acknowledged.
    pub(super) ack: AtomicU64,
    /// The reader's expected size for that message (meaningful for a mismatch).
    pub(super) ack_bytes: AtomicU64,
    pub(super) _pad1: [u8; LINE - 24],
}

const _: () = assert!(HEADER_BYTES <= LINE);
const _: () = assert!(std::mem::size_of::<PairLine>() <= LINE);
const _: () = assert!(std::mem::size_of::<DirCtrl>() == 2 * LINE);
const _: () = assert!(6 * LINE <= PAGE);

/// Checks a slot count and slot size; the message names the bad one.
pub fn check_geometry(slots: usize, slot_bytes: usize) -> Result<()> {
    file::check_counts("p2p slots", slots, MAX_SLOTS, "p2p slot_bytes", slot_bytes, MAX_SLOT_BYTES)
}

/// Bytes of a pair segment with `slots` slots of `slot_bytes` per direction (unchecked;
/// at most a page plus 2 * MAX_SLOTS * MAX_SLOT_BYTES for a checked geometry).
pub fn segment_bytes(slots: usize, slot_bytes: usize) -> usize {
    PAGE + 2 * slots * slot_bytes
}

/// `InvalidArgument` unless `buf` may be written (a receive's destination).
pub(super) fn writable(buf: &Buf<'_>) -> Result<()> {
    if buf.is_writable() {
        Ok(())
    } else {
        Err(Error::InvalidArgument("p2p receive: the destination buffer is read-only".into()))
    }
}

/// Creates a pair segment in `dir` and returns its path (the caller publishes it to the
/// peer), complete or not at all and locked by its creator, as group segments are
/// (`shm::file::create`). Pages are reserved up front, so a full tmpfs fails here with the
/// bytes needed.
///
/// Errors: `InvalidArgument` for a bad geometry, `Io` naming the path and the bytes.
pub fn create(dir: &Path, slots: usize, slot_bytes: usize) -> Result<PathBuf> {
    file::create(&FORMAT, dir, slots, slot_bytes)
}
