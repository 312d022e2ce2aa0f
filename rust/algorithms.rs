//! The collectives, built on the segment's chunk slots and the step protocol of `sync.rs`.
//!
//! Every collective streams its message through the per-rank chunk slots, one chunk per
//! step (two for the large allreduce), so any message size fits a segment of a fixed size.
//! The first step of every collective also exchanges a *descriptor* (kind, dtype, count,
//! reduce op, root, sequence number): before reading any peer data, each rank compares
//! all descriptors, so ranks that issued different collectives at the same position of the
//! group's sequence, or a rank whose arguments failed validation ([`Communicator::fail`]),
//! make every rank raise `Mismatch` after that one step. All ranks then have taken the
//! same number of steps and the group stays usable. A timeout, a dead peer or an interrupt
//! leaves the ranks at different steps, so it aborts the group for everyone instead.
//!
//! Algorithms (n = group size, S = message bytes, per-rank slot of `slot_bytes`):
//! - allreduce, S <= [`ONE_SHOT_MAX_BYTES`] (or n = 1): one step per chunk: every rank copies its
//!   chunk into its slot, then reduces all n slots in rank order into its output.
//! - allreduce, larger: the reduce-scatter + allgather decomposition of ring allreduce
//!   (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
//!   workstations", JPDC 2009), done directly in shared memory, where every rank can read
//!   every slot, so the n-1 ring steps of each phase collapse into one: step A, every rank
//!   copies the pieces of its chunk that its peers reduce into its slot and reduces its own
//!   1/n slice from the n - 1 peer slots and its own buffer (in rank order) into its other
//!   slot; step B, every rank copies all n reduced slices out. Each element
//!   is reduced by exactly one rank in rank order, so all ranks get the same bits.
//! - allgather / gather: every rank copies its chunk in; all ranks (gather: the root) copy
//!   all n chunks out. broadcast: the root copies in, the others copy out.
//! - reduce: as the one-shot allreduce, only the root reduces.
//! - reduce-scatter / alltoall: each rank copies the chunk of each of its n pieces in;
//!   rank r reduces (alltoall: copies) piece r from every slot. scatter: the root copies
//!   the chunk of each piece in, rank r copies piece r out.

use crate::buffer::Buf;
use crate::cma;
use crate::error::{Error, Result};
use crate::reduce::{reduce_raw, DType, ReduceOp, Reduction};
use crate::segment::{self, Segment, DESC_WORDS};
use crate::sync::{self, WaitCtx};
use std::path::Path;
use std::sync::{Arc, Weak};
use std::ptr::copy_nonoverlapping;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Allreduce messages up to this many bytes use the one-shot algorithm. Below it the
/// second synchronisation of the two-step algorithm costs more than the redundant
/// reduction it saves (DeepSpeed and vLLM switch in the same range; tune with
/// `cargo bench` / `python -m flagos_shm.bench`). Above it the two-step algorithm wins
/// also with 2 ranks, where it copies in and reduces half the chunk: 2 processes, core
/// alone, 1 MiB float32 SUM, median of 2000 calls: 161 us one-shot, 152 us two-step.
pub const ONE_SHOT_MAX_BYTES: usize = 256 * 1024;

/// Steps of the group's sequence that `Communicator::attach` takes in a group of two or
/// more ranks (the single-copy probe); the first collective's first step is
/// `ATTACH_STEPS + 1`.
pub const ATTACH_STEPS: u64 = 2;

/// Allgather and reduce-scatter messages of at least this many bytes (the allgather's
/// output, the reduce-scatter's input) use single-copy transfers (`cma`) when the group
/// supports them; smaller ones go through the slots, where a synchronisation and a copy
/// cost less than the system calls. Allreduce switches at [`ALLREDUCE_CMA_FACTOR`] times
/// this size. Broadcast always uses the slots: its chunks pipeline (the root fills chunk
/// k + 1 while peers copy chunk k out), which beat one `process_vm_readv` per peer.
///
/// Source: `python -m flagos_shm.bench --bind` at world size 2 on our 2-vCPU VMs with
/// `FLAGOS_SHM_CMA=0` and `1` alternately (median us, slots / single-copy): allgather 42 /
/// 28 at 256 KiB, 139 / 81 at 1 MiB, 1955 / 1385 at 16 MiB; reduce-scatter 39 / 28 at
/// 256 KiB, 1876 / 1369 at 16 MiB; allreduce 51 / 60 at 256 KiB, about equal at 1 MiB,
/// 717 / 602 at 4 MiB, 2761 / 2192 at 16 MiB; broadcast 1358 / 1623 at 16 MiB.
pub const CMA_MIN_BYTES: usize = 256 * 1024;

/// Allreduce uses single-copy transfers from this multiple of the group's
/// single-copy threshold (2 MiB by default; see [`CMA_MIN_BYTES`]).
pub const ALLREDUCE_CMA_FACTOR: usize = 8;

/// Bytes per peer read at a time by the single-copy reductions (64 KiB to 1 MiB measured
/// within noise of each other).
pub const CMA_CHUNK_BYTES: usize = 128 * 1024;

/// Collective kinds, as exchanged in descriptors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Barrier = 1,
    Allreduce = 2,
    Broadcast = 3,
    Reduce = 4,
    Allgather = 5,
    ReduceScatter = 6,
    Gather = 7,
    Scatter = 8,
    Alltoall = 9,
}

impl Kind {
    /// Every kind, in code order.
    pub const ALL: [Kind; 9] = [
        Kind::Barrier,
        Kind::Allreduce,
        Kind::Broadcast,
        Kind::Reduce,
        Kind::Allgather,
        Kind::ReduceScatter,
        Kind::Gather,
        Kind::Scatter,
        Kind::Alltoall,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Kind::Barrier => "barrier",
            Kind::Allreduce => "allreduce",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::Allgather => "allgather",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::Gather => "gather",
            Kind::Scatter => "scatter",
            Kind::Alltoall => "alltoall",
        }
    }
    /// The kind a c10d method name belongs to: `"allreduce_coalesced"`,
    /// `"all_gather_single"`, `"_reduce_scatter_base"`, `"alltoall_base"`, ... (case and
    /// underscores are ignored). `None` for an unknown name.
    pub fn from_name(name: &str) -> Option<Kind> {
        let n: String = name.chars().filter(|c| *c != '_').collect::<String>().to_ascii_lowercase();
        let order = [
            ("reducescatter", Kind::ReduceScatter),
            ("allreduce", Kind::Allreduce),
            ("allgather", Kind::Allgather),
            ("alltoall", Kind::Alltoall),
            ("broadcast", Kind::Broadcast),
            ("barrier", Kind::Barrier),
            ("reduce", Kind::Reduce),
            ("gather", Kind::Gather),
            ("scatter", Kind::Scatter),
        ];
        order.into_iter().find(|(k, _)| n.contains(k)).map(|(_, kind)| kind)
    }
    fn from_code(c: u8) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| *k as u8 == c)
    }
}

