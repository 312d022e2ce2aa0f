//! The shared-memory segment of one process group: its layout and geometry. The file
//! itself (header, creation, opening, sweep, the creator's lock) is a file of `FORMAT`
//! in the shared-memory file layer (`crate::shm::file`, whose docs say how it is made,
//! checked and kept alive).
//!
//! Layout (all offsets in bytes; `LINE` = 128 so that no two ranks' hot words share a
//! cache line or an adjacent-line prefetch pair):
//!
//! ```text
//! 0                    Header        written once by the creator, read-only afterwards
//! LINE                 GroupLine     attached count, aborted flag, futex word, sleepers
//! 2*LINE + r*CTRL      rank r's control block (CTRL = 2*LINE):
//!                        line 0: arrival counter (u64), pid, last CPU
//!                        line 1: two collective descriptors (one per step parity)
//! data_offset          rank r's two chunk slots: data_offset + (2r + p) * slot_bytes
//! ```
//! `data_offset` is page aligned and `slot_bytes` a multiple of the page size, so the
//! segment's size, `segment_bytes(n, slot_bytes)`, depends only on the group size and the
//! slot size, never on tensor sizes. The header's count is the group size.
//!
//! Lifetime: group rank 0 creates the file ([`create`]); the other ranks learn the path out
//! of band (the group's c10d store), open and check it ([`Segment::open`]). The file is
//! unlinked as soon as every rank has attached (see `group::Communicator::attach`); the
//! mappings stay valid. Until then its creator holds a lock on it, so that the sweep of
//! stale segments ([`remove_stale`], run by every [`create`]) removes only the files of
//! crashed jobs.

use crate::error::{Error, Result};
use crate::shm::file::{self, Format, Geometry, HEADER_BYTES};
use crate::shm::{LINE, PAGE};
use memmap2::MmapRaw;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64};

/// `b"FLGOSSHM"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"FLGOSSHM");
/// Bumped whenever the layout or the protocol changes.
pub const VERSION: u32 = 4;
/// Bytes of one rank's control block.
pub(crate) const CTRL: usize = 2 * LINE;
/// Bytes of one chunk slot of a new segment, unless the caller asks for a size
/// ([`default_slot_bytes`] picks between this and [`SMALL_SLOT_BYTES`]). Each rank owns
/// two, so a group of n ranks maps n * 2 MiB plus a few KiB (4 MiB at 2 ranks, 16 MiB at
/// 8) whatever the tensor sizes. Measured on an AMD EPYC 2-vCPU VM (2026-12-01, a build
/// of the core with per-phase timers in its allreduce, world size 2, ranks pinned, two runs):
/// one 1 MiB chunk instead of four 256 KiB ones cut the two-step allreduce of 1 MiB from
/// 155-184 us to 91-96 us and of 4 MiB from 610-750 us to 365-372 us (each chunk is one
/// more pair of steps, and rewriting a slot right after the peer has read it costs far
/// more than writing it once: the copy-in of 512 KiB took 53 us in 256 KiB slots, 14 us
/// in one 1 MiB slot); 64 KiB and 256 KiB messages, and 16-64 MiB ones, measured the same
/// within noise, and broadcast of 1 MiB went from 116 to 49 us (`python -m
/// flagos_shm.bench --bind`). 2 MiB slots measured the same as 1 MiB.
pub const DEFAULT_SLOT_BYTES: usize = 1 << 20;
/// The slot of a new segment in a small file system (a container's default 64 MiB
/// `/dev/shm`, shared with DataLoader workers): n * 2 * 256 KiB per group, so 64 MiB
/// hold 63 two-rank or 31 four-rank groups. The size before [`DEFAULT_SLOT_BYTES`].
pub const SMALL_SLOT_BYTES: usize = 256 * 1024;
/// A group takes [`DEFAULT_SLOT_BYTES`] slots only if its segment then needs at most this
/// share (1 / `FS_SHARE`) of the file system's total size.
pub(crate) const FS_SHARE: u64 = 32;
/// Largest accepted slot (sanity bound on a value read from shared memory or env).
pub(crate) const MAX_SLOT_BYTES: usize = 1 << 30;
/// Largest accepted group size.
pub(crate) const MAX_WORLD: usize = 4096;
/// File name prefix inside the segment directory.
pub const NAME_PREFIX: &str = "flagos_shm-";

