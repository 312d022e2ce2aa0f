//! The pair segment: its layout (header, pair line, one control block per direction,
//! the rings), its geometry checks, creation and the sweep of files whose creator is gone.

use crate::buffer::Buf;
use crate::error::{Error, Result};
use crate::segment::random_hex;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::Duration;

/// `b"FLGOSP2P"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"FLGOSP2P");
/// Bumped whenever the pair layout or protocol changes.
pub const VERSION: u32 = 1;
/// File name prefix of pair segments (shares the group segments' `flagos_shm-` prefix, so
/// leak checks that look for `flagos_shm-*` see them too).
pub const NAME_PREFIX: &str = "flagos_shm-p2p-";
pub(super) const LINE: usize = 128;
pub(super) const PAGE: usize = 4096;
/// Bytes at the start of each slot holding the chunk header.
pub const SLOT_HEADER: usize = 64;
/// Default slot size: 64 KiB.
pub const DEFAULT_SLOT_BYTES: usize = 64 * 1024;
/// Default slots per direction: 4 (so a pair segment is 4 KiB + 2 * 4 * 64 KiB = 516 KiB).
pub const DEFAULT_SLOTS: usize = 4;
/// Largest accepted slot count per direction.
pub const MAX_SLOTS: usize = 1024;
/// Largest accepted slot size.
pub const MAX_SLOT_BYTES: usize = 1 << 26;

/// Busy-wait budget before yielding.
pub const SPIN: Duration = Duration::from_micros(20);
/// Yield budget before sleeping on the futex.
pub const YIELD: Duration = Duration::from_micros(200);
/// Longest single futex sleep (bounds how late abort, liveness and deadline checks run).
pub const SLEEP_SLICE: Duration = Duration::from_millis(20);

pub(super) const ACK_OK: u64 = 0;
pub(super) const ACK_MISMATCH: u64 = 1;

#[repr(C)]
pub(super) struct Header {
    pub(super) magic: u64,
    pub(super) version: u32,
    pub(super) slots: u32,
    pub(super) slot_bytes: u64,
    pub(super) total_bytes: u64,
    pub(super) creator_uid: u32,
    pub(super) creator_pid: u32,
}
pub(super) const HEADER_BYTES: usize = std::mem::size_of::<Header>();

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

const _: () = assert!(HEADER_BYTES == 40);
const _: () = assert!(std::mem::size_of::<PairLine>() <= LINE);
const _: () = assert!(std::mem::size_of::<DirCtrl>() == 2 * LINE);
const _: () = assert!(6 * LINE <= PAGE);

/// Checks a slot count and slot size; the message names the bad one.
pub fn check_geometry(slots: usize, slot_bytes: usize) -> Result<()> {
    if !(1..=MAX_SLOTS).contains(&slots) {
        return Err(Error::InvalidArgument(format!("p2p slots: expected 1..={MAX_SLOTS}, got {slots}")));
    }
    if !(PAGE..=MAX_SLOT_BYTES).contains(&slot_bytes) || slot_bytes % PAGE != 0 {
        return Err(Error::InvalidArgument(format!(
            "p2p slot_bytes: expected a multiple of {PAGE} between {PAGE} and {MAX_SLOT_BYTES}, got {slot_bytes}"
        )));
    }
    Ok(())
}

/// Bytes of a pair segment with `slots` slots of `slot_bytes` per direction (unchecked;
/// at most a page plus 2 * MAX_SLOTS * MAX_SLOT_BYTES for a checked geometry).
pub fn segment_bytes(slots: usize, slot_bytes: usize) -> usize {
    PAGE + 2 * slots * slot_bytes
}

pub(super) fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

pub(super) fn read_header(file: &File, len: u64) -> Option<Header> {
    if len < HEADER_BYTES as u64 {
        return None;
    }
    let mut raw = [0u8; HEADER_BYTES];
    use std::os::unix::fs::FileExt;
    file.read_exact_at(&mut raw, 0).ok()?;
    let u32_at = |o: usize| u32::from_ne_bytes(raw[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_ne_bytes(raw[o..o + 8].try_into().unwrap());
    Some(Header {
        magic: u64_at(0),
        version: u32_at(8),
        slots: u32_at(12),
        slot_bytes: u64_at(16),
        total_bytes: u64_at(24),
        creator_uid: u32_at(32),
        creator_pid: u32_at(36),
    })
}

/// Removes pair files in `dir` whose creator process is gone (owned by this user, with the
/// pair magic). Best effort; returns the paths removed.
pub fn remove_stale(dir: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return removed };
    let uid = euid();
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(NAME_PREFIX) {
            continue;
        }
        let path = entry.path();
        let Ok(file) = OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW).open(&path) else {
            continue;
        };
        let Ok(meta) = file.metadata() else { continue };
        if !meta.file_type().is_file() || meta.uid() != uid {
            continue;
        }
        let Some(h) = read_header(&file, meta.len()) else { continue };
        // Liveness by the creator's flock (as for group segments, `segment` module docs), not
        // by its pid: a creator in another PID namespace sharing this directory is alive.
        if h.magic == MAGIC && h.creator_uid == uid && crate::segment::try_lock_exclusive(&file) && std::fs::remove_file(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
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
/// (`crate::segment::create_file`). Pages are reserved up front, so a full tmpfs fails
/// here with the bytes needed.
///
/// Errors: `InvalidArgument` for a bad geometry, `Io` naming the path and the bytes.
pub fn create(dir: &Path, slots: usize, slot_bytes: usize) -> Result<PathBuf> {
    check_geometry(slots, slot_bytes)?;
    remove_stale(dir);
    let total = segment_bytes(slots, slot_bytes);
    let path = dir.join(format!("{NAME_PREFIX}{}", random_hex()?));
    crate::segment::create_file(dir, &path, "p2p segment", |file| {
        let hint = "lower FLAGOS_SHM_P2P_SLOT_BYTES";
        let map = crate::segment::reserve_and_map(file, dir, &path, total, "p2p segment", hint)?;
        // SAFETY: the mapping is `total` >= PAGE bytes, page aligned; nobody else knows
        // the file yet, so this plain write cannot race.
        unsafe {
            (map.as_mut_ptr() as *mut Header).write(Header {
                magic: MAGIC,
                version: VERSION,
                slots: slots as u32,
                slot_bytes: slot_bytes as u64,
                total_bytes: total as u64,
                creator_uid: euid(),
                creator_pid: std::process::id(),
            });
        }
        Ok(())
    })?;
    Ok(path)
}