const FLAG_FAIL: u64 = 1;

/// What one rank says it is doing at one sequence position. Public (hidden) only so the
/// fuzz tests can drive [`Desc::decode`] and [`check_peer_desc`].
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    pub kind: u8,
    pub dtype: u32,
    pub op: u32,
    pub flags: u64,
    pub count: u64,
    pub root: u64,
    pub seq: u64,
    /// PREMUL_SUM's factor as f64 bits (0 otherwise): ranks must agree on it.
    pub factor: u64,
}

impl Desc {
    /// The words published in the control block: kind | dtype << 8 | op << 16, flags,
    /// count, root, seq, factor.
    pub fn words(&self) -> [u64; DESC_WORDS] {
        [self.kind as u64 | (self.dtype as u64) << 8 | (self.op as u64) << 16, self.flags, self.count, self.root, self.seq, self.factor]
    }
    /// Decodes descriptor words read from a peer's control block in a group of `world`
    /// ranks. The words are untrusted, so each field is checked: a known kind, dtype and
    /// reduce-op code, the unused bits of word 0 and of `flags` clear, `root < world`.
    /// `count`, `seq` and `factor` are only ever compared with the local descriptor, never
    /// used as a size or an index. Never panics.
    ///
    /// Errors: `Mismatch` naming the first bad field.
    pub fn decode(w: [u64; DESC_WORDS], world: usize) -> Result<Desc> {
        let d = Desc {
            kind: (w[0] & 0xff) as u8,
            dtype: ((w[0] >> 8) & 0xff) as u32,
            op: ((w[0] >> 16) & 0xff) as u32,
            flags: w[1],
            count: w[2],
            root: w[3],
            seq: w[4],
            factor: w[5],
        };
        let bad = |what: String| Err(Error::Mismatch(format!("malformed descriptor: {what}")));
        if w[0] >> 24 != 0 {
            return bad(format!("reserved bits set in word 0 ({:#x})", w[0]));
        }
        if Kind::from_code(d.kind).is_none() {
            return bad(format!("unknown collective kind {}", d.kind));
        }
        if DType::from_code(d.dtype).is_none() {
            return bad(format!("unknown dtype code {}", d.dtype));
        }
        if ReduceOp::from_code(d.op).is_err() {
            return bad(format!("unknown reduce op code {}", d.op));
        }
        if d.flags & !FLAG_FAIL != 0 {
            return bad(format!("unknown flags {:#x}", d.flags));
        }
        if d.root >= world as u64 {
            return bad(format!("root {} outside 0..{world}", d.root));
        }
        Ok(d)
    }
    fn same_call(&self, o: &Desc) -> bool {
        (self.kind, self.dtype, self.op, self.count, self.root, self.seq, self.factor)
            == (o.kind, o.dtype, o.op, o.count, o.root, o.seq, o.factor)
    }
    /// Human-readable form, robust to garbage read from a misbehaving peer.
    fn describe(&self) -> String {
        let kind = Kind::from_code(self.kind).map_or_else(|| format!("<kind {}>", self.kind), |k| k.name().to_string());
        if self.kind == Kind::Barrier as u8 || self.flags & FLAG_FAIL != 0 {
            return format!("{kind} #{}", self.seq);
        }
        let dtype = DType::from_code(self.dtype).map_or_else(|| format!("<dtype {}>", self.dtype), |d| d.name().to_string());
        let mut s = format!("{kind} #{} ({dtype} x {} elements", self.seq, self.count);
        if matches!(Kind::from_code(self.kind), Some(Kind::Allreduce | Kind::Reduce | Kind::ReduceScatter)) {
            s += &format!(", {}", ReduceOp::from_code(self.op).map_or("<op?>", |o| o.name()));
            if self.op == ReduceOp::PremulSum as u32 {
                s += &format!(" factor {}", f64::from_bits(self.factor));
            }
        }
        if matches!(Kind::from_code(self.kind), Some(Kind::Broadcast | Kind::Reduce | Kind::Gather | Kind::Scatter)) {
            s += &format!(", root {}", self.root);
        }
        s + ")"
    }
}

/// Interrupt hook: returns `true` to stop waiting (e.g. a pending Ctrl-C in Python).
pub type InterruptHook = Box<dyn Fn() -> bool + Send + Sync>;

/// One rank's handle on a group's segment. Calls on one communicator are serialised by
/// `&mut self`; every rank of the group must issue the same collectives in the same order.
pub struct Communicator {
    seg: Arc<Segment>,
    rank: usize,
    n: usize,
    /// Steps this rank has arrived at so far.
    step: u64,
    /// Collectives issued so far.
    seq: u64,
    /// The collective in progress (the last one begun), named in error messages.
    kind: Kind,
    timeout: Duration,
    /// Set after an error that desynchronised the ranks; every later call fails with it.
    broken: Option<String>,
    interrupt: Option<InterruptHook>,
    /// Allgather/reduce-scatter messages of at least this many bytes (allreduce:
    /// [`ALLREDUCE_CMA_FACTOR`] times as many) use single-copy collectives; `usize::MAX`
    /// when some rank cannot read some peer's memory (probed at attach, agreed by all).
    cma_min: usize,
    /// Whether every probe worked (the group can use single-copy transfers at all).
    cma_ok: bool,
    /// Per-rank chunk buffers of the single-copy reductions (u64 for alignment).
    scratch: Vec<u64>,
}

fn ms(d: Duration) -> String {
    format!("{:.3} s", d.as_secs_f64())
}

