//! Lock-free synchronisation between the ranks of one segment.
//!
//! Each rank owns one monotonically increasing counter, `RankCtrl::arrived`, on its own
//! cache line. A collective is a sequence of *steps*; in step `s` a rank writes its
//! contribution into its own slot of parity `s % 2`, then publishes `arrived = s` with a
//! release store ([`arrive`]). A rank reads peers' slots of step `s` only after it has
//! observed, with acquire loads, `arrived >= s` for every rank ([`wait_all`]), and stops
//! reading them before it arrives at `s + 1`. Since a rank writes a slot of parity
//! `s % 2` again only in step `s + 2`, i.e. after every rank arrived at `s + 1`, no slot
//! is overwritten while someone still reads it. No locks are taken anywhere.
//!
//! Waiting is a [`Waiter`] (`crate::shm::wait`): it spins (skipped when a missing peer
//! last ran on the waiter's own CPU, where spinning would only delay it), yields, then
//! sleeps on the group line's futex word (`GroupLine::wake`, bumped by arrivals only when
//! someone sleeps) in bounded slices. Between slices it checks the deadline, the group's
//! aborted flag, whether the missing peers' processes are still alive, and the caller's
//! interrupt hook (Ctrl-C).
//!
//! A rank that gets past a step while another rank last ran on its CPU yields once
//! ([`wait_all`]), so that rank (likely waiting for the same step) leaves it at once.
//!
//! # Memory ordering
//!
//! Every load and store of a control block or of the group line is in this file (the
//! accessors at the end serve `group.rs` and `single_copy.rs`). The choices:
//!
//! - `arrived`: Release store in [`arrive`], Acquire loads in [`wait_all`]. Everything a
//!   rank wrote before arriving at step `s` (its slot, descriptor words, published
//!   address) is visible to a rank that has seen `arrived >= s`; those writes and reads
//!   can therefore be plain copies and Relaxed atomics.
//!   The slot copies may use streaming stores (`crate::stream`), which the Release store
//!   does not order on x86-64: `stream::copy_to_slot` ends them with `sfence` before it
//!   returns, so they too are visible before the arrival.
//! - `cpu`: Relaxed both ways; a scheduling hint, never used for correctness.
//! - `pid`, `attached`: AcqRel claim / Acquire reads, since they are read during set-up,
//!   before any step orders them.
//! - `aborted`: SeqCst compare-exchange (the first aborter wins), Acquire reads.
//! - `left`: Release store in [`leave`], Acquire loads. A rank leaves only after its last
//!   arrival, so a waiter that finds `left` set and *then* reads `arrived` sees every step
//!   the rank made: the [`Waiter`] looks at the arrivals once more after [`check_stop`]
//!   reports a rank gone, so a rank that made the call and left at once is not reported.
//!
//! - `wake`, `sleepers`: the [`Doorbell`] protocol ("Sleeping and waking" in
//!   `crate::shm::wait`), which keeps a sleeper from sleeping through an arrival or an
//!   abort.

use crate::error::{Error, Result};
use crate::segment::{GroupLine, Segment, DESC_WORDS};
use crate::shm::wait::{pid_dead, valid_pid, Doorbell, Waiter};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// What a wait is for: used for error messages and to stop waiting.
pub struct WaitCtx<'a> {
    /// Collective name, e.g. `"allreduce"`.
    pub what: &'a str,
    /// The collective's sequence number in its group (0-based).
    pub seq: u64,
    pub deadline: Instant,
    pub timeout: Duration,
    /// Called between sleep slices; returning `true` stops the wait with `Interrupted`.
    pub interrupt: Option<&'a (dyn Fn() -> bool + Sync)>,
}

/// Publishes that `rank` finished writing step `step`, and wakes sleepers if any.
pub fn arrive(seg: &Segment, rank: usize, step: u64) {
    let me = seg.ctrl(rank);
    me.cpu.store(current_cpu(), Ordering::Relaxed);
    me.arrived.store(step, Ordering::Release);
    wake_sleepers(seg.group());
}

/// The waker's half of the protocol in "Sleeping and waking" (module docs): called after
/// the store that changes a sleeper's condition (an arrival, the aborted flag).
fn wake_sleepers(g: &GroupLine) {
    doorbell(g).ring(false);
}

fn doorbell(g: &GroupLine) -> Doorbell<'_> {
    Doorbell { word: &g.wake, sleepers: &g.sleepers }
}