/// The group segment's file format.
pub(crate) static FORMAT: Format = Format {
    magic: MAGIC,
    version: VERSION,
    prefix: NAME_PREFIX,
    what: "shared-memory segment",
    noun: "segment",
    count: "ranks",
    check_geometry,
    bytes: segment_bytes,
    hint: "set FLAGOS_SHM_DIR to another tmpfs or FLAGOS_SHM_SLOT_BYTES lower",
};

/// Group-wide words, on their own line.
#[repr(C)]
pub struct GroupLine {
    /// Number of ranks that have mapped the segment.
    pub attached: AtomicU32,
    /// Non-zero once any rank aborted the group; the value is the aborting rank + 1.
    pub aborted: AtomicU32,
    /// Futex word: bumped by an arriving rank when `sleepers` is non-zero.
    pub wake: AtomicU32,
    /// Number of ranks inside (or about to enter) a futex wait on `wake`.
    pub sleepers: AtomicU32,
}

/// Number of u64 words in one collective descriptor.
pub const DESC_WORDS: usize = 7;

/// One rank's control block.
#[repr(C)]
pub struct RankCtrl {
    /// Number of steps this rank has completed the write half of (release store).
    pub arrived: AtomicU64,
    /// The rank's process id, for liveness checks.
    pub pid: AtomicU32,
    /// The CPU the rank last arrived from (`sched_getcpu`), a hint for waiters.
    pub cpu: AtomicU32,
    /// Address (in the rank's own process) of the buffer a single-copy collective reads
    /// from, published before the collective's first step (see `cma`). At attach: the
    /// address of the rank's probe word.
    pub addr: AtomicU64,
    /// The value of the rank's probe word, which peers read through `process_vm_readv` at
    /// attach to check that single-copy transfers work and reach the right process.
    pub probe: AtomicU64,
    /// Result of this rank's probe of every peer: 0 not yet, 1 every read and every
    /// write worked, 3 every read but not every write, 2 not every read.
    pub cma: AtomicU64,
    /// Non-zero once the rank has closed the group (dropped its communicator) while its
    /// process lives on: peers waiting for it fail at once instead of at the timeout.
    pub left: AtomicU32,
    _pad0: [u8; LINE - 44],
    /// Descriptors of the collective this rank is in, indexed by step parity.
    pub desc: [[AtomicU64; DESC_WORDS]; 2],
    _pad1: [u8; LINE - 2 * DESC_WORDS * 8],
}

const _: () = assert!(HEADER_BYTES <= LINE);
const _: () = assert!(std::mem::size_of::<GroupLine>() <= LINE);
const _: () = assert!(std::mem::size_of::<RankCtrl>() == CTRL);

fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Offset of the first chunk slot.
pub fn data_offset(world_size: usize) -> usize {
    align_up(2 * LINE + world_size * CTRL, PAGE)
}

/// Total bytes of a segment for `world_size` ranks with `slot_bytes` per chunk slot.
pub fn segment_bytes(world_size: usize, slot_bytes: usize) -> usize {
    data_offset(world_size) + 2 * world_size * slot_bytes
}

/// Checks a group size and slot size; returns a message naming the bad one.
pub(crate) fn check_geometry(world_size: usize, slot_bytes: usize) -> Result<()> {
    file::check_counts("world_size", world_size, MAX_WORLD, "slot_bytes", slot_bytes, MAX_SLOT_BYTES)?;
    if slot_bytes < world_size * 64 {
        // reduce-scatter, scatter and alltoall put one piece per rank in a slot: keep at
        // least 64 bytes (8 elements of the widest dtype) per piece.
        return Err(Error::InvalidArgument(format!(
            "slot_bytes: expected at least 64 bytes per rank ({} for {world_size} ranks), got {slot_bytes}",
            world_size * 64
        )));
    }
    Ok(())
}