impl Communicator {
    /// Maps the segment at `path` as `rank` of `world_size`, waits until all ranks have
    /// attached (at most `timeout`) and unlinks the file. On any failure the file is
    /// unlinked too, so nothing is left in the segment directory (but only if it is named
    /// and owned like a segment: see [`segment::remove_if_segment`]).
    pub fn attach(path: &Path, rank: usize, world_size: usize, timeout: Duration) -> Result<Communicator> {
        Self::attach_with(path, rank, world_size, timeout, None, &[])
    }

    /// [`Self::attach`] with an interrupt hook, checked every few milliseconds while
    /// waiting for the other ranks (returning `true` stops with `Interrupted`), and the
    /// process ids of the ranks as far as the caller knows them (`peer_pids[r]`, 0 or
    /// missing: unknown; the c10d backend learns them through the group's store): a rank
    /// whose process exits before it attaches fails the wait with `PeerDied` at once
    /// instead of at the timeout.
    pub fn attach_with(
        path: &Path,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        interrupt: Option<&(dyn Fn() -> bool + Sync)>,
        peer_pids: &[u32],
    ) -> Result<Communicator> {
        let unlink_on_err = |e: Error| {
            segment::remove_if_segment(path);
            e
        };
        if rank >= world_size {
            return Err(unlink_on_err(Error::InvalidArgument(format!("rank: expected 0..{world_size}, got {rank}"))));
        }
        let seg = Segment::open(path, world_size).map_err(unlink_on_err)?;
        let me = seg.ctrl(rank);
        if me.pid.swap(std::process::id(), Ordering::AcqRel) != 0 {
            return Err(unlink_on_err(Error::InvalidArgument(format!(
                "rank {rank} of segment {} is already taken by another process",
                path.display()
            ))));
        }
        let g = seg.group();
        g.attached.fetch_add(1, Ordering::AcqRel);
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_micros(50);
        loop {
            let a = g.attached.load(Ordering::Acquire) as usize;
            if a >= world_size {
                break;
            }
            if Instant::now() >= deadline {
                let absent: Vec<usize> = (0..world_size).filter(|&r| seg.ctrl(r).pid.load(Ordering::Acquire) == 0).collect();
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
                let absent: Vec<usize> = (0..world_size).filter(|&q| seg.ctrl(q).pid.load(Ordering::Acquire) == 0).collect();
                return Err(unlink_on_err(Error::Aborted(format!(
                    "setting up shared-memory segment {}: ranks {absent:?} did not attach; rank {r} gave up \
                     setting up the group (see its error)",
                    path.display()
                ))));
            }
            let gone: Vec<String> = (0..world_size)
                .filter(|&r| seg.ctrl(r).pid.load(Ordering::Acquire) == 0)
                .filter_map(|r| peer_pids.get(r).filter(|&&p| p != 0 && segment::pid_dead(p)).map(|p| format!("rank {r} (pid {p})")))
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
            cma_min: usize::MAX,
            cma_ok: false,
            scratch: Vec::new(),
        };
        comm.cma_min = comm.probe_cma()?;
        comm.cma_ok = comm.cma_min != usize::MAX;
        Ok(comm)
    }

    /// The message size in bytes from which single-copy transfers are used (see [`cma`]),
    /// or `None` when the group cannot use them.
    pub fn single_copy_min_bytes(&self) -> Option<usize> {
        (self.cma_min != usize::MAX).then_some(self.cma_min)
    }

    /// Sets the single-copy threshold (`None`: never use single-copy). Has no effect on a
    /// group that cannot use single-copy transfers. Every rank of the group must set the
    /// same value before its next collective (ranks that choose different algorithms
    /// would deadlock); meant for tests and measurements.
    pub fn set_single_copy_min_bytes(&mut self, bytes: Option<usize>) {
        self.cma_min = match bytes {
            Some(b) if self.cma_ok => b,
            _ => usize::MAX,
        };
    }

    fn single_copy(&self, bytes: usize) -> bool {
        bytes >= self.cma_min
    }

    /// Checks, with every rank, that each can read each peer's memory: every rank
    /// publishes the address and value of a random probe word, reads every peer's word
    /// with `process_vm_readv` and publishes whether all reads returned the right values
    /// (which also proves the pid names the right process), together with its own
    /// threshold (`FLAGOS_SHM_CMA_MIN_BYTES`, default [`CMA_MIN_BYTES`]). Two steps of the
    /// group's sequence; every rank gets the same answer: the largest threshold, or
    /// `usize::MAX` if any rank failed (or has `FLAGOS_SHM_CMA=0`).
    fn probe_cma(&mut self) -> Result<usize> {
        use std::hash::{BuildHasher, Hasher};
        if self.n == 1 {
            return Ok(usize::MAX);
        }
        let word = Box::new(std::collections::hash_map::RandomState::new().build_hasher().finish() | 1);
        let seg = Arc::clone(&self.seg);
        let me = seg.ctrl(self.rank);
        me.addr.store(&*word as *const u64 as u64, Ordering::Relaxed);
        me.probe.store(*word, Ordering::Relaxed);
        self.sync(None)?;
        let mut ok = cma::enabled_by_env();
        for q in (0..self.n).filter(|&q| q != self.rank) {
            if !ok {
                break;
            }
            let c = self.seg.ctrl(q);
            let (pid, addr, expect) = (c.pid.load(Ordering::Relaxed), c.addr.load(Ordering::Relaxed), c.probe.load(Ordering::Relaxed));
            let mut got = 0u64;
            // SAFETY: `got` is a local u64, valid for 8 bytes of writes.
            ok = unsafe { cma::read(pid, addr, &mut got as *mut u64 as *mut u8, 8) }.is_ok() && got == expect;
        }
        let mine = if ok { cma::min_bytes_from_env(CMA_MIN_BYTES).max(1) } else { usize::MAX };
        me.cma.store(mine as u64, Ordering::Relaxed);
        self.sync(None)?;
        let agreed = (0..self.n).map(|q| self.seg.ctrl(q).cma.load(Ordering::Relaxed)).max().unwrap_or(u64::MAX);
        drop(word); // every peer has read it: they all passed the second step
        Ok(usize::try_from(agreed).unwrap_or(usize::MAX))
    }