/// Marks the group aborted by `rank` and wakes every waiter (even one that has not
/// registered as a sleeper yet: its snapshot of the word then differs).
pub fn abort(seg: &Segment, rank: usize) {
    let _ = seg.group().aborted.compare_exchange(0, rank as u32 + 1, Ordering::SeqCst, Ordering::SeqCst);
    doorbell(seg.group()).ring(true);
}

/// Publishes that `rank` has closed the group (its communicator was dropped) and wakes
/// every waiter, so that peers waiting for it fail now ([`check_stop`]) rather than at
/// their timeout while its process lives on (Gloo's peers see the connection close).
pub fn leave(seg: &Segment, rank: usize) {
    seg.ctrl(rank).left.store(1, Ordering::Release);
    doorbell(seg.group()).ring(true);
}

/// Whether rank `r` has closed the group ([`leave`]).
pub fn has_left(seg: &Segment, r: usize) -> bool {
    seg.ctrl(r).left.load(Ordering::Acquire) != 0
}

/// Returns the rank that aborted the group, if any. The value is read from shared memory
/// and only ever printed, never used as an index.
pub fn aborted_by(seg: &Segment) -> Option<usize> {
    match seg.group().aborted.load(Ordering::Acquire) {
        0 => None,
        v => Some(v as usize - 1),
    }
}

fn missing(seg: &Segment, step: u64) -> Vec<usize> {
    (0..seg.world_size()).filter(|&r| seg.ctrl(r).arrived.load(Ordering::Acquire) < step).collect()
}

/// The CPU this thread runs on, or `u32::MAX` if unknown.
fn current_cpu() -> u32 {
    // SAFETY: sched_getcpu has no preconditions (glibc serves it from the vDSO).
    let c = unsafe { libc::sched_getcpu() };
    if c < 0 {
        u32::MAX
    } else {
        c as u32
    }
}

/// Waits until every rank has arrived at `step`.
///
/// Errors: `Aborted` if the group was aborted, `PeerDied` if a missing rank's process is
/// gone, `Interrupted` if the interrupt hook fired, `Timeout` at the deadline. Each names
/// the collective, its sequence number and the missing ranks. `Aborted` also when a
/// rank's control block holds an arrival counter or pid the protocol cannot produce
/// (written by a corrupt or malicious process), naming the rank and the value.
pub fn wait_all(seg: &Segment, step: u64, ctx: &WaitCtx) -> Result<()> {
    wait_arrivals(seg, step, ctx)?;
    // A corrupt counter can only make us stop waiting early; say so instead of going on.
    check_counters(seg, step, ctx)?;
    hand_over_if_shared(seg);
    Ok(())
}

/// With more ranks than CPUs, a rank that last arrived on our CPU may be waiting for this
/// very step, runnable but descheduled: yield once, so that it leaves the step now
/// instead of after our next time slice (otherwise its call lasts our whole next call
/// too). No-op when no other rank last ran on our CPU.
fn hand_over_if_shared(seg: &Segment) {
    let cpu = current_cpu();
    // Our own counter's CPU was stored by our arrival, so "shared" means 2 or more.
    if (0..seg.world_size()).filter(|&r| seg.ctrl(r).cpu.load(Ordering::Relaxed) == cpu).nth(1).is_some() {
        std::thread::yield_now();
    }
}

/// The protocol bounds every rank's arrival counter while a rank waits for `step` (after
/// arriving at it): nobody is below `step - 1` (we got past step `step - 1`, so all
/// arrived there) nor above `step + 1` (nobody gets past step `step + 1` before we arrive
/// there). `None` if `value` is inside, else the message saying it is not.
pub fn counter_out_of_range(rank: usize, value: u64, step: u64) -> Option<String> {
    let (lo, hi) = (step.saturating_sub(1), step.saturating_add(1));
    (value < lo || value > hi).then(|| format!("rank {rank}'s control block is corrupt: arrival counter {value}, expected {lo}..={hi}"))
}

/// Checks every rank's arrival counter ([`counter_out_of_range`]) and process id
/// ([`valid_pid`], or 0 before it attached): values another process wrote into
/// shared memory. `Aborted` naming the rank and the value otherwise.
fn check_counters(seg: &Segment, step: u64, ctx: &WaitCtx) -> Result<()> {
    for r in 0..seg.world_size() {
        let c = seg.ctrl(r);
        let bad = counter_out_of_range(r, c.arrived.load(Ordering::Acquire), step).or_else(|| {
            let pid = c.pid.load(Ordering::Relaxed);
            (pid != 0 && !valid_pid(pid)).then(|| format!("rank {r}'s control block is corrupt: pid {pid}"))
        });
        if let Some(m) = bad {
            return Err(Error::Aborted(format!("{} #{} (step {step}): {m}", ctx.what, ctx.seq)));
        }
    }
    Ok(())
}

