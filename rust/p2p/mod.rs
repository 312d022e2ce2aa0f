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
//! completes when the matching receive has started (as with Gloo or NCCL), or when a receive
//! of another tag has stashed the message (then no receive may ever match it: unlike Gloo's,
//! such a send does not time out), while the ring lets up to `slots` chunks go ahead of the
//! receiver.
//!
//! Waiting is a `crate::shm::wait::Waiter`, as for the group's steps: it spins briefly,
//! yields, then sleeps on a per-ring futex word (`bell`, bumped only when someone sleeps)
//! in bounded slices, checking between slices the deadline, the local and shared abort
//! flags, the peer's closed flag and the peer's process (`crate::shm::wait::pid_dead`).
//! Errors name the peer as the caller described it.
//!
//! Lifetime: one rank creates the file ([`create`]) and publishes the path out of band (the
//! group's store); both sides open it ([`Channel::open`]); the second to attach unlinks it. A
//! side that closes before its peer attached removes the file itself. [`create`] first sweeps
//! pair files of this user whose creator process is gone, so a job killed during set-up
//! leaks at most until the next channel is created.
//!
//! Files: `pair.rs`, the pair segment's layout, file format and geometry checks; this
//! file, a [`Channel`]'s lifecycle (open, close, abort) and how it waits; `transfer.rs`,
//! sending and receiving; `tests.rs`.

mod pair;
#[cfg(test)]
mod tests;
mod transfer;

pub use pair::*;

use crate::error::{Error, Result};
use crate::shm::file;
use crate::shm::wait::{pid_dead, Doorbell, Waiter};
use crate::shm::{LINE, PAGE};
use memmap2::MmapRaw;
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

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
/// See [`Channel::watch_peer`].
type PeerGone = Box<dyn Fn() -> bool + Send + Sync>;

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
    /// Whether the peer has left the process group the channel belongs to (its group was
    /// destroyed), when the owner set it ([`Channel::watch_peer`]); checked while waiting.
    peer_gone: OnceLock<PeerGone>,
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
        let m = file::open(&FORMAT, path, None)?;
        let ch = Channel {
            map: m.map,
            path: path.to_path_buf(),
            side,
            slots: m.geometry.count,
            slot_bytes: m.geometry.slot_bytes,
            peer_pid,
            peer: peer.to_owned(),
            unlinked: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            peer_gone: OnceLock::new(),
            tx: Mutex::new(TxState { next: 0, broken: None }),
            rx: Mutex::new(RxState { next: 0, stash: VecDeque::new(), mid: false, broken: None }),
        };
        if ch.pair().attached.fetch_add(1, Ordering::AcqRel) + 1 >= 2 {
            ch.unlink();
        }
        Ok(ch)
    }

    /// Makes waits on this channel fail (`Aborted`) once `gone()` returns true: the peer
    /// has left the process group the channel serves while its process lives on (say,
    /// `destroy_process_group` before a receive it never attached for). Checked every
    /// sleep slice. Only the first call has an effect.
    pub fn watch_peer(&self, gone: impl Fn() -> bool + Send + Sync + 'static) {
        let _ = self.peer_gone.set(Box::new(gone));
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
            // Also releases the creator's lock, if this process created the file.
            let _ = file::unlink(&self.path);
        }
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
        if pid_dead(self.peer_pid) {
            return Err(Error::PeerDied(format!("{}: the peer (pid {}) exited", head(), self.peer_pid)));
        }
        if pair.aborted.load(Ordering::Acquire) != 0 {
            return Err(Error::Aborted(format!("{}: the peer aborted the channel (or the group)", head())));
        }
        if pair.closed[1 - self.side].load(Ordering::Acquire) != 0 {
            return Err(Error::Aborted(format!("{}: the peer closed its end (its process group was destroyed)", head())));
        }
        if self.peer_gone.get().is_some_and(|gone| gone()) {
            return Err(Error::Aborted(format!("{}: the peer closed the process group (destroy_process_group)", head())));
        }
        if Instant::now() >= w.deadline {
            return Err(Error::Timeout(format!("{}: not completed within the timeout of {:.3} s", head(), w.timeout.as_secs_f64())));
        }
        Ok(())
    }

    /// Waits on ring `d` until `cond()` holds (see the module docs for how). A peer that
    /// closed (or exited) right after publishing what we wait for is not reported: the
    /// [`Waiter`] looks at `cond` once more after a failed check.
    fn wait_for(&self, d: usize, w: &Wait, cond: impl Fn() -> bool) -> Result<()> {
        Waiter::new(self.doorbell(d), w.deadline).check_first().until(cond, || self.check_stop(w), || false)
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
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.close();
    }
}
