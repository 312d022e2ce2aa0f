//! The group lifecycle of one rank: [`Communicator`] attaches to the group's segment
//! (waits for every rank, unlinks the file), probes single-copy transfers, and owns the
//! step protocol plumbing the collectives share (`begin`, `sync`, descriptor checks);
//! [`AbortHandle`] aborts the group from another thread. The collectives themselves live
//! in `algorithms` (slot algorithms) and `single_copy`.

use crate::cma;
use crate::desc::{check_peer_desc, Desc, Kind, FLAG_FAIL};
use crate::error::{Error, Result};
use crate::plan::{Plan, NEVER};
use crate::reduce::{DType, ReduceOp, Reduction};
use crate::segment::{self, Segment};
use crate::shm::file;
use crate::shm::wait::pid_dead;
use crate::shm::PAGE;
use crate::stream::Mode;
use crate::sync::{self, WaitCtx};
use std::path::Path;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Most places `Communicator::rotation` cuts a slot into.
pub const ROTATIONS: usize = 16;

/// Steps of the group's sequence that `Communicator::attach` takes in a group of two or
/// more ranks (the single-copy probe); the first collective's first step is
/// `ATTACH_STEPS + 1`.
pub const ATTACH_STEPS: u64 = 2;

/// Interrupt hook: returns `true` to stop waiting (e.g. a pending Ctrl-C in Python).
pub type InterruptHook = Box<dyn Fn() -> bool + Send + Sync>;

/// One rank's handle on a group's segment. Calls on one communicator are serialised by
/// `&mut self`; every rank of the group must issue the same collectives in the same order.
/// What a communicator takes from its caller at attach; the core reads no environment (the
/// Python side reads these from `FLAGOS_SHM_*` variables in `flagos_shm.config` and
/// passes them to `_core.Communicator`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Whether this rank allows single-copy transfers ([`cma`]); false on any rank turns
    /// them off for the whole group (`FLAGOS_SHM_CMA`).
    pub single_copy: bool,
    /// How this rank copies into its slot until [`Communicator::set_stream_mode`]
    /// (`FLAGOS_SHM_STREAM`).
    pub stream: Mode,
    /// Whether the progress thread of asynchronous calls runs under `SCHED_BATCH`
    /// ([`crate::progress`]; `FLAGOS_SHM_PROGRESS_BATCH`).
    pub progress_batch: bool,
}

impl Default for Settings {
    /// Single-copy allowed (where the plan's bands say), [`Mode::Auto`], `SCHED_BATCH`: what
    /// an unset environment meant.
    fn default() -> Settings {
        Settings { single_copy: true, stream: Mode::Auto, progress_batch: true }
    }
}

pub struct Communicator {
    pub(crate) seg: Arc<Segment>,
    pub(crate) rank: usize,
    pub(crate) n: usize,
    /// Steps this rank has arrived at so far.
    pub(crate) step: u64,
    /// Collectives issued so far.
    pub(crate) seq: u64,
    /// The collective in progress (the last one begun), named in error messages.
    kind: Kind,
    timeout: Duration,
    /// Set after an error that desynchronised the ranks; every later call fails with it.
    pub(crate) broken: Option<String>,
    interrupt: Option<InterruptHook>,
    /// The thresholds that choose each call's algorithm ([`crate::plan`]); single-copy
    /// ones apply only when `cma_ok`.
    plan: Plan,
    /// Whether every probe worked (the group can use single-copy transfers at all).
    cma_ok: bool,
    /// Whether every rank can also write every peer's memory (`process_vm_writev`): the
    /// single-copy broadcast's root then writes its share into the others, and the
    /// single-copy allreduce's ranks write their reduced chunks into the others (without
    /// it they meet after the reduction and read, one step more).
    pub(crate) cma_write_ok: bool,
    /// What the probe found for `cma_write_ok`.
    cma_write_probed: bool,
    /// Per-rank chunk buffers of the single-copy reductions (u64 for alignment).
    pub(crate) scratch: Vec<u64>,
    /// The direction of this rank's last single-copy collective (`single_copy`'s `publish`
    /// flips it at each).
    pub(crate) backward: bool,
    /// How this rank copies into its slot: plain or streaming stores ([`crate::stream`]).
    pub(crate) streamer: crate::stream::Streamer,
    /// What the caller passed at attach.
    settings: Settings,
}