fn wait_arrivals(seg: &Segment, step: u64, ctx: &WaitCtx) -> Result<()> {
    let all_in = || (0..seg.world_size()).all(|r| seg.ctrl(r).arrived.load(Ordering::Acquire) >= step);
    if all_in() {
        return Ok(());
    }
    // A missing peer that last ran on our CPU cannot make progress while we spin.
    let cpu = current_cpu();
    let shares_cpu =
        (0..seg.world_size()).any(|r| seg.ctrl(r).arrived.load(Ordering::Relaxed) < step && seg.ctrl(r).cpu.load(Ordering::Relaxed) == cpu);
    // An abort that bumped `wake` before the sleeper's snapshot would not end its futex
    // wait: it re-checks the flag after the snapshot too (`check_stop` then reports it).
    Waiter::new(doorbell(seg.group()), ctx.deadline).skip_spin(shares_cpu).until(
        all_in,
        || check_stop(seg, step, ctx),
        || {
            aborted_by(seg).is_some()
                || (0..seg.world_size()).any(|r| has_left(seg, r) && seg.ctrl(r).arrived.load(Ordering::Acquire) < step)
        },
    )
}

fn check_stop(seg: &Segment, step: u64, ctx: &WaitCtx) -> Result<()> {
    check_counters(seg, step, ctx)?;
    let head = |m: &[usize]| format!("{} #{} (step {step})", ctx.what, ctx.seq) + &format!(": ranks {m:?} did not arrive");
    let m = missing(seg, step);
    let dead: Vec<String> = m
        .iter()
        .filter_map(|&r| {
            let pid = seg.ctrl(r).pid.load(Ordering::Relaxed);
            pid_dead(pid).then(|| format!("rank {r} (pid {pid})"))
        })
        .collect();
    if !dead.is_empty() {
        return Err(Error::PeerDied(format!("{}; {} exited", head(&m), dead.join(", "))));
    }
    let left: Vec<usize> = m.iter().copied().filter(|&r| has_left(seg, r)).collect();
    // A rank that aborted the group and then closed it: its abort is the cause (below).
    if !left.is_empty() && !aborted_by(seg).is_some_and(|a| left.contains(&a)) {
        let gone: Vec<String> = left.iter().map(|&r| format!("rank {r} (pid {})", pid_of(seg, r))).collect();
        return Err(Error::PeerDied(format!(
            "{}; {} closed the group (destroy_process_group) without making this call",
            head(&m),
            gone.join(", ")
        )));
    }
    // After the liveness check, so that every survivor of a dead peer says so, not only
    // the first one to notice (which aborts the group for the others).
    if let Some(r) = aborted_by(seg) {
        return Err(Error::Aborted(format!("{}; the group was aborted by rank {r}", head(&m))));
    }
    if let Some(hook) = ctx.interrupt {
        if hook() {
            return Err(Error::Interrupted(format!("{} #{}", ctx.what, ctx.seq)));
        }
    }
    if Instant::now() >= ctx.deadline {
        return Err(Error::Timeout(format!("{} within the timeout of {:.3} s", head(&m), ctx.timeout.as_secs_f64())));
    }
    Ok(())
}

// ----- control-block accessors ----------------------------------------------------
// Every load and store of a control block or of the group line outside this file goes
// through one of these, so that the ordering of each is decided (and documented) here.
// The rule: data a rank publishes for step `s` (descriptor words, a buffer address, the
// probe words) is written with Relaxed stores *before* its `arrive(s)`, whose Release
// store of `arrived` orders them; a peer reads them with Relaxed loads only *after*
// `wait_all(s)`, whose Acquire loads of `arrived` order them. No other ordering is
// needed for them. Set-up words (`pid`, `attached`) are read while no step orders them,
// so they use Acquire/Release (AcqRel for the claiming swap) themselves.

/// Claims `rank`'s control block for process `pid`; returns the pid that held it (0 if
/// it was free, in which case it is now ours). AcqRel: the swap both publishes our pid
/// to peers that poll it and sees any earlier claim.
pub fn claim_rank(seg: &Segment, rank: usize, pid: u32) -> u32 {
    seg.ctrl(rank).pid.swap(pid, Ordering::AcqRel)
}

