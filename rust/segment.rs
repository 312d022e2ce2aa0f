//! The shared-memory segment of one process group: creation, attachment, layout.
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
//! slot size, never on tensor sizes.
//!
//! Lifetime: group rank 0 creates the file with `O_EXCL`, mode 0600 and an unguessable
//! name (128 random bits from `getrandom`), reserves all its pages with
//! `posix_fallocate` (so a full tmpfs fails here with a clear error instead of a SIGBUS
//! later), and writes the header. The other ranks learn the path out of band (the
//! group's c10d store), open and check it. The file is unlinked as soon as every rank has
//! attached (see `group::Communicator::attach`); the mappings stay valid.
//!
//! Liveness of a creator: from before the file has its name until it is unlinked, the
//! creating process holds an exclusive `flock` on it ([`CreatorLock`]); the kernel drops
//! the lock when the process exits, however it exits. The stale-segment sweep
//! ([`remove_stale`]) removes a file only if it can take that lock itself (without
//! waiting), so it never removes a segment whose creator may be alive. A lock is seen the
//! same way by every process that shares the file system, whatever its PID namespace,
//! unlike a pid recorded in the header (which in another container may name nobody, or
//! somebody else).

use crate::error::{Error, Result};
use memmap2::{MmapOptions, MmapRaw};
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64};

/// `b"FLGOSSHM"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"FLGOSSHM");
/// Bumped whenever the layout or the protocol changes.
pub const VERSION: u32 = 3;
/// Cache-line stride used to separate words written by different ranks.
pub const LINE: usize = 128;
/// Bytes of one rank's control block.
pub const CTRL: usize = 2 * LINE;
/// Page size assumed for alignment (x86-64 and aarch64 Linux base pages are <= 64 KiB;
/// we only need 4 KiB multiples for `posix_fallocate` and huge-page-free tmpfs).
pub const PAGE: usize = 4096;
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
pub const FS_SHARE: u64 = 32;
/// Largest accepted slot (sanity bound on a value read from shared memory or env).
pub const MAX_SLOT_BYTES: usize = 1 << 30;
/// Largest accepted group size.
pub const MAX_WORLD: usize = 4096;
/// File name prefix inside the segment directory.
pub const NAME_PREFIX: &str = "flagos_shm-";

/// Header at offset 0. Plain data, written by the creator before any other rank can know
/// the path, never written again.
#[repr(C)]
struct Header {
    magic: u64,
    version: u32,
    world_size: u32,
    slot_bytes: u64,
    total_bytes: u64,
    creator_uid: u32,
    creator_pid: u32,
}

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
    /// Result of this rank's probe of every peer: 0 not yet, 1 every read worked, 2 not.
    pub cma: AtomicU64,
    _pad0: [u8; LINE - 40],
    /// Descriptors of the collective this rank is in, indexed by step parity.
    pub desc: [[AtomicU64; DESC_WORDS]; 2],
    _pad1: [u8; LINE - 2 * DESC_WORDS * 8],
}

