//! Point-to-point channels: `send`/`recv` between two ranks of a group, streamed through a
//! small, bounded shared-memory segment per pair of ranks that talk.
//!
//! A pair segment (file `flagos_shm-p2p-<32 hex digits>`, mode 0600) holds two rings, one
//! per direction; side 0 is the pair's lower group rank, side 1 the higher, and ring `d`
//! carries messages from side `d` to side `1 - d`:
//!
//! ```text
//! 0              Header      written once by the creator (magic, version, geometry, uid, pid)
//! LINE           PairLine    attached count, aborted flag, per-side closed flags
//! 2*LINE         DirCtrl 0   writer line (head, bell, sleepers), reader line (tail, ack)
//! 4*LINE         DirCtrl 1
//! PAGE           ring 0: `slots` slots of `slot_bytes`; then ring 1
//! ```
//!
//! Its size, `segment_bytes(slots, slot_bytes)`, never depends on message sizes: a message
//! of any size is cut into chunks of `slot_bytes - SLOT_HEADER` bytes. Each chunk carries a
//! header (message number on the ring, tag, total bytes, offset, length) that the reader
//! checks strictly before using any length. The writer waits for a free slot (`head - tail <
//! slots`), which is the back-pressure on a slow receiver; the reader waits for `head >
//! tail`. Publication: chunk written, then `head` (release); reader reads `head` (acquire),
//! the chunk, then stores `tail` (release) before the writer may reuse the slot.
//!
//! Matching and acknowledgement: a receive for tag T takes the first message with tag T,
//! in ring order. A message with another tag met on the way is read into process memory
//! (the stash, bounded by what the peer sent) and delivered to a later receive of its tag,
//! so order per (source, destination, tag) holds. When the receiver meets a message's first
//! chunk it acknowledges it in one word (`ack = (message + 1) << 2 | status`, with its own
//! expected size in `ack_bytes` before it): status 0 matched (or stashed), 1 size mismatch.
//! The sender's `send` returns only after that acknowledgement, so a size mismatch raises on
//! both sides (the receiver drains the message so the ring stays usable). A send therefore
//! completes when the matching receive has started (as with Gloo or NCCL), while the ring
//! lets up to `slots` chunks go ahead of the receiver.
//!
//! Waiting spins briefly, yields, then sleeps on a per-ring futex word (`bell`, bumped only
//! when someone sleeps) in slices of at most [`SLEEP_SLICE`], checking between slices the
//! deadline, the local and shared abort flags, the peer's closed flag and the peer's process
//! (`crate::segment::pid_dead`). Errors name the peer as the caller described it.
//!
//! Lifetime: one rank creates the file ([`create`]) and publishes the path out of band (the
//! group's store); both sides open it ([`Channel::open`]); the second to attach unlinks it. A
//! side that closes before its peer attached removes the file itself. [`create`] first sweeps
//! pair files of this user whose creator process is gone, so a job killed during set-up
//! leaks at most until the next channel is created.

use crate::buffer::Buf;
use crate::error::{Error, Result};
use crate::segment::random_hex;
use crate::sync::Doorbell;
use memmap2::{MmapOptions, MmapRaw};
use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

/// `b"FLGOSP2P"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"FLGOSP2P");
/// Bumped whenever the pair layout or protocol changes.
pub const VERSION: u32 = 1;
/// File name prefix of pair segments (shares the group segments' `flagos_shm-` prefix, so
/// leak checks that look for `flagos_shm-*` see them too).
pub const NAME_PREFIX: &str = "flagos_shm-p2p-";
const LINE: usize = 128;
const PAGE: usize = 4096;
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

const ACK_OK: u64 = 0;
const ACK_MISMATCH: u64 = 1;

#[repr(C)]
struct Header {
    magic: u64,
    version: u32,
    slots: u32,
    slot_bytes: u64,
    total_bytes: u64,
    creator_uid: u32,
    creator_pid: u32,
}
const HEADER_BYTES: usize = std::mem::size_of::<Header>();

#[repr(C)]
struct PairLine {
    /// Number of sides that have mapped the segment.
    attached: AtomicU32,
    /// Non-zero once a side aborted the pair; the value is that side + 1.
    aborted: AtomicU32,
    /// Per side: non-zero once that side closed its end.
    closed: [AtomicU32; 2],
}