    pub fn rank(&self) -> usize {
        self.rank
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

    fn next_parity(&self) -> usize {
        ((self.step + 1) % 2) as usize
    }

    fn slot(&self, r: usize, p: usize) -> *mut u8 {
        self.seg.slot(r, p)
    }

    /// Starts a collective: refuses on a broken group, assigns its sequence number.
    /// `red` is the reduction of reducing collectives: its op and PREMUL_SUM factor go
    /// into the descriptor, so ranks must agree on both.
    fn begin(&mut self, kind: Kind, dtype: DType, red: Option<&Reduction>, count: usize, root: usize) -> Result<Desc> {
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
        };
        self.seq += 1;
        self.kind = kind;
        Ok(d)
    }

    /// Arrives at the next step and waits for all ranks. With `desc`, first publishes it
    /// and afterwards checks every rank's descriptor against it.
    fn sync(&mut self, desc: Option<&Desc>) -> Result<()> {
        let step = self.step + 1;
        let parity = (step % 2) as usize;
        if let Some(d) = desc {
            for (w, v) in self.seg.ctrl(self.rank).desc[parity].iter().zip(d.words()) {
                w.store(v, Ordering::Relaxed);
            }
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
            // The ranks are now at different steps: nobody can continue safely.
            sync::abort(&self.seg, self.rank);
            self.broken = Some(e.to_string());
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
            let words: [u64; DESC_WORDS] =
                std::array::from_fn(|i| self.seg.ctrl(r).desc[parity][i].load(Ordering::Relaxed));
            check_peer_desc(mine, self.rank, r, words, self.n)?;
        }
        Ok(())
    }

    fn steps(count: usize, per: usize) -> usize {
        count.div_ceil(per.max(1)).max(1)
    }

    fn reduction(&self, dtype: DType, op: ReduceOp, factor: f64) -> Result<Reduction> {
        Reduction::new(dtype, op, factor, self.n)
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.n {
            return Err(Error::InvalidArgument(format!("root: expected a group rank in 0..{}, got {root}", self.n)));
        }
        Ok(())
    }

    // ----- collectives: the public, bounds-checked face -----------------------------
    // Each checks every buffer it uses on this rank against what the call moves (see
    // `Buf::check`) before touching anything. A buffer that is too small (or null,
    // misaligned, read-only where written) makes this rank join the call's position of
    // the sequence as a failing rank (peers raise `Mismatch` naming it, as after `fail`)
    // and return `InvalidArgument` naming the argument; nothing is written.

    /// Joins the sequence as a rank that rejected its arguments and returns `e`.
    fn reject(&mut self, kind: Kind, e: Error) -> Result<()> {
        // Peers learn it at once; if even that fails (group broken, timeout), the
        // caller's mistake is still the error that matters.
        let _ = self.fail(Some(kind));
        Err(e)
    }

    /// In-place allreduce of `count` elements of `dtype` in `buf` (`nbytes`).
    pub fn allreduce(&mut self, buf: Buf<'_>, count: usize, dtype: DType, op: ReduceOp, factor: f64) -> Result<()> {
        self.reduction(dtype, op, factor)?;
        if let Err(e) = buf.check("nbytes", count, dtype.size(), 1, true) {
            return self.reject(Kind::Allreduce, e);
        }
        // SAFETY: `buf` is valid for reads and writes of its length (`Buf` contract),
        // which the check above showed holds `count` aligned elements.
        unsafe { self.allreduce_ptrs(buf.as_mut_ptr(), count, dtype, op, factor) }
    }

    /// In-place broadcast of `count` elements of `dtype` in `buf` (`nbytes`) from group
    /// rank `root`: read on the root, written elsewhere.
    pub fn broadcast(&mut self, buf: Buf<'_>, count: usize, dtype: DType, root: usize) -> Result<()> {
        self.check_root(root)?;
        if let Err(e) = buf.check("nbytes", count, dtype.size(), 1, self.rank != root) {
            return self.reject(Kind::Broadcast, e);
        }
        // SAFETY: as in `allreduce`; the root only reads `buf`.
        unsafe { self.broadcast_ptrs(buf.as_ptr() as *mut u8, count, dtype, root) }
    }

    /// In-place reduce of `count` elements in `buf` (`nbytes`) to group rank `root`;
    /// only the root's buffer is written.
    pub fn reduce(&mut self, buf: Buf<'_>, count: usize, dtype: DType, op: ReduceOp, factor: f64, root: usize) -> Result<()> {
        self.check_root(root)?;
        self.reduction(dtype, op, factor)?;
        if let Err(e) = buf.check("nbytes", count, dtype.size(), 1, self.rank == root) {
            return self.reject(Kind::Reduce, e);
        }
        // SAFETY: as in `allreduce`; non-roots only read `buf`.
        unsafe { self.reduce_ptrs(buf.as_ptr() as *mut u8, count, dtype, op, factor, root) }
    }

    /// Allgather: `input` (`in_nbytes`) holds `count` elements; `output` (`out_nbytes`)
    /// receives `n * count`, rank r's at `[r * count, (r + 1) * count)`. `input` may be
    /// this rank's piece of `output`.
    pub fn allgather(&mut self, input: Buf<'_>, output: Buf<'_>, count: usize, dtype: DType) -> Result<()> {
        let es = dtype.size();
        if let Err(e) = input.check("in_nbytes", count, es, 1, false).and(output.check("out_nbytes", count, es, self.n, true)) {
            return self.reject(Kind::Allgather, e);
        }
        // SAFETY: both buffers are valid for their checked lengths (`Buf` contract).
        unsafe { self.allgather_ptrs(input.as_ptr(), output.as_mut_ptr(), count, dtype) }
    }

    /// Gather to `root`: `input` holds `count` elements; the root's `output` receives
    /// `n * count` (non-roots may pass an empty `output`, which is not touched).
    pub fn gather(&mut self, input: Buf<'_>, output: Buf<'_>, count: usize, dtype: DType, root: usize) -> Result<()> {
        self.check_root(root)?;
        let es = dtype.size();
        let out_ok = if self.rank == root { output.check("out_nbytes", count, es, self.n, true) } else { Ok(()) };
        if let Err(e) = input.check("in_nbytes", count, es, 1, false).and(out_ok) {
            return self.reject(Kind::Gather, e);
        }
        // SAFETY: as in `allgather`; non-roots never touch `output`.
        unsafe { self.gather_ptrs(input.as_ptr(), output.as_ptr() as *mut u8, count, dtype, root) }
    }