const _: () = assert!(std::mem::size_of::<Header>() <= LINE);
const _: () = assert!(std::mem::size_of::<Header>() == 40); // no padding: Header::parse
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
pub fn check_geometry(world_size: usize, slot_bytes: usize) -> Result<()> {
    if world_size == 0 || world_size > MAX_WORLD {
        return Err(Error::InvalidArgument(format!("world_size: expected 1..={MAX_WORLD}, got {world_size}")));
    }
    if !(PAGE..=MAX_SLOT_BYTES).contains(&slot_bytes) || slot_bytes % PAGE != 0 {
        return Err(Error::InvalidArgument(format!(
            "slot_bytes: expected a multiple of {PAGE} between {PAGE} and {MAX_SLOT_BYTES}, got {slot_bytes}"
        )));
    }
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

/// Bytes of the header at offset 0 (see [`validate_header`] for its fields).
pub const HEADER_BYTES: usize = std::mem::size_of::<Header>();

impl Header {
    /// Decodes the header's fields from its first [`HEADER_BYTES`] bytes (native endian,
    /// `repr(C)` order); `None` if `raw` is shorter.
    fn parse(raw: &[u8]) -> Option<Header> {
        let raw = raw.get(..HEADER_BYTES)?;
        let u32_at = |o: usize| u32::from_ne_bytes(raw[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_ne_bytes(raw[o..o + 8].try_into().unwrap());
        Some(Header {
            magic: u64_at(0),
            version: u32_at(8),
            world_size: u32_at(12),
            slot_bytes: u64_at(16),
            total_bytes: u64_at(24),
            creator_uid: u32_at(32),
            creator_pid: u32_at(36),
        })
    }
}

/// The layout of a segment whose header passed [`validate_header`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Group size; equals the expected one.
    pub world_size: usize,
    /// Bytes of one chunk slot; passes [`check_geometry`].
    pub slot_bytes: usize,
    /// Bytes of the whole segment: `segment_bytes(world_size, slot_bytes)`, which is also
    /// the file's length, so mapping this many bytes maps exactly the file.
    pub total_bytes: usize,
}

/// Checks a segment header, given as the first bytes of a file of `file_len` bytes,
/// against the group an attaching rank expects (`world_size`, and its own effective uid
/// `uid`). Pure: reads nothing but `raw`. `raw` is untrusted (another process wrote it),
/// so every field is checked before use, in this order: length, magic, version, group
/// size, creator uid, slot size ([`check_geometry`]), total size against both the layout
/// and `file_len`. Never panics; no arithmetic on a header value can overflow.
///
/// Errors: `InvalidArgument` naming the first field that does not match.
pub fn validate_header(raw: &[u8], world_size: usize, uid: u32, file_len: u64) -> Result<Geometry> {
    let bad = |m: String| Err(Error::InvalidArgument(m));
    let h = match Header::parse(raw) {
        Some(h) if file_len >= HEADER_BYTES as u64 => h,
        _ => return bad(format!("file is too small ({file_len} bytes) to hold a header of {HEADER_BYTES} bytes")),
    };
    if h.magic != MAGIC {
        return bad(format!("bad magic {:#x}; not a flagos_shm segment", h.magic));
    }
    if h.version != VERSION {
        return bad(format!("protocol version {} but this build speaks {VERSION}", h.version));
    }
    if h.world_size as usize != world_size {
        return bad(format!("created for {} ranks but this group has {world_size}", h.world_size));
    }
    if h.creator_uid != uid {
        return bad(format!("created by uid {} but this process runs as uid {uid}", h.creator_uid));
    }
    let Ok(slot) = usize::try_from(h.slot_bytes) else {
        return bad(format!("slot_bytes {} in the header is out of range", h.slot_bytes));
    };
    check_geometry(world_size, slot).map_err(|e| Error::InvalidArgument(format!("header: {e}")))?;
    // Bounded by check_geometry: at most MAX_WORLD * 2 * MAX_SLOT_BYTES + a few pages.
    let total = segment_bytes(world_size, slot);
    if h.total_bytes != total as u64 {
        return bad(format!("header says {} bytes but {world_size} ranks with {slot}-byte slots need {total}", h.total_bytes));
    }
    if file_len != total as u64 {
        return bad(format!("size {file_len} does not match its header ({total} bytes)"));
    }
    Ok(Geometry { world_size, slot_bytes: slot, total_bytes: total })
}

/// The header bytes `create` writes for a segment of this geometry, created by `uid`
/// and `pid`. For tests that forge or mutate headers.
#[doc(hidden)]
pub fn encode_header(world_size: u32, slot_bytes: u64, total_bytes: u64, uid: u32, pid: u32) -> [u8; HEADER_BYTES] {
    let mut b = [0u8; HEADER_BYTES];
    b[0..8].copy_from_slice(&MAGIC.to_ne_bytes());
    b[8..12].copy_from_slice(&VERSION.to_ne_bytes());
    b[12..16].copy_from_slice(&world_size.to_ne_bytes());
    b[16..24].copy_from_slice(&slot_bytes.to_ne_bytes());
    b[24..32].copy_from_slice(&total_bytes.to_ne_bytes());
    b[32..36].copy_from_slice(&uid.to_ne_bytes());
    b[36..40].copy_from_slice(&pid.to_ne_bytes());
    b
}

/// The slot size of a new segment of `world_size` ranks in `dir` when the caller asks for
/// none (`FLAGOS_SHM_SLOT_BYTES` unset): [`DEFAULT_SLOT_BYTES`] when the segment then
/// takes at most 1 / [`FS_SHARE`] of the file system's total size, else
/// [`SMALL_SLOT_BYTES`] (also when the size cannot be read). Depends only on the file
/// system's size, not on what is free now, so it is the same for every group of a job.
/// Only the rank that creates a segment calls it; the others read the slot size from the
/// segment's header.
pub fn default_slot_bytes(dir: &Path, world_size: usize) -> usize {
    slot_bytes_for(fs_bytes(dir).map(|(total, _)| total), world_size)
}

/// [`default_slot_bytes`] for a file system of `total` bytes (`None`: unknown).
pub fn slot_bytes_for(total: Option<u64>, world_size: usize) -> usize {
    let big = segment_bytes(world_size.max(1), DEFAULT_SLOT_BYTES) as u64;
    match total {
        Some(total) if big.saturating_mul(FS_SHARE) <= total => DEFAULT_SLOT_BYTES,
        _ => SMALL_SLOT_BYTES,
    }
}

/// (total, available) bytes of the file system holding `dir`.
fn fs_bytes(dir: &Path) -> Option<(u64, u64)> {
    let c = CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: `c` is a valid NUL-terminated path and `st` a properly sized out-parameter.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) == 0 {
            let frsize = st.f_frsize as u64;
            Some((st.f_blocks as u64 * frsize, st.f_bavail as u64 * frsize))
        } else {
            None
        }
    }
}