#[repr(C)]
struct DirCtrl {
    /// Chunks published by the writer (release).
    head: AtomicU64,
    /// Futex word: bumped after a change when `sleepers` is non-zero.
    bell: AtomicU32,
    sleepers: AtomicU32,
    _pad0: [u8; LINE - 16],
    /// Chunks consumed by the reader (release).
    tail: AtomicU64,
    /// `(message + 1) << 2 | status` of the last message the reader acknowledged.
    ack: AtomicU64,
    /// The reader's expected size for that message (meaningful for a mismatch).
    ack_bytes: AtomicU64,
    _pad1: [u8; LINE - 24],
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

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

fn read_header(file: &File, len: u64) -> Option<Header> {
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
fn writable(buf: &Buf<'_>) -> Result<()> {
    if buf.is_writable() {
        Ok(())
    } else {
        Err(Error::InvalidArgument("p2p receive: the destination buffer is read-only".into()))
    }
}

/// Creates a pair segment in `dir` and returns its path (the caller publishes it to the
/// peer). Pages are reserved up front, so a full tmpfs fails here with the bytes needed.
///
/// Errors: `InvalidArgument` for a bad geometry, `Io` naming the path and the bytes.
pub fn create(dir: &Path, slots: usize, slot_bytes: usize) -> Result<PathBuf> {
    check_geometry(slots, slot_bytes)?;
    remove_stale(dir);
    let total = segment_bytes(slots, slot_bytes);
    let path = dir.join(format!("{NAME_PREFIX}{}", random_hex()?));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| Error::io(format!("cannot create p2p segment {}", path.display()), e))?;
    // Held until the file is unlinked (or this process exits), so that no sweep removes it
    // while this creator may still be setting the pair up (`remove_stale`).
    if let Ok(lock) = file.try_clone() {
        if crate::segment::try_lock_exclusive(&lock) {
            crate::segment::hold_creator_lock(&path, lock);
        }
    }
    let fail = |e: Error| {
        crate::segment::release_creator_lock(&path);
        let _ = std::fs::remove_file(&path);
        e
    };
    // SAFETY: plain syscall on an fd we own.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, total as libc::off_t) };
    if rc != 0 {
        return Err(fail(Error::io(
            format!(
                "cannot reserve {total} bytes for p2p segment {} (free space in {}, or lower FLAGOS_SHM_P2P_SLOT_BYTES)",
                path.display(),
                dir.display()
            ),
            io::Error::from_raw_os_error(rc),
        )));
    }
    let map = MmapOptions::new().len(total).map_raw(&file).map_err(|e| fail(Error::io(format!("cannot map {}", path.display()), e)))?;
    // SAFETY: the mapping is `total` >= PAGE bytes, page aligned; nobody else knows the
    // path yet, so this plain write cannot race.
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
    Ok(path)
}

/// A message read ahead of its receive (another tag was asked for first).
struct Stashed {
    tag: i64,
    data: Vec<u8>,
}

struct TxState {
    /// Number of the next message this side sends.
    next: u64,
    /// Set when a send failed half-way: the ring's state is unknown, later sends fail.
    broken: Option<String>,
}

struct RxState {
    /// Number of the next message this side reads from the ring.
    next: u64,
    stash: VecDeque<Stashed>,
    /// A message has been acknowledged and is being read: an error now leaves the ring
    /// half-read, so the direction becomes unusable.
    mid: bool,
    broken: Option<String>,
}

/// Where a message's bytes go.
enum Sink<'a> {
    /// `nbytes` (== the message size) writable bytes.
    Ptr(*mut u8),
    Vec(&'a mut Vec<u8>),
    Discard,
}

/// How one operation waits.
struct Wait<'a> {
    what: &'a str,
    deadline: Instant,
    timeout: Duration,
}

/// One side's end of a pair segment.
pub struct Channel {
    map: MmapRaw,
    path: PathBuf,
    side: usize,
    slots: usize,
    slot_bytes: usize,
    peer_pid: u32,
    peer: String,
    unlinked: AtomicBool,
    aborted: AtomicBool,
    closed: AtomicBool,
    tx: Mutex<TxState>,
    rx: Mutex<RxState>,
}