    /// Scatter from `root`: the root's `input` holds `n * count` elements (non-roots may
    /// pass an empty one); rank r receives piece r in `output` (`count` elements).
    pub fn scatter(&mut self, input: Buf<'_>, output: Buf<'_>, count: usize, dtype: DType, root: usize) -> Result<()> {
        self.check_root(root)?;
        let es = dtype.size();
        let in_ok = if self.rank == root { input.check("in_nbytes", count, es, self.n, false) } else { Ok(()) };
        if let Err(e) = in_ok.and(output.check("out_nbytes", count, es, 1, true)) {
            return self.reject(Kind::Scatter, e);
        }
        // SAFETY: as in `allgather`; non-roots never touch `input`.
        unsafe { self.scatter_ptrs(input.as_ptr(), output.as_mut_ptr(), count, dtype, root) }
    }

    /// Reduce-scatter: `input` holds `n * count` elements; `output` (`count` elements)
    /// receives the reduction over ranks of piece `rank`.
    pub fn reduce_scatter(&mut self, input: Buf<'_>, output: Buf<'_>, count: usize, dtype: DType, op: ReduceOp, factor: f64) -> Result<()> {
        self.reduction(dtype, op, factor)?;
        let es = dtype.size();
        if let Err(e) = input.check("in_nbytes", count, es, self.n, false).and(output.check("out_nbytes", count, es, 1, true)) {
            return self.reject(Kind::ReduceScatter, e);
        }
        // SAFETY: as in `allgather`.
        unsafe { self.reduce_scatter_ptrs(input.as_ptr(), output.as_mut_ptr(), count, dtype, op, factor) }
    }

    /// All-to-all: `input` and `output` hold `n * count` elements each and must not
    /// overlap; piece q of this rank's input goes to rank q, and rank q's piece `rank`
    /// lands in output piece q.
    pub fn alltoall(&mut self, input: Buf<'_>, output: Buf<'_>, count: usize, dtype: DType) -> Result<()> {
        let es = dtype.size();
        let mut ok = input.check("in_nbytes", count, es, self.n, false).and(output.check("out_nbytes", count, es, self.n, true));
        let bytes = count * es * self.n; // no overflow: checked above when `ok`
        if ok.is_ok() && bytes > 0 {
            let (i, o) = (input.as_ptr() as usize, output.as_ptr() as usize);
            if i < o + bytes && o < i + bytes {
                ok = Err(Error::InvalidArgument("out_ptr: the output of alltoall overlaps its input".into()));
            }
        }
        if let Err(e) = ok {
            return self.reject(Kind::Alltoall, e);
        }
        // SAFETY: as in `allgather`; the ranges do not overlap (checked above).
        unsafe { self.alltoall_ptrs(input.as_ptr(), output.as_mut_ptr(), count, dtype) }
    }

    // ----- collectives: the algorithms ----------------------------------------------
    // Safety contract shared by every `unsafe fn` below: each pointer argument that the
    // method's doc says is used on this rank must be valid for reads (inputs) or writes
    // (outputs) of the stated number of elements of `dtype`, aligned to the element size,
    // and not be accessed by anything else for the duration of the call. Inputs and
    // outputs may be the same buffer only where the doc says so.

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

    /// In-place allreduce of `count` elements at `buf`.
    ///
    /// # Safety
    /// See the contract above; `buf`: `count` elements, read and written.
    unsafe fn allreduce_ptrs(&mut self, buf: *mut u8, count: usize, dtype: DType, op: ReduceOp, factor: f64) -> Result<()> {
        let red = self.reduction(dtype, op, factor)?;
        let d = self.begin(Kind::Allreduce, dtype, Some(&red), count, 0)?;
        let es = dtype.size();
        if self.single_copy((count * es) / ALLREDUCE_CMA_FACTOR) {
            return self.allreduce_single_copy(buf, count, &red, &d);
        }
        let per = self.seg.slot_bytes() / es;
        let two_step = self.n >= 2 && count * es > ONE_SHOT_MAX_BYTES;
        let mut srcs = vec![std::ptr::null::<u8>(); self.n];
        for c in 0..Self::steps(count, per) {
            let off = c * per;
            let len = per.min(count - off.min(count));
            let p = self.next_parity();
            let mine = self.slot(self.rank, p);
            let (a, b) = slice_bounds(len, self.n, self.rank);
            if !two_step {
                // SAFETY: off + len <= count, so the source range is inside the caller's
                // buffer; len * es <= slot_bytes.
                copy_nonoverlapping(buf.add(off * es), mine, len * es);
            } else {
                // Peers read every piece of our chunk except our own slice [a, b), which
                // we reduce straight from `buf`. SAFETY: as above, both ranges lie in
                // [0, len).
                copy_nonoverlapping(buf.add(off * es), mine, a * es);
                copy_nonoverlapping(buf.add((off + b) * es), mine.add(b * es), (len - b) * es);
            }
            self.sync((c == 0).then_some(&d))?;
            for (r, s) in srcs.iter_mut().enumerate() {
                *s = self.slot(r, p);
            }
            if !two_step {
                // SAFETY: every slot holds `len` elements of step p (published by the
                // sync above); the output range is inside the caller's buffer.
                reduce_raw(&red, buf.add(off * es), &srcs, len);
                continue;
            }
            let mut sliced: Vec<*const u8> = srcs.iter().map(|s| s.add(a * es) as *const u8).collect();
            sliced[self.rank] = buf.add((off + a) * es);
            // SAFETY: [a, b) lies inside the chunk; peers' slots hold it (published by the
            // sync above), our own slice is read from the caller's buffer; our slot of the
            // other parity is ours to write now (every rank has left the step that last
            // read it) and overlaps none of the sources.
            reduce_raw(&red, self.slot(self.rank, 1 - p).add(a * es), &sliced, b - a);
            self.sync(None)?;
            for r in 0..self.n {
                let (a, b) = slice_bounds(len, self.n, r);
                // SAFETY: rank r's reduced slice [a, b) of this chunk was published by the
                // sync above; the destination is inside the caller's buffer.
                copy_nonoverlapping(self.slot(r, 1 - p).add(a * es), buf.add((off + a) * es), (b - a) * es);
            }
        }
        Ok(())
    }