/// Counts this rank as attached (after [`claim_rank`]); Release via AcqRel so that a
/// rank that reads the full count also sees every claimed pid.
pub fn count_attached(seg: &Segment) {
    seg.group().attached.fetch_add(1, Ordering::AcqRel);
}

/// Number of ranks that have attached (Acquire, pairs with [`count_attached`]).
pub fn attached(seg: &Segment) -> usize {
    seg.group().attached.load(Ordering::Acquire) as usize
}

/// The process id rank `r` published (0 before it attached). Acquire: pairs with the
/// claiming swap. The value comes from shared memory: callers only print it or test
/// liveness with it ([`pid_dead`]).
pub fn pid_of(seg: &Segment, r: usize) -> u32 {
    seg.ctrl(r).pid.load(Ordering::Acquire)
}

/// Ranks that have not claimed their control block yet.
pub fn unattached(seg: &Segment) -> Vec<usize> {
    (0..seg.world_size()).filter(|&r| pid_of(seg, r) == 0).collect()
}

/// `"rank r (pid p)"` for each rank in `ranks` whose process is gone.
pub fn exited(seg: &Segment, ranks: impl IntoIterator<Item = usize>) -> Vec<String> {
    ranks
        .into_iter()
        .filter_map(|r| {
            let pid = pid_of(seg, r);
            pid_dead(pid).then(|| format!("rank {r} (pid {pid})"))
        })
        .collect()
}

/// Publishes `rank`'s descriptor words for the step of `parity` (Relaxed; ordered by the
/// `arrive` that follows).
pub fn publish_desc(seg: &Segment, rank: usize, parity: usize, words: [u64; DESC_WORDS]) {
    for (w, v) in seg.ctrl(rank).desc[parity].iter().zip(words) {
        w.store(v, Ordering::Relaxed);
    }
}

/// Rank `r`'s descriptor words for the step of `parity` (Relaxed; call only after
/// `wait_all` for that step). Untrusted: decode with `Desc::decode`.
pub fn read_desc(seg: &Segment, r: usize, parity: usize) -> [u64; DESC_WORDS] {
    std::array::from_fn(|i| seg.ctrl(r).desc[parity][i].load(Ordering::Relaxed))
}

/// Publishes the address (in this process) of the buffer peers read in the coming
/// single-copy step (Relaxed; ordered by the `arrive` that follows).
pub fn publish_addr(seg: &Segment, rank: usize, addr: u64) {
    seg.ctrl(rank).addr.store(addr, Ordering::Relaxed);
}

/// Every rank's (pid, published address), after `wait_all` for the step that published
/// them. Untrusted: only passed to the kernel (`cma::read`), which checks the range.
pub fn peer_addrs(seg: &Segment) -> Vec<(u32, u64)> {
    (0..seg.world_size()).map(|q| (seg.ctrl(q).pid.load(Ordering::Relaxed), seg.ctrl(q).addr.load(Ordering::Relaxed))).collect()
}

/// Publishes the address and value of this rank's single-copy probe word (Relaxed;
/// ordered by the `arrive` that follows).
pub fn publish_probe(seg: &Segment, rank: usize, addr: u64, value: u64) {
    let c = seg.ctrl(rank);
    c.addr.store(addr, Ordering::Relaxed);
    c.probe.store(value, Ordering::Relaxed);
}

/// Rank `q`'s (pid, probe address, probe value), after `wait_all` for the probe step.
pub fn read_probe(seg: &Segment, q: usize) -> (u32, u64, u64) {
    let c = seg.ctrl(q);
    (c.pid.load(Ordering::Relaxed), c.addr.load(Ordering::Relaxed), c.probe.load(Ordering::Relaxed))
}

/// Publishes whether this rank read every peer's probe word, and whether it could also
/// write every peer's (Relaxed; ordered by `arrive`): 1 both, 3 read only, 2 neither (the
/// field's values, `segment::Ctrl::cma`).
pub fn publish_cma(seg: &Segment, rank: usize, read: bool, write: bool) {
    seg.ctrl(rank).cma.store(
        match (read, write) {
            (true, true) => 1,
            (true, false) => 3,
            _ => 2,
        },
        Ordering::Relaxed,
    );
}

/// Rank `q`'s published single-copy verdict, (read, write), after `wait_all` for its step
/// (0, not yet published, reads as neither).
pub fn read_cma(seg: &Segment, q: usize) -> (bool, bool) {
    match seg.ctrl(q).cma.load(Ordering::Relaxed) {
        1 => (true, true),
        3 => (true, false),
        _ => (false, false),
    }
}