/// Checks a segment header, given as the first bytes of a file of `file_len` bytes,
/// against the group an attaching rank expects (`world_size`, and its own effective uid
/// `uid`): `shm::file::validate_header` for `FORMAT`, whose docs list the checks. Pure, never
/// panics. The header's count is the group size.
///
/// Errors: `InvalidArgument` naming the first field that does not match.
#[doc(hidden)]
pub fn validate_header(raw: &[u8], world_size: usize, uid: u32, file_len: u64) -> Result<Geometry> {
    file::validate_header(&FORMAT, raw, Some(world_size), uid, file_len)
}

/// The header bytes [`create`] writes for a segment of this geometry, created by `uid`
/// and `pid`. For tests that forge or mutate headers.
#[doc(hidden)]
pub fn encode_header(world_size: u32, slot_bytes: u64, total_bytes: u64, uid: u32, pid: u32) -> [u8; HEADER_BYTES] {
    file::encode_header(&FORMAT, world_size, slot_bytes, total_bytes, uid, pid)
}

/// The slot size of a new segment of `world_size` ranks in `dir` when the caller asks for
/// none (`FLAGOS_SHM_SLOT_BYTES` unset): [`DEFAULT_SLOT_BYTES`] when the segment then
/// takes at most 1 / `FS_SHARE` of the file system's total size, else
/// [`SMALL_SLOT_BYTES`] (also when the size cannot be read). Depends only on the file
/// system's size, not on what is free now, so it is the same for every group of a job.
/// Only the rank that creates a segment calls it; the others read the slot size from the
/// segment's header.
pub fn default_slot_bytes(dir: &Path, world_size: usize) -> usize {
    slot_bytes_for(file::fs_bytes(dir).map(|(total, _)| total), world_size)
}

/// [`default_slot_bytes`] for a file system of `total` bytes (`None`: unknown).
pub(crate) fn slot_bytes_for(total: Option<u64>, world_size: usize) -> usize {
    let big = segment_bytes(world_size.max(1), DEFAULT_SLOT_BYTES) as u64;
    match total {
        Some(total) if big.saturating_mul(FS_SHARE) <= total => DEFAULT_SLOT_BYTES,
        _ => SMALL_SLOT_BYTES,
    }
}

/// Removes segment files in `dir` left by crashed jobs (`shm::file::remove_stale` for
/// `FORMAT`: named `flagos_shm-*`, owned by this user, with the segment magic, whose
/// creator no longer holds its lock). Best effort; returns the paths removed.
pub fn remove_stale(dir: &Path) -> Vec<PathBuf> {
    file::remove_stale(&FORMAT, dir)
}

/// Creates a segment file in `dir` for `world_size` ranks, reserves its pages and writes
/// its header (`shm::file::create`). Returns the path. The caller (group rank 0) publishes the
/// path to its peers.
///
/// Errors: `InvalidArgument` for bad geometry; `Io` naming the path, the bytes needed and
/// the bytes free when the directory cannot hold the segment.
pub fn create(dir: &Path, world_size: usize, slot_bytes: usize) -> Result<PathBuf> {
    file::create(&FORMAT, dir, world_size, slot_bytes)
}

/// A mapped, validated segment.
pub struct Segment {
    map: MmapRaw,
    path: PathBuf,
    world_size: usize,
    slot_bytes: usize,
}

// SAFETY: the mapping is shared memory accessed only through atomics and through raw
// copies whose ordering the protocol in `sync.rs` establishes; the struct itself holds
// no thread-affine state.
unsafe impl Send for Segment {}
// SAFETY: as for `Send`: shared access goes through atomics and protocol-ordered copies.
unsafe impl Sync for Segment {}