fn free_bytes(dir: &Path) -> Option<u64> {
    fs_bytes(dir).map(|(_, free)| free)
}

/// Whether `pid`, read from shared memory, can be a process id (1..=i32::MAX).
pub fn valid_pid(pid: u32) -> bool {
    pid != 0 && pid <= i32::MAX as u32
}

/// Whether process `pid` is gone (no such process, or a zombie waiting to be reaped).
pub fn pid_dead(pid: u32) -> bool {
    // 0 is "not attached yet"; above i32::MAX `kill` would read the value as a process
    // group (-1: every process we may signal), so such a word read from shared memory
    // says nothing about liveness (sync.rs reports it as a corrupt control block).
    if !valid_pid(pid) {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return true;
    }
    // A zombie still answers kill(0); its state letter in /proc/<pid>/stat is Z or X.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()).is_some_and(|c| c == 'Z' || c == 'X'),
        Err(_) => false,
    }
}

/// Takes an exclusive `flock` on `file` without waiting; `false` if another open file
/// description holds a lock on it.
pub(crate) fn try_lock_exclusive(file: &File) -> bool {
    // SAFETY: plain syscall on an fd we own.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// The lock a creating process holds on each of its segments until it unlinks them (see
/// the module docs): the open files, by path. Dropping a `File` releases its lock.
static CREATOR_LOCKS: std::sync::Mutex<Vec<(PathBuf, File)>> = std::sync::Mutex::new(Vec::new());

/// Releases this process's creator lock on `path`, if it holds one (the segment is being
/// unlinked, or its creator is giving up on it). Public (hidden) for tests, which use it
/// to stand for the creator's exit.
#[doc(hidden)]
pub fn release_creator_lock(path: &Path) {
    let mut locks = CREATOR_LOCKS.lock().unwrap_or_else(|p| p.into_inner());
    locks.retain(|(p, _)| p != path);
}

pub(crate) fn hold_creator_lock(path: &Path, file: File) {
    CREATOR_LOCKS.lock().unwrap_or_else(|p| p.into_inner()).push((path.to_path_buf(), file));
}

/// Removes segment files in `dir` left by crashed jobs: files named `flagos_shm-*`, owned
/// by this user, with our magic, whose creator no longer holds its lock on them (module
/// docs): the sweep takes the lock without waiting and removes only files it could lock.
/// A segment is unlinked as soon as all its ranks attached, so only a job that died
/// during set-up leaves one; this sweep, run whenever a group is created, bounds the leak
/// to that window. Errors are ignored (best effort). Returns the paths removed.
pub fn remove_stale(dir: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return removed };
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with(NAME_PREFIX) {
            continue;
        }
        let path = entry.path();
        let Ok(file) = OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW).open(&path) else {
            continue;
        };
        let Ok(meta) = file.metadata() else { continue };
        if !meta.file_type().is_file() || meta.uid() != uid || (meta.len() as usize) < std::mem::size_of::<Header>() {
            continue;
        }
        let mut raw = [0u8; std::mem::size_of::<Header>()];
        use std::os::unix::fs::FileExt;
        if file.read_exact_at(&mut raw, 0).is_err() {
            continue;
        }
        let Some(h) = Header::parse(&raw) else { continue };
        // The lock, not the recorded pid: in another PID namespace that pid may name nobody
        // (or another process) while the creator is alive.
        if h.magic == MAGIC && h.creator_uid == uid && try_lock_exclusive(&file) && std::fs::remove_file(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

/// Removes `path` after a failed attach, so that a segment nobody can use does not leak,
/// but only if it looks like a segment of this user: its file name starts with
/// [`NAME_PREFIX`] and it is a regular file (not a link) owned by this user. The path
/// comes from the group's store, not from this process, so it alone is not reason enough
/// to delete whatever file it names. Errors are ignored (best effort).
pub fn remove_if_segment(path: &Path) {
    let named = path.file_name().is_some_and(|n| n.to_string_lossy().starts_with(NAME_PREFIX));
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let ours = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file() && m.uid() == uid);
    if named && ours {
        let _ = std::fs::remove_file(path);
    }
    release_creator_lock(path);
}