    /// In-place broadcast of `count` elements at `buf` from group rank `root`.
    ///
    /// # Safety
    /// See the contract above; `buf`: `count` elements, read on the root, written elsewhere.
    unsafe fn broadcast_ptrs(&mut self, buf: *mut u8, count: usize, dtype: DType, root: usize) -> Result<()> {
        self.check_root(root)?;
        let d = self.begin(Kind::Broadcast, dtype, None, count, root)?;
        let es = dtype.size();

        let per = self.seg.slot_bytes() / es;
        for c in 0..Self::steps(count, per) {
            let off = c * per;
            let len = per.min(count - off.min(count));
            let p = self.next_parity();
            if self.rank == root {
                // SAFETY: range inside the caller's buffer; len * es <= slot_bytes.
                copy_nonoverlapping(buf.add(off * es), self.slot(root, p), len * es);
            }
            self.sync((c == 0).then_some(&d))?;
            if self.rank != root {
                // SAFETY: the root's slot of step p was published by the sync above.
                copy_nonoverlapping(self.slot(root, p), buf.add(off * es), len * es);
            }
        }
        Ok(())
    }

    /// In-place reduce of `count` elements at `buf` to group rank `root`; only the root's
    /// buffer is written.
    ///
    /// # Safety
    /// See the contract above; `buf`: `count` elements, read everywhere, written on root.
    unsafe fn reduce_ptrs(&mut self, buf: *mut u8, count: usize, dtype: DType, op: ReduceOp, factor: f64, root: usize) -> Result<()> {
        self.check_root(root)?;
        let red = self.reduction(dtype, op, factor)?;
        let d = self.begin(Kind::Reduce, dtype, Some(&red), count, root)?;
        let es = dtype.size();
        let per = self.seg.slot_bytes() / es;
        for c in 0..Self::steps(count, per) {
            let off = c * per;
            let len = per.min(count - off.min(count));
            let p = self.next_parity();
            // SAFETY: as in allreduce.
            copy_nonoverlapping(buf.add(off * es), self.slot(self.rank, p), len * es);
            self.sync((c == 0).then_some(&d))?;
            if self.rank == root {
                let srcs: Vec<*const u8> = (0..self.n).map(|r| self.slot(r, p) as *const u8).collect();
                // SAFETY: as in allreduce.
                reduce_raw(&red, buf.add(off * es), &srcs, len);
            }
        }
        Ok(())
    }

    /// Allgather: `input` holds `count` elements; `output` receives `n * count`, rank r's
    /// at `[r * count, (r + 1) * count)`. `input` may be rank `rank`'s part of `output`.
    /// With `root = Some(q)` this is gather: only rank q's `output` is written (others may
    /// pass null).
    ///
    /// # Safety
    /// See the contract above.
    unsafe fn gather_impl(&mut self, input: *const u8, output: *mut u8, count: usize, dtype: DType, root: Option<usize>) -> Result<()> {
        if let Some(q) = root {
            self.check_root(q)?;
        }
        let kind = if root.is_some() { Kind::Gather } else { Kind::Allgather };
        let d = self.begin(kind, dtype, None, count, root.unwrap_or(0))?;
        let es = dtype.size();
        if root.is_none() && self.single_copy(self.n * count * es) {
            return self.allgather_single_copy(input, output, count * es, &d);
        }
        let per = self.seg.slot_bytes() / es;
        for c in 0..Self::steps(count, per) {
            let off = c * per;
            let len = per.min(count - off.min(count));
            let p = self.next_parity();
            // SAFETY: range inside the caller's input; len * es <= slot_bytes. (`copy`
            // rather than `copy_nonoverlapping` is not needed: the slot is ours.)
            copy_nonoverlapping(input.add(off * es), self.slot(self.rank, p), len * es);
            self.sync((c == 0).then_some(&d))?;
            if root.is_none_or(|q| q == self.rank) {
                for r in 0..self.n {
                    // SAFETY: rank r's slot of step p was published by the sync; the
                    // destination range lies in `output` (n * count elements). It may
                    // overlap `input` only for r == rank, where it receives the very
                    // bytes already copied from there.
                    std::ptr::copy(self.slot(r, p), output.add((r * count + off) * es), len * es);
                }
            }
        }
        Ok(())
    }

    /// Allgather; see [`Self::gather_impl`].
    ///
    /// # Safety
    /// See the contract above; `input`: `count` elements; `output`: `n * count`.
    unsafe fn allgather_ptrs(&mut self, input: *const u8, output: *mut u8, count: usize, dtype: DType) -> Result<()> {
        self.gather_impl(input, output, count, dtype, None)
    }

    /// Gather to `root`; see [`Self::gather_impl`].
    ///
    /// # Safety
    /// See the contract above; `input`: `count` elements; `output` (root only): `n * count`.
    unsafe fn gather_ptrs(&mut self, input: *const u8, output: *mut u8, count: usize, dtype: DType, root: usize) -> Result<()> {
        self.gather_impl(input, output, count, dtype, Some(root))
    }

    /// Scatter from `root`: the root's `input` holds `n * count` elements; rank r receives
    /// `[r * count, (r + 1) * count)` in `output` (`count` elements). Non-roots may pass a
    /// null `input`.
    ///
    /// # Safety
    /// See the contract above.
    unsafe fn scatter_ptrs(&mut self, input: *const u8, output: *mut u8, count: usize, dtype: DType, root: usize) -> Result<()> {
        self.check_root(root)?;
        let d = self.begin(Kind::Scatter, dtype, None, count, root)?;
        let es = dtype.size();
        let per = self.seg.slot_bytes() / es / self.n;
        for c in 0..Self::steps(count, per) {
            let off = c * per;
            let len = per.min(count - off.min(count));
            let p = self.next_parity();
            if self.rank == root {
                for r in 0..self.n {
                    // SAFETY: n * len * es <= slot_bytes; source inside the root's input.
                    copy_nonoverlapping(input.add((r * count + off) * es), self.slot(root, p).add(r * len * es), len * es);
                }
            }
            self.sync((c == 0).then_some(&d))?;
            // SAFETY: the root's slot of step p was published by the sync above.
            std::ptr::copy(self.slot(root, p).add(self.rank * len * es), output.add(off * es), len * es);
        }
        Ok(())
    }