impl Segment {
    /// Opens and maps the segment at `path`, checking that it is a regular file owned by
    /// this user with no group/other permissions, and that its header matches
    /// (magic, version, `world_size`, creator uid, sizes consistent with the file size;
    /// see [`validate_header`]); `shm::file::open` for `FORMAT`.
    pub fn open(path: &Path, world_size: usize) -> Result<Segment> {
        let m = file::open(&FORMAT, path, Some(world_size))?;
        Ok(Segment { map: m.map, path: path.to_path_buf(), world_size: m.geometry.count, slot_bytes: m.geometry.slot_bytes })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    pub fn group(&self) -> &GroupLine {
        // SAFETY: offset LINE is inside the mapping (checked in `open`), 8-byte aligned,
        // and GroupLine consists of atomics, valid for any bit pattern.
        unsafe { &*(self.map.as_ptr().add(LINE) as *const GroupLine) }
    }

    /// Rank `r`'s control block. Panics if `r >= world_size` (callers index with ranks
    /// they validated).
    pub fn ctrl(&self, r: usize) -> &RankCtrl {
        assert!(r < self.world_size, "rank {r} out of range");
        // SAFETY: r < world_size so the block lies before data_offset(world_size), inside
        // the mapping; RankCtrl is atomics and padding, valid for any bit pattern.
        unsafe { &*(self.map.as_ptr().add(2 * LINE + r * CTRL) as *const RankCtrl) }
    }

    /// Start of rank `r`'s chunk slot for step parity `p` (`slot_bytes` long, page aligned).
    pub fn slot(&self, r: usize, p: usize) -> *mut u8 {
        assert!(r < self.world_size && p < 2, "slot ({r}, {p}) out of range");
        // SAFETY: the offset plus slot_bytes is <= segment_bytes == the mapping length.
        unsafe { self.map.as_mut_ptr().add(data_offset(self.world_size) + (2 * r + p) * self.slot_bytes) }
    }

    /// Removes the file name (the mapping stays valid). A missing file is not an error:
    /// another rank may have removed it first.
    pub fn unlink(&self) -> Result<()> {
        file::unlink(&self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_slot_is_large_only_where_the_file_system_has_room_for_it() {
        const MIB: u64 = 1 << 20;
        // A container's default 64 MiB /dev/shm: small slots at every group size.
        for n in [1, 2, 4, 8] {
            assert_eq!(slot_bytes_for(Some(64 * MIB), n), SMALL_SLOT_BYTES, "n = {n}");
        }
        // 12 GiB (half of a 24 GB machine): large slots up to big groups.
        assert_eq!(slot_bytes_for(Some(12 << 30), 8), DEFAULT_SLOT_BYTES);
        // The boundary: exactly FS_SHARE segments fit.
        let seg = segment_bytes(2, DEFAULT_SLOT_BYTES) as u64;
        assert_eq!(slot_bytes_for(Some(seg * FS_SHARE), 2), DEFAULT_SLOT_BYTES);
        assert_eq!(slot_bytes_for(Some(seg * FS_SHARE - 1), 2), SMALL_SLOT_BYTES);
        assert_eq!(slot_bytes_for(None, 2), SMALL_SLOT_BYTES);
        // Whatever it picks is a valid geometry.
        for n in 1..=8 {
            check_geometry(n, slot_bytes_for(Some(12 << 30), n)).unwrap();
            check_geometry(n, slot_bytes_for(None, n)).unwrap();
        }
    }

    #[test]
    fn default_slot_of_a_real_directory_is_one_of_the_two() {
        let dir = std::env::temp_dir();
        let s = default_slot_bytes(&dir, 2);
        assert!(s == DEFAULT_SLOT_BYTES || s == SMALL_SLOT_BYTES, "{s}");
    }
}