/// 128 random bits as 32 hex digits (segment file names: unguessable).
pub(crate) fn random_hex() -> Result<String> {
    let mut buf = [0u8; 16];
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: writes at most `buf.len() - got` bytes into `buf[got..]`.
        let r = unsafe { libc::getrandom(buf[got..].as_mut_ptr().cast(), buf.len() - got, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("getrandom for a segment name", e));
        }
        got += r as usize;
    }
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// Creates a segment file in `dir` for `world_size` ranks, reserves its pages and writes
/// its header. Returns the path. The caller (group rank 0) publishes the path to its peers.
///
/// Errors: `InvalidArgument` for bad geometry; `Io` naming the path, the bytes needed and
/// the bytes free when the directory cannot hold the segment.
pub fn create(dir: &Path, world_size: usize, slot_bytes: usize) -> Result<PathBuf> {
    check_geometry(world_size, slot_bytes)?;
    remove_stale(dir);
    let total = segment_bytes(world_size, slot_bytes);
    let path = dir.join(format!("{NAME_PREFIX}{}", random_hex()?));
    create_file(dir, &path, "shared-memory segment", |file| fill(file, dir, &path, world_size, slot_bytes, total))?;
    Ok(path)
}

/// Creates the private file `path` in `dir` (mode 0600) complete or not at all, for the
/// group segments and the p2p pair segments alike: `fill` reserves and writes it. The file
/// is locked (this process is its live creator, see [`remove_stale`]) before anyone can
/// see it, and the lock is held until it is unlinked.
///
/// First choice: an unnamed file (`O_TMPFILE`) that gets its name only once filled, so a
/// creator killed at any point leaves nothing behind. Where the file system or `/proc`
/// refuses that, a named file: a creator killed between its creation and `fill` then
/// leaves a file that no sweep can identify (no header yet).
///
/// Errors: `Io` naming `what` and the path; whatever `fill` returns (the file is removed).
pub(crate) fn create_file(dir: &Path, path: &Path, what: &str, fill: impl Fn(&File) -> Result<()>) -> Result<()> {
    if let Some(file) = open_unnamed(dir) {
        // Locked before it has a name, so no sweeper ever sees it unlocked while we live.
        try_lock_exclusive(&file);
        fill(&file)?;
        if link_unnamed(&file, path).is_ok() {
            hold_creator_lock(path, file);
            return Ok(());
        }
        // Linking is refused here (no /proc, say): fall back to a named file.
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io(format!("cannot create {what} {}", path.display()), e))?;
    // The lock is taken before the header is written, so a sweeper that recognises the
    // file also sees it locked while we live.
    try_lock_exclusive(&file);
    fill(&file).inspect_err(|_| {
        let _ = std::fs::remove_file(path);
    })?;
    hold_creator_lock(path, file);
    Ok(())
}

/// Opens the segment file at `path` read-write (never following a symlink) and checks
/// that it is a regular file owned by this user with no group/other permissions, as the
/// group and pair segments are created; errors are prefixed by `ctx`.
pub(crate) fn open_private(path: &Path, ctx: &dyn Fn(&str) -> String) -> Result<(File, std::fs::Metadata)> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| Error::io(ctx("cannot open"), e))?;
    let meta = file.metadata().map_err(|e| Error::io(ctx("cannot stat"), e))?;
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    if !meta.file_type().is_file() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
        return Err(Error::InvalidArgument(ctx(&format!(
            "expected a regular file owned by uid {uid} with mode 0600, found uid {} mode {:o}",
            meta.uid(),
            meta.mode() & 0o7777
        ))));
    }
    Ok((file, meta))
}