// SAFETY: the mapping is shared memory accessed through atomics and through raw copies
// whose ordering the ring protocol (module docs) establishes; per-side state is behind
// mutexes; nothing is thread-affine.
unsafe impl Send for Channel {}
// SAFETY: as for `Send`: shared use from several threads goes through atomics and the
// per-direction mutexes (sends and receives are serialised per direction).
unsafe impl Sync for Channel {}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Channel {
    /// Opens the pair segment at `path` as `side` (0: the pair's lower rank, 1: the higher)
    /// and counts this side attached; the second side to attach unlinks the file.
    /// `peer_pid` (0 if unknown) is watched while waiting; `peer` names the peer in errors.
    ///
    /// Errors: `Io` (e.g. not found), `InvalidArgument` for a file that is not a pair
    /// segment of this user or whose header does not match its size.
    pub fn open(path: &Path, side: usize, peer_pid: u32, peer: &str) -> Result<Channel> {
        if side > 1 {
            return Err(Error::InvalidArgument(format!("side: expected 0 or 1, got {side}")));
        }
        let ctx = |what: &str| format!("p2p segment {}: {what}", path.display());
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| Error::io(ctx("cannot open"), e))?;
        let meta = file.metadata().map_err(|e| Error::io(ctx("cannot stat"), e))?;
        let uid = euid();
        if !meta.file_type().is_file() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
            return Err(Error::InvalidArgument(ctx(&format!("expected a regular file owned by uid {uid} with mode 0600"))));
        }
        let bad = |m: String| Error::InvalidArgument(ctx(&m));
        let h = read_header(&file, meta.len()).ok_or_else(|| bad(format!("too small ({} bytes) for a header", meta.len())))?;
        if h.magic != MAGIC {
            return Err(bad(format!("bad magic {:#x}; not a flagos_shm p2p segment", h.magic)));
        }
        if h.version != VERSION {
            return Err(bad(format!("protocol version {} but this build speaks {VERSION}", h.version)));
        }
        if h.creator_uid != uid {
            return Err(bad(format!("created by uid {} but this process runs as uid {uid}", h.creator_uid)));
        }
        let slots = h.slots as usize;
        let slot_bytes = usize::try_from(h.slot_bytes).map_err(|_| bad(format!("slot_bytes {} out of range", h.slot_bytes)))?;
        check_geometry(slots, slot_bytes).map_err(|e| bad(format!("header: {e}")))?;
        let total = segment_bytes(slots, slot_bytes);
        if h.total_bytes != total as u64 || meta.len() != total as u64 {
            return Err(bad(format!("header says {} bytes, the file has {}, the geometry needs {total}", h.total_bytes, meta.len())));
        }
        let map = MmapOptions::new().len(total).map_raw(&file).map_err(|e| Error::io(ctx("cannot map"), e))?;
        let ch = Channel {
            map,
            path: path.to_path_buf(),
            side,
            slots,
            slot_bytes,
            peer_pid,
            peer: peer.to_owned(),
            unlinked: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            tx: Mutex::new(TxState { next: 0, broken: None }),
            rx: Mutex::new(RxState { next: 0, stash: VecDeque::new(), mid: false, broken: None }),
        };
        if ch.pair().attached.fetch_add(1, Ordering::AcqRel) + 1 >= 2 {
            ch.unlink();
        }
        Ok(ch)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn slots(&self) -> usize {
        self.slots
    }
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    pub fn segment_len(&self) -> usize {
        self.map.len()
    }
    /// Whether the file name is gone (both sides attached, or this side closed).
    pub fn is_unlinked(&self) -> bool {
        self.unlinked.load(Ordering::Acquire)
    }

    fn unlink(&self) {
        if !self.unlinked.swap(true, Ordering::AcqRel) {
            let _ = std::fs::remove_file(&self.path);
        }
        crate::segment::release_creator_lock(&self.path); // if this process created it
    }

    fn pair(&self) -> &PairLine {
        // SAFETY: offset LINE lies inside the mapping (>= PAGE bytes, checked in `open`),
        // is 8-byte aligned, and PairLine is atomics, valid for any bit pattern.
        unsafe { &*(self.map.as_ptr().add(LINE) as *const PairLine) }
    }

    fn dir(&self, d: usize) -> &DirCtrl {
        assert!(d < 2, "direction {d} out of range");
        // SAFETY: d < 2, so the block lies in [2*LINE, 6*LINE) <= PAGE, inside the mapping;
        // DirCtrl is atomics and padding, valid for any bit pattern.
        unsafe { &*(self.map.as_ptr().add(2 * LINE + d * 2 * LINE) as *const DirCtrl) }
    }

    /// Start of slot `i` of ring `d` (`slot_bytes` long, page aligned).
    fn slot(&self, d: usize, i: usize) -> *mut u8 {
        assert!(d < 2 && i < self.slots, "slot ({d}, {i}) out of range");
        // SAFETY: PAGE + (d * slots + i + 1) * slot_bytes <= segment_bytes == mapping length.
        unsafe { self.map.as_mut_ptr().add(PAGE + (d * self.slots + i) * self.slot_bytes) }
    }

    /// The chunk header words of slot `i` of ring `d`: seq, tag, total, offset, length.
    fn slot_header(&self, d: usize, i: usize) -> &[AtomicU64; 8] {
        // SAFETY: the slot starts page aligned and is >= SLOT_HEADER (64) bytes long;
        // AtomicU64 is valid for any bit pattern.
        unsafe { &*(self.slot(d, i) as *const [AtomicU64; 8]) }
    }

    fn payload(&self) -> usize {
        self.slot_bytes - SLOT_HEADER
    }

    /// Bytes of chunk `c` of a message of `total` bytes (the sender's chunking, which the
    /// reader checks), and the number of chunks (at least 1).
    fn chunks(&self, total: u64) -> u64 {
        total.div_ceil(self.payload() as u64).max(1)
    }

    fn doorbell(&self, d: usize) -> Doorbell<'_> {
        let c = self.dir(d);
        Doorbell { word: &c.bell, sleepers: &c.sleepers }
    }

    fn ring(&self, d: usize, wake: bool) {
        self.doorbell(d).ring(wake);
    }

    /// Marks the pair aborted (both sides' waits on it fail) and wakes every waiter.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        let _ = self.pair().aborted.compare_exchange(0, self.side as u32 + 1, Ordering::SeqCst, Ordering::SeqCst);
        self.ring(0, true);
        self.ring(1, true);
    }

    /// Closes this side: later calls fail, the peer's waits on this side fail, and the file
    /// is removed if the peer never attached. Idempotent.
    pub fn close(&self) {
        if !self.closed.swap(true, Ordering::SeqCst) {
            self.pair().closed[self.side].store(1, Ordering::SeqCst);
            self.ring(0, true);
            self.ring(1, true);
        }
        self.unlink();
    }

    fn check_stop(&self, w: &Wait) -> Result<()> {
        let head = || format!("{} with {}", w.what, self.peer);
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Aborted(format!("{}: this rank closed the channel", head())));
        }
        if self.aborted.load(Ordering::Acquire) {
            return Err(Error::Aborted(format!("{}: the channel was aborted on this rank", head())));
        }
        let pair = self.pair();
        if crate::segment::pid_dead(self.peer_pid) {
            return Err(Error::PeerDied(format!("{}: the peer (pid {}) exited", head(), self.peer_pid)));
        }
        if pair.aborted.load(Ordering::Acquire) != 0 {
            return Err(Error::Aborted(format!("{}: the peer aborted the channel (or the group)", head())));
        }
        if pair.closed[1 - self.side].load(Ordering::Acquire) != 0 {
            return Err(Error::Aborted(format!("{}: the peer closed its end (its process group was destroyed)", head())));
        }
        if Instant::now() >= w.deadline {
            return Err(Error::Timeout(format!("{}: not completed within the timeout of {:.3} s", head(), w.timeout.as_secs_f64())));
        }
        Ok(())
    }

    /// Waits on ring `d` until `cond()` holds (see the module docs for how).
    fn wait_for(&self, d: usize, w: &Wait, cond: impl Fn() -> bool) -> Result<()> {
        if cond() {
            return Ok(());
        }
        // A peer that closed (or exited) right after publishing what we wait for: its stores
        // came before the flag we saw (Acquire), so look once more before failing.
        let stop = || self.check_stop(w).or_else(|e| if cond() { Ok(()) } else { Err(e) });
        stop()?;
        let start = Instant::now();
        while start.elapsed() < SPIN {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
            if cond() {
                return Ok(());
            }
        }
        while start.elapsed() < SPIN + YIELD {
            std::thread::yield_now();
            if cond() {
                return Ok(());
            }
        }
        let bell = self.doorbell(d);
        loop {
            stop()?;
            let left = w.deadline.saturating_duration_since(Instant::now());
            if bell.sleep(left.min(SLEEP_SLICE), &cond, || false) {
                return Ok(());
            }
        }
    }

    fn ready(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Aborted(format!("p2p channel with {}: closed on this rank", self.peer)));
        }
        if self.aborted.load(Ordering::Acquire) {
            return Err(Error::Aborted(format!("p2p channel with {}: aborted on this rank", self.peer)));
        }
        Ok(())
    }

    /// Sends the bytes of `buf` as one message with `tag`; returns once the peer's matching
    /// receive has acknowledged it. See [`Channel::send_raw`] for the errors.
    pub fn send(&self, buf: &Buf<'_>, tag: i64, timeout: Duration) -> Result<()> {
        // SAFETY: a `Buf` is valid for `len()` bytes while it lives (`buffer` module docs),
        // and it is borrowed for the whole call.
        unsafe { self.send_raw(buf.as_ptr(), buf.len(), tag, timeout) }
    }

    /// Receives the next message with `tag` into `buf` (exactly its length). See
    /// [`Channel::recv_raw`] for the errors; `InvalidArgument` for a read-only `buf`.
    pub fn recv(&self, buf: &Buf<'_>, tag: i64, timeout: Duration) -> Result<()> {
        writable(buf)?;
        // SAFETY: as in `send`; `buf` is writable (checked above).
        unsafe { self.recv_raw(buf.as_mut_ptr(), buf.len(), tag, timeout) }
    }

    /// Like [`Channel::recv`] but returns `Ok(false)` at once when no message with `tag` is
    /// there yet (see [`Channel::try_recv_raw`]).
    pub fn try_recv(&self, buf: &Buf<'_>, tag: i64, timeout: Duration) -> Result<bool> {
        writable(buf)?;
        // SAFETY: as in `recv`.
        unsafe { self.try_recv_raw(buf.as_mut_ptr(), buf.len(), tag, timeout) }
    }

    /// Sends `nbytes` bytes at `ptr` as one message with `tag`; returns once the peer's
    /// matching receive has acknowledged it (and every chunk is in the ring).
    ///
    /// Errors: `Mismatch` if the receive expected another size (the peer raises too);
    /// `Timeout`, `PeerDied`, `Aborted` (then the direction is unusable: later sends fail).
    ///
    /// # Safety
    /// `ptr` must point to `nbytes` readable bytes that stay valid and unchanged for the call.
    unsafe fn send_raw(&self, ptr: *const u8, nbytes: usize, tag: i64, timeout: Duration) -> Result<()> {
        self.ready()?;
        let mut tx = lock(&self.tx);
        if let Some(b) = &tx.broken {
            return Err(Error::Aborted(format!("send to {}: the channel is unusable after an earlier failed send ({b})", self.peer)));
        }
        let what = format!("send of {nbytes} bytes (tag {tag})");
        let w = Wait { what: &what, deadline: Instant::now() + timeout, timeout };
        let seq = tx.next;
        // SAFETY: forwarded from the caller.
        let r = unsafe { self.send_message(seq, ptr, nbytes, tag, &w) };
        match r {
            Ok(()) | Err(Error::Mismatch(_)) => tx.next += 1,
            Err(ref e) => tx.broken = Some(e.to_string()),
        }
        r
    }

    /// # Safety
    /// As [`Channel::send`].
    unsafe fn send_message(&self, seq: u64, ptr: *const u8, nbytes: usize, tag: i64, w: &Wait) -> Result<()> {
        let d = self.side;
        let c = self.dir(d);
        let payload = self.payload();
        let total = nbytes as u64;
        let mut head = c.head.load(Ordering::Relaxed); // this side is the ring's only writer
        for chunk in 0..self.chunks(total) {
            let off = (chunk as usize) * payload;
            let len = payload.min(nbytes - off);
            let slots = self.slots as u64;
            self.wait_for(d, w, || head.wrapping_sub(c.tail.load(Ordering::Acquire)) < slots)?;
            let i = (head % slots) as usize;
            let hdr = self.slot_header(d, i);
            for (k, v) in [seq, tag as u64, total, off as u64, len as u64].into_iter().enumerate() {
                hdr[k].store(v, Ordering::Relaxed);
            }
            if len > 0 {
                // SAFETY: `ptr + off .. + len` is inside the caller's `nbytes` (off + len <=
                // nbytes); the slot's payload holds `payload >= len` bytes after the header;
                // the reader does not touch this slot until `head` is published below.
                unsafe { std::ptr::copy_nonoverlapping(ptr.add(off), self.slot(d, i).add(SLOT_HEADER), len) };
            }
            head += 1;
            c.head.store(head, Ordering::Release);
            self.ring(d, false);
        }
        self.wait_for(d, w, || c.ack.load(Ordering::Acquire) >> 2 > seq)?;
        let ack = c.ack.load(Ordering::Acquire);
        if ack >> 2 != seq + 1 {
            return Err(Error::Aborted(format!("{} with {}: corrupt acknowledgement {ack:#x} for message {seq}", w.what, self.peer)));
        }
        match ack & 3 {
            ACK_OK => Ok(()),
            ACK_MISMATCH => Err(Error::Mismatch(format!(
                "{} to {}: size mismatch: the matching receive expects {} bytes",
                w.what,
                self.peer,
                c.ack_bytes.load(Ordering::Relaxed)
            ))),
            s => Err(Error::Aborted(format!("{} with {}: corrupt acknowledgement status {s}", w.what, self.peer))),
        }
    }

    /// Receives the next message with `tag` into the `nbytes` bytes at `ptr`.
    ///
    /// Errors: `Mismatch` if the message has another size (drained; the sender raises too);
    /// `Timeout`, `PeerDied`, `Aborted` (mid-message: later receives fail).
    ///
    /// # Safety
    /// `ptr` must point to `nbytes` writable bytes that stay valid for the call.
    unsafe fn recv_raw(&self, ptr: *mut u8, nbytes: usize, tag: i64, timeout: Duration) -> Result<()> {
        self.ready()?;
        let mut rx = lock(&self.rx);
        // SAFETY: forwarded from the caller.
        unsafe { self.recv_locked(&mut rx, ptr, nbytes, tag, timeout, true) }.map(|_| ())
    }

    /// Like [`Channel::recv_raw`] but returns `Ok(false)` at once when no message with `tag` is
    /// available yet (ring empty after setting aside other tags' messages) or another
    /// thread is receiving on this channel; a message once started is read to its end.
    ///
    /// # Safety
    /// As [`Channel::recv_raw`].
    unsafe fn try_recv_raw(&self, ptr: *mut u8, nbytes: usize, tag: i64, timeout: Duration) -> Result<bool> {
        self.ready()?;
        let mut rx = match self.rx.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return Ok(false),
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.recv_locked(&mut rx, ptr, nbytes, tag, timeout, false) }
    }

    /// # Safety
    /// As [`Channel::recv`].
    unsafe fn recv_locked(&self, rx: &mut RxState, ptr: *mut u8, nbytes: usize, tag: i64, timeout: Duration, block: bool) -> Result<bool> {
        if let Some(b) = &rx.broken {
            return Err(Error::Aborted(format!(
                "receive from {}: the channel is unusable after an earlier failed receive ({b})",
                self.peer
            )));
        }
        let what = format!("receive of {nbytes} bytes (tag {tag})");
        if let Some(k) = rx.stash.iter().position(|s| s.tag == tag) {
            let s = rx.stash.remove(k).expect("index from position");
            if s.data.len() != nbytes {
                return Err(Error::Mismatch(format!("{what} from {}: size mismatch: the peer sent {} bytes", self.peer, s.data.len())));
            }
            if nbytes > 0 {
                // SAFETY: `ptr` holds `nbytes` writable bytes (caller), `s.data` as many.
                unsafe { std::ptr::copy_nonoverlapping(s.data.as_ptr(), ptr, nbytes) };
            }
            return Ok(true);
        }
        let w = Wait { what: &what, deadline: Instant::now() + timeout, timeout };
        let r = loop {
            let (mtag, total) = match self.peek_start(rx, &w, block) {
                Ok(Some(h)) => h,
                Ok(None) => break Ok(false),
                Err(e) => break Err(e),
            };
            let seq = rx.next;
            if mtag == tag && total == nbytes as u64 {
                self.acknowledge(seq, ACK_OK, nbytes);
                // SAFETY: the message is `nbytes` long; forwarded from the caller.
                if let Err(e) = self.consume(rx, seq, mtag, total, Sink::Ptr(ptr), &w) {
                    break Err(e);
                }
                break Ok(true);
            }
            if mtag == tag {
                self.acknowledge(seq, ACK_MISMATCH, nbytes);
                if let Err(e) = self.consume(rx, seq, mtag, total, Sink::Discard, &w) {
                    break Err(e);
                }
                return Err(Error::Mismatch(format!("{what} from {}: size mismatch: the peer sent {total} bytes", self.peer)));
            }
            // Another tag's message: set it aside for its own receive.
            let mut data = Vec::new();
            let size = usize::try_from(total).ok().filter(|&n| data.try_reserve_exact(n).is_ok());
            if size.is_none() {
                break Err(Error::Aborted(format!(
                    "{what} from {}: cannot hold a {total}-byte message of tag {mtag} read ahead",
                    self.peer
                )));
            }
            self.acknowledge(seq, ACK_OK, total as usize);
            if let Err(e) = self.consume(rx, seq, mtag, total, Sink::Vec(&mut data), &w) {
                break Err(e);
            }
            rx.stash.push_back(Stashed { tag: mtag, data });
        };
        if let Err(ref e) = r {
            if rx.mid && rx.broken.is_none() {
                rx.broken = Some(e.to_string());
            }
        }
        r
    }

    /// Waits (or, unless `block`, only looks) for the first chunk of the next message and
    /// returns its (tag, total bytes) after checking its header.
    fn peek_start(&self, rx: &RxState, w: &Wait, block: bool) -> Result<Option<(i64, u64)>> {
        let d = 1 - self.side;
        let c = self.dir(d);
        let tail = c.tail.load(Ordering::Relaxed); // this side is the ring's only reader
        let avail = || c.head.load(Ordering::Acquire) != tail;
        if block {
            self.wait_for(d, w, avail)?;
        } else if !avail() {
            self.check_stop(w)?;
            return Ok(None);
        }
        self.check_head(c, tail, w)?;
        let hdr = self.slot_header(d, (tail % self.slots as u64) as usize);
        let (seq, tag, total, off) = (
            hdr[0].load(Ordering::Relaxed),
            hdr[1].load(Ordering::Relaxed) as i64,
            hdr[2].load(Ordering::Relaxed),
            hdr[3].load(Ordering::Relaxed),
        );
        if seq != rx.next || off != 0 {
            return Err(Error::Aborted(format!(
                "{} from {}: corrupt ring: expected the start of message {}, found message {seq} at offset {off}",
                w.what, self.peer, rx.next
            )));
        }
        Ok(Some((tag, total)))
    }

    /// The writer's head may run at most `slots` ahead of the reader's tail.
    fn check_head(&self, c: &DirCtrl, tail: u64, w: &Wait) -> Result<()> {
        let head = c.head.load(Ordering::Acquire);
        if head.wrapping_sub(tail) > self.slots as u64 {
            return Err(Error::Aborted(format!(
                "{} from {}: corrupt ring: head {head}, tail {tail}, {} slots",
                w.what, self.peer, self.slots
            )));
        }
        Ok(())
    }

    fn acknowledge(&self, seq: u64, status: u64, nbytes: usize) {
        let c = self.dir(1 - self.side);
        c.ack_bytes.store(nbytes as u64, Ordering::Relaxed);
        c.ack.store(((seq + 1) << 2) | status, Ordering::Release);
        self.ring(1 - self.side, false);
    }

    /// Reads every chunk of message `seq` (tag `tag`, `total` bytes; its first chunk is at
    /// the tail) into `sink`, checking each chunk's header, and releases the slots.
    fn consume(&self, rx: &mut RxState, seq: u64, tag: i64, total: u64, mut sink: Sink, w: &Wait) -> Result<()> {
        let d = 1 - self.side;
        let c = self.dir(d);
        let payload = self.payload() as u64;
        let mut tail = c.tail.load(Ordering::Relaxed);
        let n = self.chunks(total);
        rx.mid = true;
        for chunk in 0..n {
            self.wait_for(d, w, || c.head.load(Ordering::Acquire) != tail)?;
            self.check_head(c, tail, w)?;
            let i = (tail % self.slots as u64) as usize;
            let hdr = self.slot_header(d, i);
            let got: [u64; 5] = std::array::from_fn(|k| hdr[k].load(Ordering::Relaxed));
            let off = chunk * payload;
            let len = payload.min(total - off);
            if got != [seq, tag as u64, total, off, len] {
                return Err(Error::Aborted(format!(
                    "{} from {}: corrupt ring: chunk {chunk} of message {seq} has header {got:?}, expected {:?}",
                    w.what,
                    self.peer,
                    [seq, tag as u64, total, off, len]
                )));
            }
            // `len <= payload < slot_bytes` and `off + len <= total`, checked above.
            let (off, len) = (off as usize, len as usize);
            let src = self.slot(d, i).wrapping_add(SLOT_HEADER);
            match &mut sink {
                // SAFETY: the destination holds `total` bytes (caller of recv), off + len <=
                // total; the slot's payload is published (acquire on head) and holds `len`.
                Sink::Ptr(p) if len > 0 => unsafe { std::ptr::copy_nonoverlapping(src, p.add(off), len) },
                // SAFETY: as above; `v` has `total` bytes reserved and exactly `off` filled.
                Sink::Vec(v) if len > 0 => v.extend_from_slice(unsafe { std::slice::from_raw_parts(src, len) }),
                _ => {}
            }
            tail += 1;
            c.tail.store(tail, Ordering::Release);
            self.ring(d, false);
        }
        rx.mid = false;
        rx.next += 1;
        Ok(())
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn pair(slots: usize, slot_bytes: usize) -> (tempdir::Dir, Arc<Channel>, Arc<Channel>) {
        let dir = tempdir::Dir::new();
        let path = create(&dir.0, slots, slot_bytes).unwrap();
        let me = std::process::id();
        let a = Channel::open(&path, 0, me, "rank 1").unwrap();
        assert!(path.exists());
        let b = Channel::open(&path, 1, me, "rank 0").unwrap();
        assert!(!path.exists(), "unlinked once both sides attached");
        (dir, Arc::new(a), Arc::new(b))
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                let base = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
                let p =
                    base.join(format!("flagos_p2p_test_{}_{:?}", std::process::id(), std::thread::current().id()).replace(['(', ')'], ""));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let left: Vec<_> = std::fs::read_dir(&self.0).unwrap().flatten().map(|e| e.path()).collect();
                let _ = std::fs::remove_dir_all(&self.0);
                assert!(left.is_empty() || std::thread::panicking(), "files left: {left:?}");
            }
        }
    }

    const T: Duration = Duration::from_secs(20);

    fn send(c: &Channel, data: &[u8], tag: i64, t: Duration) -> Result<()> {
        c.send(&Buf::from_slice(data), tag, t)
    }

    fn recv(c: &Channel, out: &mut [u8], tag: i64, t: Duration) -> Result<()> {
        c.recv(&Buf::from_mut_slice(out), tag, t)
    }

    fn try_recv(c: &Channel, out: &mut [u8], tag: i64, t: Duration) -> Result<bool> {
        c.try_recv(&Buf::from_mut_slice(out), tag, t)
    }

    #[test]
    fn streams_any_size_in_order_per_tag() {
        let (_d, a, b) = pair(2, 4096);
        let sizes = [0usize, 1, 4031, 4032, 4033, 100_003];
        let msgs: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| (0..n).map(|k| (k * 7 + i) as u8).collect()).collect();
        let sent = msgs.clone();
        let tx = std::thread::spawn(move || {
            for (i, m) in sent.iter().enumerate() {
                // tags: 0, 1, 0, 1, ... (the receiver asks for tag 1 first)
                send(&a, m, (i % 2) as i64, T).unwrap();
            }
        });
        // All tag-1 messages first, then tag 0: tag-0 ones are stashed, order kept per tag.
        let order: Vec<usize> = (0..sizes.len()).filter(|i| i % 2 == 1).chain((0..sizes.len()).filter(|i| i % 2 == 0)).collect();
        for i in order {
            let mut out = vec![0xAAu8; sizes[i]];
            recv(&b, &mut out, (i % 2) as i64, T).unwrap();
            assert_eq!(out, msgs[i], "message {i}");
        }
        tx.join().unwrap();
    }

    #[test]
    fn size_mismatch_raises_on_both_sides_and_channel_stays_usable() {
        let (_d, a, b) = pair(2, 4096);
        let a2 = Arc::clone(&a);
        let tx = std::thread::spawn(move || {
            let big = vec![1u8; 10_000];
            let e = send(&a2, &big, 3, T).unwrap_err();
            assert!(matches!(e, Error::Mismatch(_)) && e.to_string().contains("expects 16 bytes"), "{e}");
            let ok = [9u8; 5];
            send(&a2, &ok, 3, T).unwrap();
        });
        let mut out = [0u8; 16];
        let e = recv(&b, &mut out, 3, T).unwrap_err();
        assert!(matches!(e, Error::Mismatch(_)) && e.to_string().contains("sent 10000 bytes"), "{e}");
        let mut five = [0u8; 5];
        recv(&b, &mut five, 3, T).unwrap();
        assert_eq!(five, [9u8; 5]);
        tx.join().unwrap();
    }

    #[test]
    fn timeout_abort_and_close_end_waits() {
        let (_d, a, b) = pair(1, 4096);
        let t0 = Instant::now();
        let x = [0u8; 8];
        let e = send(&a, &x, 0, Duration::from_millis(100)).unwrap_err();
        assert!(matches!(e, Error::Timeout(_)) && e.to_string().contains("rank 1"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5));
        // The failed send left the ring half-used: later sends say so at once.
        let e = send(&a, &x, 0, T).unwrap_err();
        assert!(e.to_string().contains("unusable"), "{e}");
        // A receive waiting on the peer ends when the peer aborts.
        let b2 = Arc::clone(&b);
        let waiter = std::thread::spawn(move || {
            let mut y = [0u8; 8];
            // The stale message of the failed send is matched first (8 bytes, tag 0); a
            // second receive then waits until the abort.
            recv(&b2, &mut y, 0, T).unwrap();
            recv(&b2, &mut y, 0, T).unwrap_err()
        });
        std::thread::sleep(Duration::from_millis(50));
        a.abort();
        let e = waiter.join().unwrap();
        assert!(matches!(e, Error::Aborted(_)) && e.to_string().contains("aborted"), "{e}");
    }

    #[test]
    fn try_recv_does_not_block_and_open_checks_the_file() {
        let (d, a, b) = pair(2, 4096);
        let mut y = [0u8; 4];
        assert!(!try_recv(&b, &mut y, 0, T).unwrap());
        let a2 = Arc::clone(&a);
        let tx = std::thread::spawn(move || send(&a2, &[1u8, 2, 3, 4], 0, T).unwrap());
        while !try_recv(&b, &mut y, 0, T).unwrap() {
            std::thread::yield_now();
        }
        assert_eq!(y, [1, 2, 3, 4]);
        tx.join().unwrap();
        let junk = d.0.join("flagos_shm-p2p-junk");
        std::fs::write(&junk, [0u8; 64]).unwrap();
        let mut perm = std::fs::metadata(&junk).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o600);
        std::fs::set_permissions(&junk, perm).unwrap();
        let e = Channel::open(&junk, 0, 0, "x").err().unwrap();
        assert!(e.to_string().contains("bad magic"), "{e}");
        std::fs::remove_file(&junk).unwrap();
        assert!(check_geometry(0, 4096).is_err() && check_geometry(4, 1000).is_err());
    }
}