    /// Shared body of reduce-scatter (`red = Some`) and alltoall (`red = None`): `input`
    /// holds n pieces of `count` elements; reduce-scatter writes the reduction of every
    /// rank's piece `rank` into `output` (`count` elements), alltoall writes rank q's piece
    /// `rank` to `output[q * count ..]` (`n * count` elements).
    unsafe fn exchange(&mut self, input: *const u8, output: *mut u8, count: usize, dtype: DType, red: Option<Reduction>) -> Result<()> {
        let kind = if red.is_some() { Kind::ReduceScatter } else { Kind::Alltoall };
        let d = self.begin(kind, dtype, red.as_ref(), count, 0)?;
        let es = dtype.size();
        if let Some(red) = red.as_ref().filter(|_| self.single_copy(self.n * count * es)) {
            return self.reduce_scatter_single_copy(input, output, count, red, &d);
        }
        let per = self.seg.slot_bytes() / es / self.n;
        let mut srcs = vec![std::ptr::null::<u8>(); self.n];
        for c in 0..Self::steps(count, per) {
            let off = c * per;
            let len = per.min(count - off.min(count));
            let p = self.next_parity();
            for q in 0..self.n {
                // SAFETY: n * len * es <= slot_bytes; source inside `input`.
                copy_nonoverlapping(input.add((q * count + off) * es), self.slot(self.rank, p).add(q * len * es), len * es);
            }
            self.sync((c == 0).then_some(&d))?;
            for (q, s) in srcs.iter_mut().enumerate() {
                *s = self.slot(q, p).add(self.rank * len * es);
            }
            match &red {
                // SAFETY: every slot of step p is published; output range inside `output`.
                Some(red) => reduce_raw(red, output.add(off * es), &srcs, len),
                None => {
                    for (q, s) in srcs.iter().enumerate() {
                        // SAFETY: as above.
                        std::ptr::copy(*s, output.add((q * count + off) * es), len * es);
                    }
                }
            }
        }
        Ok(())
    }

    /// Reduce-scatter: `input` holds `n * count` elements; `output` (`count` elements)
    /// receives the reduction over ranks of piece `rank`.
    ///
    /// # Safety
    /// See the contract above.
    unsafe fn reduce_scatter_ptrs(&mut self, input: *const u8, output: *mut u8, count: usize, dtype: DType, op: ReduceOp, factor: f64) -> Result<()> {
        let red = self.reduction(dtype, op, factor)?;
        self.exchange(input, output, count, dtype, Some(red))
    }

    /// All-to-all: `input` and `output` hold `n * count` elements each; piece q of this
    /// rank's input goes to rank q, and rank q's piece `rank` lands in output piece q.
    ///
    /// # Safety
    /// See the contract above; `input` and `output` must not overlap.
    unsafe fn alltoall_ptrs(&mut self, input: *const u8, output: *mut u8, count: usize, dtype: DType) -> Result<()> {
        self.exchange(input, output, count, dtype, None)
    }

    // ----- single-copy collectives (process_vm_readv) ------------------------------
    // Each publishes the address of its buffer with the descriptor step, then reads the
    // peers' buffers straight from their processes; a last step keeps every buffer
    // untouched until all peers have finished reading it.

    /// Publishes `addr` for peers, runs the descriptor step and returns every rank's
    /// (pid, address).
    fn publish(&mut self, addr: *const u8, d: &Desc) -> Result<Vec<(u32, u64)>> {
        self.seg.ctrl(self.rank).addr.store(addr as u64, Ordering::Relaxed);
        self.sync(Some(d))?;
        Ok((0..self.n)
            .map(|q| {
                let c = self.seg.ctrl(q);
                (c.pid.load(Ordering::Relaxed), c.addr.load(Ordering::Relaxed))
            })
            .collect())
    }

    /// Turns a failure in the middle of a single-copy collective into an aborted group:
    /// the peers are waiting at the next step and must not wait in vain.
    ///
    /// A peer that saw the original failure (say, a rank that died) aborts the group and
    /// may exit before this rank's read from it ends, so the read fails naming that peer:
    /// the message then leads with the rank that aborted the group and lists every rank
    /// whose process is gone.
    fn fail_midway<T>(&mut self, what: Kind, r: Result<T>) -> Result<T> {
        r.map_err(|e| {
            let first = sync::aborted_by(&self.seg).filter(|&q| q != self.rank);
            sync::abort(&self.seg, self.rank);
            let head = format!("{} #{} (rank {}, step {})", what.name(), self.seq.saturating_sub(1), self.rank, self.step + 1);
            let gone: Vec<String> = (0..self.n)
                .filter_map(|q| {
                    let pid = self.seg.ctrl(q).pid.load(Ordering::Relaxed);
                    segment::pid_dead(pid).then(|| format!("rank {q} (pid {pid})"))
                })
                .collect();
            let gone = if gone.is_empty() { String::new() } else { format!("; exited: {}", gone.join(", ")) };
            let msg = match first {
                Some(q) => format!(
                    "{head}: the group was aborted by rank {q} (see its error), then a single-copy transfer failed: {e}{gone}"
                ),
                None => format!("{head}: single-copy transfer failed: {e}{gone}"),
            };
            self.broken = Some(msg.clone());
            match (first, e) {
                (None, Error::PeerDied(_)) => Error::PeerDied(msg),
                _ => Error::Aborted(msg),
            }
        })
    }

    /// Per-rank chunk buffers of `bytes` each, 8-byte aligned.
    fn chunk_buffers(&mut self, bytes: usize) -> Vec<*mut u8> {
        let words = bytes.div_ceil(8);
        if self.scratch.len() < words * self.n {
            self.scratch = vec![0u64; words * self.n];
        }
        let base = self.scratch.as_mut_ptr();
        // SAFETY: q * words + words <= scratch.len().
        (0..self.n).map(|q| unsafe { base.add(q * words) } as *mut u8).collect()
    }