/// An unnamed file in `dir` (`O_TMPFILE`, mode 0600), or `None` where the file system or
/// kernel does not offer them.
fn open_unnamed(dir: &Path) -> Option<File> {
    OpenOptions::new().read(true).write(true).mode(0o600).custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC).open(dir).ok()
}

/// Gives the unnamed `file` the name `path` (`linkat` through `/proc/self/fd`, which
/// needs no privilege); fails if the name exists.
fn link_unnamed(file: &File, path: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let from = std::ffi::CString::new(format!("/proc/self/fd/{}", file.as_raw_fd())).map_err(io::Error::other)?;
    let to = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: both are valid NUL-terminated paths that outlive the call.
    let rc = unsafe { libc::linkat(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::AT_SYMLINK_FOLLOW) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reserves `total` bytes for `file` (to become the segment `path` in `dir`) and maps
/// them, for the group and the p2p segments alike. Errors name `what`, `path` and, for a
/// full file system, the bytes free in `dir` and `hint` (which setting to lower).
pub(crate) fn reserve_and_map(file: &File, dir: &Path, path: &Path, total: usize, what: &str, hint: &str) -> Result<MmapRaw> {
    // SAFETY: plain syscall on an fd we own.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, total as libc::off_t) };
    if rc != 0 {
        let free = free_bytes(dir).map_or("unknown".to_string(), |f| f.to_string());
        return Err(Error::io(
            format!(
                "cannot reserve {total} bytes for {what} {} ({free} bytes free in {}; free space there, or {hint})",
                path.display(),
                dir.display()
            ),
            io::Error::from_raw_os_error(rc),
        ));
    }
    MmapOptions::new().len(total).map_raw(file).map_err(|e| Error::io(format!("cannot map {}", path.display()), e))
}

/// Reserves `total` bytes for `file` (to become the segment `path` in `dir`) and writes
/// the header. Errors name `path`; a full file system names the bytes free in `dir`.
fn fill(file: &File, dir: &Path, path: &Path, world_size: usize, slot_bytes: usize, total: usize) -> Result<()> {
    let hint = "set FLAGOS_SHM_DIR to another tmpfs or FLAGOS_SHM_SLOT_BYTES lower";
    let map = reserve_and_map(file, dir, path, total, "shared-memory segment", hint)?;
    // SAFETY: the mapping is `total` bytes, page aligned, and nobody else knows the file
    // yet, so this plain write cannot race.
    unsafe {
        (map.as_mut_ptr() as *mut Header).write(Header {
            magic: MAGIC,
            version: VERSION,
            world_size: world_size as u32,
            slot_bytes: slot_bytes as u64,
            total_bytes: total as u64,
            creator_uid: libc::geteuid(),
            creator_pid: std::process::id(),
        });
    }
    Ok(())
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
    /// see [`validate_header`]). The header is read with `pread` and checked before
    /// anything is mapped, and exactly the validated size is mapped.
    pub fn open(path: &Path, world_size: usize) -> Result<Segment> {
        let ctx = |what: &str| format!("shared-memory segment {}: {what}", path.display());
        let (file, meta) = open_private(path, &ctx)?;
        let uid = meta.uid();
        let file_len = meta.len();
        let mut raw = [0u8; HEADER_BYTES];
        if file_len >= HEADER_BYTES as u64 {
            use std::os::unix::fs::FileExt;
            file.read_exact_at(&mut raw, 0).map_err(|e| Error::io(ctx("cannot read the header"), e))?;
        }
        let geo = validate_header(&raw, world_size, uid, file_len).map_err(|e| Error::InvalidArgument(ctx(&e.to_string())))?;
        let map = MmapOptions::new().len(geo.total_bytes).map_raw(&file).map_err(|e| Error::io(ctx("cannot map"), e))?;
        Ok(Segment { map, path: path.to_path_buf(), world_size: geo.world_size, slot_bytes: geo.slot_bytes })
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
        let r = std::fs::remove_file(&self.path);
        // Once the name is gone no sweeper can find the file: the lock has done its job.
        release_creator_lock(&self.path);
        match r {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(format!("cannot unlink {}", self.path.display()), e)),
        }
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