fn ms(d: Duration) -> String {
    format!("{:.3} s", d.as_secs_f64())
}

impl Drop for Communicator {
    /// Tells the peers this rank has left the group ([`sync::leave`]): one still waiting
    /// for it, or arriving at a later call, fails at once instead of at its timeout.
    fn drop(&mut self) {
        sync::leave(&self.seg, self.rank);
    }
}

impl Communicator {
    /// Maps the segment at `path` as `rank` of `world_size`, waits until all ranks have
    /// attached (at most `timeout`) and unlinks the file. On any failure the file is
    /// unlinked too, so nothing is left in the segment directory (but only if it is named
    /// and owned like a segment: see `shm::file::remove_if_ours`). Core settings are
    /// [`Settings::default`].
    pub fn attach(path: &Path, rank: usize, world_size: usize, timeout: Duration) -> Result<Communicator> {
        Self::attach_with(path, rank, world_size, timeout, None, &[], Settings::default())
    }

    /// [`Self::attach`] with an interrupt hook, checked every few milliseconds while
    /// waiting for the other ranks (returning `true` stops with `Interrupted`), and the
    /// process ids of the ranks as far as the caller knows them (`peer_pids[r]`, 0 or
    /// missing: unknown; the c10d backend learns them through the group's store): a rank
    /// whose process exits before it attaches fails the wait with `PeerDied` at once
    /// instead of at the timeout; and the caller's `settings`.
    pub fn attach_with(
        path: &Path,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        interrupt: Option<&(dyn Fn() -> bool + Sync)>,
        peer_pids: &[u32],
        settings: Settings,
    ) -> Result<Communicator> {
        let unlink_on_err = |e: Error| {
            file::remove_if_ours(&segment::FORMAT, path);
            e
        };
        if rank >= world_size {
            return Err(unlink_on_err(Error::InvalidArgument(format!("rank: expected 0..{world_size}, got {rank}"))));
        }
        let seg = Segment::open(path, world_size).map_err(unlink_on_err)?;
        if sync::claim_rank(&seg, rank, std::process::id()) != 0 {
            return Err(unlink_on_err(Error::InvalidArgument(format!(
                "rank {rank} of segment {} is already taken by another process",
                path.display()
            ))));
        }
        sync::count_attached(&seg);
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_micros(50);
        loop {
            let a = sync::attached(&seg);
            if a >= world_size {
                break;
            }
            if Instant::now() >= deadline {
                let absent = sync::unattached(&seg);
                sync::abort(&seg, rank);
                return Err(unlink_on_err(Error::Timeout(format!(
                    "setting up shared-memory segment {}: only {a} of {world_size} ranks attached within {} (missing ranks {absent:?})",
                    path.display(),
                    ms(timeout)
                ))));
            }
            if interrupt.is_some_and(|hook| hook()) {
                sync::abort(&seg, rank);
                return Err(unlink_on_err(Error::Interrupted(format!("setting up shared-memory segment {}", path.display()))));
            }
            if let Some(r) = sync::aborted_by(&seg) {
                // A peer gave up setting up (it saw a rank exit, or timed out, or was interrupted).
                let absent = sync::unattached(&seg);
                return Err(unlink_on_err(Error::Aborted(format!(
                    "setting up shared-memory segment {}: ranks {absent:?} did not attach; rank {r} gave up \
                     setting up the group (see its error)",
                    path.display()
                ))));
            }
            // Its block is read again after the liveness check: a rank that attached, got
            // past this loop (every rank, this one too, had attached) and exited after our
            // `unattached` snapshot did attach (the core's waits look again likewise:
            // `shm::wait::Waiter::until`).
            let gone: Vec<String> = sync::unattached(&seg)
                .into_iter()
                .filter_map(|r| {
                    peer_pids
                        .get(r)
                        .filter(|&&p| p != 0 && pid_dead(p) && sync::pid_of(&seg, r) == 0)
                        .map(|p| format!("rank {r} (pid {p})"))
                })
                .collect();
            if !gone.is_empty() {
                sync::abort(&seg, rank);
                return Err(unlink_on_err(Error::PeerDied(format!(
                    "setting up shared-memory segment {}: {} exited before attaching",
                    path.display(),
                    gone.join(", ")
                ))));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
        seg.unlink()?;
        let mut comm = Communicator {
            seg: Arc::new(seg),
            rank,
            n: world_size,
            step: 0,
            seq: 0,
            kind: Kind::Barrier,
            timeout,
            broken: None,
            interrupt: None,
            plan: Plan::FALLBACK,
            cma_ok: false,
            cma_write_ok: false,
            cma_write_probed: false,
            scratch: Vec::new(),
            backward: false,
            streamer: crate::stream::Streamer::new(settings.stream),
            settings,
        };
        (comm.cma_ok, comm.cma_write_probed) = comm.probe_cma()?;
        comm.cma_write_ok = comm.cma_write_probed;
        Ok(comm)
    }

    /// The allgather message size in bytes from which single-copy transfers are used (see
    /// `cma`; allreduce and reduce-scatter: [`Self::plan`]), or `None` when the group
    /// cannot use them or the plan never does.
    pub fn single_copy_min_bytes(&self) -> Option<usize> {
        self.plan().band(Kind::Allgather).map(|b| b.min).filter(|&m| m != NEVER)
    }

    /// Sets one single-copy threshold for every collective (`None`: never use single-copy):
    /// [`Plan::with_single_copy_min`] of the current plan. Has no effect on a group that
    /// cannot use single-copy transfers. Every rank of the group must set the same value
    /// before its next collective (see [`Self::set_plan`]); meant for tests and measurements.
    pub fn set_single_copy_min_bytes(&mut self, bytes: Option<usize>) {
        self.plan = self.plan.with_single_copy_min(bytes.unwrap_or(NEVER));
    }

    /// Lets the single-copy broadcast's root write its share into the other ranks and the
    /// single-copy allreduce's ranks write their reduced chunks into the others (`true`, the
    /// default where the probe found it possible) or not (`false`: the others read, as
    /// where `process_vm_writev` is forbidden; the allreduce then takes one step more). Has
    /// no effect where the probe found it impossible. Every rank of the group must set the
    /// same value before its next collective (ranks that differ fall out of step); meant for
    /// tests and measurements.
    pub fn set_single_copy_writes(&mut self, on: bool) {
        self.cma_write_ok = on && self.cma_write_probed;
    }

    /// Whether the single-copy broadcast and allreduce write into the other ranks
    /// ([`Self::set_single_copy_writes`]).
    pub fn single_copy_writes(&self) -> bool {
        self.cma_write_ok
    }

    /// Whether every rank can read every peer's memory (probed at attach, agreed by all;
    /// [`Settings::single_copy`] false on any rank says no).
    pub fn single_copy_available(&self) -> bool {
        self.cma_ok
    }

    /// The plan calls use: the one set, with the single-copy thresholds at [`NEVER`]
    /// when the group cannot use single-copy transfers.
    pub fn plan(&self) -> Plan {
        if self.cma_ok {
            self.plan
        } else {
            self.plan.without_single_copy()
        }
    }

    /// Sets how later calls copy into this rank's slot ([`crate::stream::Mode`]; the
    /// default is [`Settings::stream`] given at attach). Ranks need not agree: the kind of
    /// store changes no byte the peers read.
    pub fn set_stream_mode(&mut self, mode: crate::stream::Mode) {
        self.streamer = crate::stream::Streamer::new(mode);
    }

    /// How later calls copy into this rank's slot ([`Self::set_stream_mode`]).
    pub fn stream_mode(&self) -> crate::stream::Mode {
        self.streamer.mode()
    }

    /// Sets the plan of later calls. Every rank of the group must set the same plan before
    /// its next collective: ranks whose plans move a call differently raise `Mismatch`
    /// (the transfer path is in the descriptor).
    pub fn set_plan(&mut self, plan: Plan) {
        self.plan = plan;
    }

    /// Whether a call of `kind` moving `bytes` (as the plan counts them) uses single-copy.
    pub(crate) fn single_copy(&self, kind: Kind, bytes: usize) -> bool {
        self.cma_ok && self.plan.band(kind).is_some_and(|b| b.contains(bytes))
    }

    /// Copies `n` bytes from `src` into this rank's slot at `dst`, with the stores the
    /// streamer chose for the call in progress ([`crate::stream::Streamer`]).
    ///
    /// # Safety
    /// As [`crate::stream::copy_to_slot`].
    pub(crate) unsafe fn to_slot(&self, dst: *mut u8, src: *const u8, n: usize) {
        // SAFETY: forwarded from this function's contract.
        unsafe { crate::stream::copy_to_slot(dst, src, n, self.streamer.streams(n)) }
    }

    /// Runs the collective `call` of `kind` moving `bytes` (S) between the streamer's
    /// `begin` and, if it succeeds, `end`, which times it ([`crate::stream::Streamer`]).
    pub(crate) fn timed<T>(&mut self, kind: Kind, bytes: usize, call: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.streamer.begin(kind as usize, bytes);
        let out = call(self)?;
        self.streamer.end();
        Ok(out)
    }

    /// Whether a local copy of `n` bytes uses streaming stores: a single-copy collective's
    /// own piece, from [`crate::stream::LOCAL_MIN_BYTES`], or, in a group of one rank, the
    /// whole message of an allgather, gather, scatter or all-to-all (`algorithms`,
    /// "n = 1"), from [`crate::stream::ALONE_MIN_BYTES`]; never in mode
    /// [`crate::stream::Mode::Plain`].
    pub(crate) fn streams_local(&self, n: usize) -> bool {
        let min = if self.n == 1 { crate::stream::ALONE_MIN_BYTES } else { crate::stream::LOCAL_MIN_BYTES };
        self.streamer.mode() != crate::stream::Mode::Plain && n >= min
    }

    /// Whether an allreduce of `bytes` through the slots takes the one-shot algorithm (a
    /// group of one rank takes neither: `algorithms`, "n = 1").
    pub(crate) fn one_shot(&self, bytes: usize) -> bool {
        bytes <= self.plan.one_shot_max
    }

    /// Checks, with every rank, that each can read each peer's memory: every rank
    /// publishes the address and value of a random probe word, reads every peer's word
    /// with `process_vm_readv`, writes it back unchanged with `process_vm_writev`, and
    /// publishes whether all reads returned the right values (which also proves the pid
    /// names the right process) and whether all writes worked. Two steps of the group's
    /// sequence; every rank gets the same answer, (read, write): read true when every rank
    /// read every peer's word, false if any rank failed (or has [`Settings::single_copy`]
    /// false); write true when, besides, every rank wrote every peer's word.
    fn probe_cma(&mut self) -> Result<(bool, bool)> {
        use std::hash::{BuildHasher, Hasher};
        if self.n == 1 {
            return Ok((false, false));
        }
        let word = Box::new(std::collections::hash_map::RandomState::new().build_hasher().finish() | 1);
        let seg = Arc::clone(&self.seg);
        sync::publish_probe(&seg, self.rank, &*word as *const u64 as u64, *word);
        self.sync(None)?;
        let (mut ok, mut write_ok) = (self.settings.single_copy, true);
        for q in (0..self.n).filter(|&q| q != self.rank) {
            if !ok {
                break;
            }
            let (pid, addr, expect) = sync::read_probe(&seg, q);
            let mut got = 0u64;
            // SAFETY: `got` is a local u64, valid for 8 bytes of writes.
            ok = unsafe { cma::read(pid, addr, &mut got as *mut u64 as *mut u8, 8) }.is_ok() && got == expect;
            // The broadcast's root writes into its peers (`process_vm_writev`): the same
            // permission as reading, but a seccomp filter may allow one and not the other.
            // Writing the word's own value back leaves it as its readers expect.
            // SAFETY: `got` is readable for 8 bytes; rank q published its word to be read
            // and (with its own value) written.
            write_ok =
                write_ok && ok && unsafe { cma::transfer(cma::Way::Write, pid, addr, &mut got as *mut u64 as *mut u8, 8, false) }.is_ok();
        }
        sync::publish_cma(&seg, self.rank, ok, ok && write_ok);
        self.sync(None)?;
        let verdicts: Vec<(bool, bool)> = (0..self.n).map(|q| sync::read_cma(&seg, q)).collect();
        let agreed = (verdicts.iter().all(|v| v.0), verdicts.iter().all(|v| v.0 && v.1));
        drop(word); // every peer has read it: they all passed the second step
        Ok(agreed)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The settings given at attach.
    pub fn settings(&self) -> Settings {
        self.settings
    }
    pub fn world_size(&self) -> usize {
        self.n
    }
    pub fn slot_bytes(&self) -> usize {
        self.seg.slot_bytes()
    }
    pub fn segment_len(&self) -> usize {
        self.seg.len()
    }
    pub fn path(&self) -> &Path {
        self.seg.path()
    }
    /// Number of collectives issued so far (the next one's sequence number).
    pub fn seq(&self) -> u64 {
        self.seq
    }
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
    pub fn set_timeout(&mut self, t: Duration) {
        self.timeout = t;
    }
    /// Runs `f` with the timeout set to `t` (when given) for this call only.
    pub fn with_timeout<R>(&mut self, t: Option<Duration>, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        let saved = self.timeout;
        if let Some(t) = t {
            self.timeout = t;
        }
        let r = f(self);
        self.timeout = saved;
        r
    }
    pub fn set_interrupt(&mut self, hook: Option<InterruptHook>) {
        self.interrupt = hook;
    }

    /// A handle that aborts the group from another thread while this communicator is
    /// busy in a collective.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle { seg: Arc::downgrade(&self.seg), rank: self.rank }
    }

    /// Aborts the group: this and every peer's pending and later calls fail.
    pub fn abort(&mut self) {
        sync::abort(&self.seg, self.rank);
        self.broken.get_or_insert_with(|| format!("the group was aborted by rank {}", self.rank));
    }

    // ----- protocol plumbing -------------------------------------------------------

    pub(crate) fn next_parity(&self) -> usize {
        ((self.step + 1) % 2) as usize
    }

    pub(crate) fn slot(&self, r: usize, p: usize) -> *mut u8 {
        self.seg.slot(r, p)
    }

    /// Rank `r`'s slot of parity `p` at this call's place for a chunk of `bytes`
    /// ([`Self::rotation`]): `bytes` bytes from the returned pointer lie inside the slot
    /// when `bytes <= slot_bytes`.
    pub(crate) fn slot_at(&self, r: usize, p: usize, bytes: usize) -> *mut u8 {
        // `wrapping_add` keeps this safe to call; the offset is inside the slot anyway.
        self.slot(r, p).wrapping_add(self.rotation(bytes))
    }

    /// Where in every slot this call puts a chunk of `bytes` that the slot holds several
    /// times over: the slot is cut into `k` = slot / `bytes` (rounded up to 4 KiB, at most
    /// [`ROTATIONS`]) places and call `seq` takes place `seq % k`, the same on every rank.
    /// Successive small collectives thus write different lines instead of rewriting the
    /// ones the peers have just read (on the AMD EPYC VM that rewrite, which must take
    /// the lines back from the peers' caches, was most of a 64-256 KiB one-shot
    /// allreduce: see `algorithms`). Returns the offset in bytes; `offset + bytes <=
    /// slot_bytes` always (0 when the chunk fills more than half the slot).
    pub(crate) fn rotation(&self, bytes: usize) -> usize {
        let span = bytes.div_ceil(PAGE).max(1) * PAGE;
        let k = (self.seg.slot_bytes() / span).min(ROTATIONS);
        if k <= 1 {
            0
        } else {
            (self.seq as usize % k) * span
        }
    }

    /// Starts a collective: refuses on a broken group, assigns its sequence number.
    /// `red` is the reduction of reducing collectives: its op and PREMUL_SUM factor go
    /// into the descriptor, so ranks must agree on both.
    pub(crate) fn begin(&mut self, kind: Kind, dtype: DType, red: Option<&Reduction>, count: usize, root: usize) -> Result<Desc> {
        if let Some(b) = &self.broken {
            return Err(Error::Aborted(format!("{}: the group is no longer usable: {b}", kind.name())));
        }
        if let Some(r) = sync::aborted_by(&self.seg) {
            self.broken = Some(format!("the group was aborted by rank {r}"));
            return Err(Error::Aborted(format!("{}: the group was aborted by rank {r}", kind.name())));
        }
        let d = Desc {
            kind: kind as u8,
            dtype: dtype as u32,
            op: red.map_or(0, |r| r.op as u32),
            flags: 0,
            count: count as u64,
            root: root as u64,
            seq: self.seq,
            factor: red.map_or(0, |r| r.factor.to_bits()),
            path: 0,
            chunk: 0,
        };
        self.seq += 1;
        self.kind = kind;
        Ok(d)
    }

    /// Arrives at the next step and waits for all ranks. With `desc`, first publishes it
    /// and afterwards checks every rank's descriptor against it.
    pub(crate) fn sync(&mut self, desc: Option<&Desc>) -> Result<()> {
        let step = self.step + 1;
        let parity = (step % 2) as usize;
        if let Some(d) = desc {
            sync::publish_desc(&self.seg, self.rank, parity, d.words());
        }
        sync::arrive(&self.seg, self.rank, step);
        self.step = step;
        let what = self.kind.name();
        let ctx = WaitCtx {
            what,
            seq: self.seq.saturating_sub(1),
            deadline: Instant::now() + self.timeout,
            timeout: self.timeout,
            interrupt: self.interrupt.as_deref().map(|h| h as &(dyn Fn() -> bool + Sync)),
        };
        if let Err(e) = sync::wait_all(&self.seg, step, &ctx) {
            // The ranks are now at different steps: nobody can continue safely. Later calls
            // quote the cause and say that the group was aborted (as the peers are told).
            sync::abort(&self.seg, self.rank);
            self.broken = Some(format!("{e}; rank {} aborted the group", self.rank));
            return Err(e);
        }
        if let Some(d) = desc {
            self.check_descs(d, parity)?;
        }
        Ok(())
    }

    fn check_descs(&self, mine: &Desc, parity: usize) -> Result<()> {
        for r in 0..self.n {
            if r == self.rank {
                continue;
            }
            let words = sync::read_desc(&self.seg, r, parity);
            check_peer_desc(mine, self.rank, r, words, self.n)?;
        }
        Ok(())
    }

    pub(crate) fn reduction(&self, dtype: DType, op: ReduceOp, factor: f64) -> Result<Reduction> {
        Reduction::new(dtype, op, factor, self.n)
    }

    pub(crate) fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.n {
            return Err(Error::InvalidArgument(format!("root: expected a group rank in 0..{}, got {root}", self.n)));
        }
        Ok(())
    }

    // ----- the two collectives without data ----------------------------------------

    /// Waits until every rank has called `barrier`.
    pub fn barrier(&mut self) -> Result<()> {
        let d = self.begin(Kind::Barrier, DType::U8, None, 0, 0)?;
        self.sync(Some(&d))
    }

    /// Joins the next position of the sequence as a rank whose arguments to `kind` were
    /// invalid: peers raise `Mismatch` naming this rank instead of waiting for it.
    pub fn fail(&mut self, kind: Option<Kind>) -> Result<()> {
        let mut d = self.begin(kind.unwrap_or(Kind::Barrier), DType::U8, None, 0, 0)?;
        d.flags = FLAG_FAIL;
        self.sync(Some(&d))
    }

    /// Joins the sequence as a rank that rejected its arguments to `kind` and returns `e`.
    pub(crate) fn reject(&mut self, kind: Kind, e: Error) -> Result<()> {
        // Peers learn it at once; if even that fails (group broken, timeout), the
        // caller's mistake is still the error that matters.
        let _ = self.fail(Some(kind));
        Err(e)
    }
}

/// Aborts a group without borrowing its communicator; see [`Communicator::abort_handle`].
/// It holds the segment weakly, so it does not keep the mapping alive once the
/// communicator is dropped (closing a group unmaps its segment at once).
#[derive(Clone)]
pub struct AbortHandle {
    seg: Weak<Segment>,
    rank: usize,
}

impl AbortHandle {
    /// Marks the group aborted and wakes every waiting rank; their calls fail with
    /// `Aborted`, and so does every later call on the group. Does nothing once the
    /// communicator has been dropped.
    pub fn abort(&self) {
        if let Some(seg) = self.seg.upgrade() {
            sync::abort(&seg, self.rank);
        }
    }

    /// Whether group rank `peer` has closed the group ([`sync::leave`]); `false` for a
    /// rank out of range, and once this communicator has been dropped.
    pub fn peer_left(&self, peer: usize) -> bool {
        self.seg.upgrade().is_some_and(|seg| peer < seg.world_size() && sync::has_left(&seg, peer))
    }
}