    /// Reduces element range `[a, b)` of every rank's buffer (`addrs[q]` in process q; our
    /// own at `own`) in rank order into `dst`, `CMA_CHUNK_BYTES` at a time.
    ///
    /// # Safety
    /// `own` readable and `dst` writable for `b - a` elements from their starts; `dst`
    /// may equal `own` (the kernels read an element of every source before writing it
    /// when the output is source 0 or 1; for other ranks `own` is copied first).
    unsafe fn reduce_range_from_peers(&mut self, red: &Reduction, peers: &[(u32, u64)], own: *const u8, dst: *mut u8, a: usize, b: usize) -> Result<()> {
        let es = red.dtype.size();
        let chunk = (CMA_CHUNK_BYTES / es).max(1);
        let bufs = self.chunk_buffers(chunk * es);
        let in_place_ok = self.rank < 2 || own != dst as *const u8;
        let mut srcs = vec![std::ptr::null::<u8>(); self.n];
        let mut x = a;
        while x < b {
            let len = chunk.min(b - x);
            for (q, s) in srcs.iter_mut().enumerate() {
                let off = (x - a) * es;
                if q == self.rank {
                    if in_place_ok {
                        *s = own.add(off);
                    } else {
                        copy_nonoverlapping(own.add(off), bufs[q], len * es);
                        *s = bufs[q];
                    }
                } else {
                    let (pid, addr) = peers[q];
                    cma::read(pid, addr.wrapping_add((x * es) as u64), bufs[q], len * es).map_err(|e| of_rank(q, e))?;
                    *s = bufs[q];
                }
            }
            reduce_raw(red, dst.add((x - a) * es), &srcs, len);
            x += len;
        }
        Ok(())
    }

    /// Single-copy allreduce (the reduce-scatter + allgather decomposition): rank r reduces
    /// slice r of every rank's buffer into its own buffer, reading the peers' slices from
    /// their processes; then every rank reads each peer's reduced slice. Each byte crosses
    /// between processes once per phase, and nothing goes through the segment.
    unsafe fn allreduce_single_copy(&mut self, buf: *mut u8, count: usize, red: &Reduction, d: &Desc) -> Result<()> {
        let es = red.dtype.size();
        let peers = self.publish(buf, d)?;
        let (a, b) = slice_bounds(count, self.n, self.rank);
        let own = buf.add(a * es);
        let r = self.reduce_range_from_peers(red, &peers, own, own, a, b);
        self.fail_midway(Kind::Allreduce, r)?;
        self.sync(None)?;
        let (n, me) = (self.n, self.rank);
        for q in (0..n).filter(|&q| q != me) {
            let (qa, qb) = slice_bounds(count, self.n, q);
            let r = cma::read(peers[q].0, peers[q].1.wrapping_add((qa * es) as u64), buf.add(qa * es), (qb - qa) * es)
                .map_err(|e| of_rank(q, e));
            self.fail_midway(Kind::Allreduce, r)?;
        }
        self.sync(None)
    }

    /// Single-copy allgather: every rank reads each peer's input into its output.
    unsafe fn allgather_single_copy(&mut self, input: *const u8, output: *mut u8, bytes: usize, d: &Desc) -> Result<()> {
        let peers = self.publish(input, d)?;
        // SAFETY: the destination is this rank's piece of `output`; it may be `input`
        // itself (in-place allgather), hence `copy`.
        std::ptr::copy(input, output.add(self.rank * bytes), bytes);
        let (n, me) = (self.n, self.rank);
        for q in (0..n).filter(|&q| q != me) {
            let r = cma::read(peers[q].0, peers[q].1, output.add(q * bytes), bytes).map_err(|e| of_rank(q, e));
            self.fail_midway(Kind::Allgather, r)?;
        }
        self.sync(None)
    }

    /// Single-copy reduce-scatter: rank r reduces piece r of every rank's input.
    unsafe fn reduce_scatter_single_copy(&mut self, input: *const u8, output: *mut u8, count: usize, red: &Reduction, d: &Desc) -> Result<()> {
        let peers = self.publish(input, d)?;
        let (a, b) = (self.rank * count, (self.rank + 1) * count);
        let own = input.add(a * red.dtype.size());
        let r = self.reduce_range_from_peers(red, &peers, own, output, a, b);
        self.fail_midway(Kind::ReduceScatter, r)?;
        self.sync(None)
    }
}

/// Prefixes a single-copy read error with the peer rank it was reading from.
fn of_rank(q: usize, e: Error) -> Error {
    match e {
        Error::PeerDied(m) => Error::PeerDied(format!("ranks [{q}] did not finish: rank {q} exited ({m})")),
        other => other,
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
}

/// Compares rank `r`'s descriptor `words`, read from its control block, with this rank's
/// (`me`) own descriptor `mine` for the same step, in a group of `world` ranks. `Ok` when
/// `mine` is a failing rank's (its caller raises its own error) or the words are exactly
/// `mine.words()`; `Mismatch` otherwise: malformed words ([`Desc::decode`]), a peer that
/// rejected its arguments, or a different call. Nothing is sized or indexed by the peer's
/// values: the collectives move data by the local descriptor only, after this said `Ok`.
#[doc(hidden)]
pub fn check_peer_desc(mine: &Desc, me: usize, r: usize, words: [u64; DESC_WORDS], world: usize) -> Result<()> {
    if mine.flags & FLAG_FAIL != 0 {
        return Ok(()); // we are the failing rank; our caller raises its own error
    }
    let theirs = Desc::decode(words, world).map_err(|e| {
        Error::Mismatch(format!(
            "{}: rank {r} published a {e} (words {words:#x?}); no data was exchanged",
            mine.describe()
        ))
    })?;
    if theirs.flags & FLAG_FAIL != 0 {
        return Err(Error::Mismatch(format!(
            "{}: rank {r} rejected its arguments to {} (see the error raised on rank {r}); \
             no data was exchanged and the group is still usable",
            mine.describe(),
            theirs.describe()
        )));
    }
    if !theirs.same_call(mine) {
        return Err(Error::Mismatch(format!(
            "ranks disagree at position {} of the group's sequence: rank {me} called {}, rank {r} called {}; \
             no output was written and the group is still usable",
            mine.seq,
            mine.describe(),
            theirs.describe()
        )));
    }
    Ok(())
}

/// Rank `r`'s slice `[a, b)` of a chunk of `len` elements split across `n` ranks; slices
/// are multiples of 64 elements (whole cache lines for every dtype) except the last.
pub fn slice_bounds(len: usize, n: usize, r: usize) -> (usize, usize) {
    let per = len.div_ceil(n).div_ceil(64) * 64;
    let a = (r * per).min(len);
    (a, (a + per).min(len))
}

/// Convenience for tests and benches: creates a segment and attaches all ranks of a
/// group living in one process (threads as ranks).
pub fn create_segment(dir: &Path, world_size: usize, slot_bytes: usize) -> Result<std::path::PathBuf> {
    segment::create(dir, world_size, slot_bytes)
}
