//! Waiting for a word that another process changes, written once for the group's steps
//! (`crate::sync`) and the point-to-point rings (`crate::p2p`); and telling whether that
//! process is still there.
//!
//! A [`Waiter`] spins for [`SPIN`] (unless told not to: a peer it waits for last ran on
//! this CPU, where spinning would only delay it), then yields the CPU until [`SPIN`] +
//! [`YIELD`], then sleeps on a futex ([`Doorbell`]: a word bumped by a change only when
//! someone sleeps) in slices of at most [`SLEEP_SLICE`]. Between slices it runs the
//! caller's checks: the deadline, abort flags, whether the peers' processes are alive
//! ([`pid_dead`]), an interrupt hook. So 4 ranks on 2 cores make progress, an idle waiter
//! costs no CPU, and no wait outlives its deadline.
//!
//! ## Sleeping and waking
//!
//! A sleeper must never sleep through the change it waits for (a lost wake would cost a
//! whole [`SLEEP_SLICE`]). Sleeper: (1) `sleepers += 1`; (2) SeqCst fence; (3) `w =
//! word`; (4) re-check the condition (e.g. arrivals, aborted); (5) `futex_wait(word, w)`,
//! which returns at once if `word != w`. Waker: (a) store the change (e.g. `arrived` or
//! `aborted`); (b) SeqCst fence; (c) if `sleepers > 0`: `word += 1` and `futex_wake`.
//! The two fences order (1) before (4) and (a) before (c), so in the single total order
//! of SeqCst fences either the sleeper's fence comes first, and then the waker's (c)
//! sees the registration, or the waker's comes first, and then the sleeper's (4) sees
//! the change. In the first case, if the bump of `word` comes after (3), (5) does not
//! sleep; if it comes before (3), (3) read it, and since the bump follows (a) in the
//! waker's order (SeqCst RMW, release), (4) sees the change. Without the sleeper's fence
//! the Acquire loads of (4) could be satisfied before the increment (1) is visible
//! (allowed on weakly ordered CPUs such as aarch64), and both sides would miss each
//! other. An abort rings with `force` ([`Doorbell::ring`]), which bumps the word even when
//! nobody is registered yet, and the sleeper re-checks the aborted flag in (4), so an
//! abort is never slept through either. The protocol is written once, in [`Doorbell`],
//! which the group line (`wake`, `sleepers`) and each point-to-point ring (`bell`,
//! `sleepers`) use.

use crate::error::{Error, Result};
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Busy-wait budget before yielding: long enough to catch a peer that is running on
/// another core a few microseconds behind, short enough not to starve it when it shares
/// ours.
pub const SPIN: Duration = Duration::from_micros(20);
/// Yield budget before sleeping on the futex.
pub const YIELD: Duration = Duration::from_micros(200);
/// Longest single futex sleep; bounds how late abort, liveness, interrupt and deadline
/// checks run.
pub const SLEEP_SLICE: Duration = Duration::from_millis(20);

/// How one wait for another process goes (module docs): spin, yield, then sleep on a
/// [`Doorbell`] in slices until the deadline, like crossbeam-utils' `Backoff` but across
/// processes and with checks between slices.
pub(crate) struct Waiter<'a> {
    bell: Doorbell<'a>,
    deadline: Instant,
    spin: bool,
    check_first: bool,
}

impl<'a> Waiter<'a> {
    /// A wait that sleeps on `bell` and whose sleeps end by `deadline`.
    pub fn new(bell: Doorbell<'a>, deadline: Instant) -> Self {
        Waiter { bell, deadline, spin: true, check_first: false }
    }

    /// Skips the spin phase when `skip` (a process the wait needs last ran on this CPU:
    /// it cannot make progress while we spin, so give the CPU away at once).
    pub fn skip_spin(mut self, skip: bool) -> Self {
        self.spin = !skip;
        self
    }

    /// Also runs the checks once before spinning (after a first look at `done()`), for a
    /// wait that should fail at once on what they find (a channel already closed).
    pub fn check_first(mut self) -> Self {
        self.check_first = true;
        self
    }

    /// Waits until `done()` holds. Before each sleep slice it runs `stop()`, whose error
    /// ends the wait: `stop` must fail once the deadline has passed (each caller names its
    /// wait in that error), and it is where the abort flags and peer liveness are checked.
    /// `skip()` true at the sleeper's re-check means: do not sleep this slice (a change that
    /// bumped the word before our snapshot, such as an abort, which `stop` reports next).
    ///
    /// An error of `stop` ends the wait only if `done()` still does not hold when looked
    /// at *after* it. A peer may publish what we wait for and then go (close its end,
    /// leave the group, exit) between our last look and `stop`'s finding; its stores came
    /// before the flag `stop` read with Acquire (a process's, before its exit), so the look
    /// after sees them, and the peer that did its part is not reported as gone.
    ///
    /// Except `Interrupted`: the interrupt hook has taken the signal by then, so that
    /// error is always returned.
    ///
    /// Errors: whatever `stop` returns.
    pub fn until(&self, done: impl Fn() -> bool, mut stop: impl FnMut() -> Result<()>, skip: impl Fn() -> bool) -> Result<()> {
        if done() {
            return Ok(());
        }
        let mut stop = || match stop() {
            // The interrupt hook has consumed the signal (its handler's exception waits to be
            // raised by the caller): the error must reach the caller even if `done()` holds.
            Err(e @ Error::Interrupted(_)) => Err(e),
            Err(e) => {
                // Orders the check's loads (a flag, or the liveness syscall, which need not
                // be a barrier) before the look at `done()` on weakly ordered CPUs too.
                fence(Ordering::SeqCst);
                if done() {
                    Ok(())
                } else {
                    Err(e)
                }
            }
            Ok(()) => Ok(()),
        };
        if self.check_first {
            stop()?;
        }
        let start = Instant::now();
        if self.spin {
            loop {
                for _ in 0..64 {
                    std::hint::spin_loop();
                    if done() {
                        return Ok(());
                    }
                }
                if start.elapsed() >= SPIN {
                    break;
                }
            }
        }
        while start.elapsed() < SPIN + YIELD {
            std::thread::yield_now();
            if done() {
                return Ok(());
            }
        }
        loop {
            stop()?;
            let left = self.deadline.saturating_duration_since(Instant::now());
            if self.bell.sleep(left.min(SLEEP_SLICE), &done, &skip) {
                return Ok(());
            }
        }
    }
}

/// The futex word and sleeper count of one wait queue in shared memory, and the two
/// halves of the protocol in "Sleeping and waking" (module docs) on them. Both the group
/// line (`wake`, `sleepers`) and each point-to-point ring (`bell`, `sleepers`) use it, so
/// the ordering that keeps a sleeper from missing its wake is written once, here.
pub(crate) struct Doorbell<'a> {
    pub word: &'a AtomicU32,
    pub sleepers: &'a AtomicU32,
}

impl Doorbell<'_> {
    /// The waker's half, called after the store that changes a sleeper's condition: wake
    /// the sleepers if any (every one if `force`, which also bumps the word when nobody is
    /// registered yet, so that a sleeper's snapshot taken before it differs).
    pub fn ring(&self, force: bool) {
        // This SeqCst fence, between the caller's store and our read of `sleepers`, pairs
        // with the sleeper's fence between its registration and its re-check (Dekker).
        fence(Ordering::SeqCst);
        if force || self.sleepers.load(Ordering::SeqCst) > 0 {
            self.word.fetch_add(1, Ordering::SeqCst);
            futex_wake(self.word);
        }
    }

    /// The sleeper's half: register, fence, snapshot the word, re-check `done()`, and
    /// sleep at most `timeout` unless it held (or `skip()` says not to). Returns whether
    /// `done()` held at the re-check or after waking; the caller loops (between slices it
    /// checks deadlines, aborts and peers).
    pub fn sleep(&self, timeout: Duration, done: impl Fn() -> bool, skip: impl Fn() -> bool) -> bool {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        // Without this fence the (Acquire) loads of `done()` could be satisfied before the
        // increment above is visible to the waker (allowed by the memory model, and by
        // weakly ordered CPUs such as aarch64 with RCpc loads), and both would miss.
        fence(Ordering::SeqCst);
        let w = self.word.load(Ordering::SeqCst);
        let held = done();
        if !held && !skip() {
            futex_wait(self.word, w, timeout);
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        held || done()
    }
}

/// Sleeps while `*word == expected`, at most `timeout`. Spurious returns are fine: the
/// caller re-checks its condition.
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: `word` is a valid, 4-byte aligned u32 in a shared mapping (so the
    // non-private futex op is the right one); `ts` outlives the call.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec, 0usize, 0u32);
    }
}

/// Wakes every thread sleeping in [`futex_wait`] on `word`, in any process.
fn futex_wake(word: &AtomicU32) {
    // SAFETY: as in `futex_wait`; waking has no memory-safety preconditions.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32);
    }
}

/// Whether `pid`, read from shared memory, can be a process id (1..=i32::MAX).
pub(crate) fn valid_pid(pid: u32) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use std::sync::Arc;

    struct Shared {
        word: AtomicU32,
        sleepers: AtomicU32,
        turn: AtomicU64,
        lost: AtomicBool,
    }

    impl Shared {
        fn bell(&self) -> Doorbell<'_> {
            Doorbell { word: &self.word, sleepers: &self.sleepers }
        }

        /// Waits until `turn` reaches `want`; a sleep that runs to its timeout although
        /// the peer changes `turn` at once is a lost wake: record it and give up.
        fn wait_turn(&self, want: u64) -> bool {
            const TIMEOUT: Duration = Duration::from_secs(2);
            while !self.lost.load(Ordering::SeqCst) {
                let t0 = Instant::now();
                if self.bell().sleep(TIMEOUT, || self.turn.load(Ordering::Acquire) >= want, || false) {
                    return true;
                }
                if t0.elapsed() >= TIMEOUT {
                    self.lost.store(true, Ordering::SeqCst);
                }
            }
            false
        }

        fn pass(&self, turn: u64) {
            self.turn.store(turn, Ordering::Release);
            self.bell().ring(false);
        }
    }

    /// A sleeper and a waker hand a counter back and forth 2000 times through one
    /// [`Doorbell`]; each side sleeps right away (no spinning), so most hand-overs go
    /// through the futex, and one lost wake fails the test after one 2 s timeout.
    #[test]
    fn doorbell_never_sleeps_through_a_ring() {
        const ROUNDS: u64 = 2000;
        let s = Arc::new(Shared {
            word: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
            turn: AtomicU64::new(0),
            lost: AtomicBool::new(false),
        });
        let peer = {
            let s = Arc::clone(&s);
            std::thread::spawn(move || {
                for i in 0..ROUNDS {
                    if !s.wait_turn(2 * i + 1) {
                        return;
                    }
                    s.pass(2 * i + 2);
                }
            })
        };
        for i in 0..ROUNDS {
            s.pass(2 * i + 1);
            if !s.wait_turn(2 * i + 2) {
                break;
            }
        }
        s.lost.load(Ordering::SeqCst).then(|| s.pass(u64::MAX)); // let a waiting peer go
        peer.join().unwrap();
        assert!(!s.lost.load(Ordering::SeqCst), "a sleep ran to its timeout although the condition had changed");
        assert_eq!(s.sleepers.load(Ordering::SeqCst), 0);
    }

    /// A failure found after the condition came to hold (a peer that published, then
    /// left) does not end the wait with an error: the condition is looked at once more.
    /// Here `stop` itself makes the change before it fails, the interleaving at its worst;
    /// a failure with the condition still unmet is returned, with or without `check_first`.
    #[test]
    fn a_failure_found_after_the_condition_came_to_hold_is_not_reported() {
        let (word, sleepers, flag) = (AtomicU32::new(0), AtomicU32::new(0), AtomicBool::new(false));
        let deadline = Instant::now() + Duration::from_secs(20);
        // One wait for `flag`, from false, whose check fails with `err`, after setting the
        // flag first when `publish`.
        let wait = |first: bool, publish: bool, err: fn() -> Error| {
            flag.store(false, Ordering::SeqCst);
            let stop = || {
                if publish {
                    flag.store(true, Ordering::Release);
                }
                Err(err())
            };
            let w = Waiter::new(Doorbell { word: &word, sleepers: &sleepers }, deadline).skip_spin(true);
            let w = if first { w.check_first() } else { w };
            w.until(|| flag.load(Ordering::Acquire), stop, || false)
        };
        let gone = || Error::PeerDied("the peer left".into());
        for first in [false, true] {
            wait(first, true, gone).unwrap();
            let e = wait(first, false, gone).unwrap_err();
            assert!(matches!(e, Error::PeerDied(_)), "{e}");
            // An interrupt (the hook took a Ctrl-C) is returned even though the condition
            // came to hold meanwhile: its signal would be lost otherwise.
            let e = wait(first, true, || Error::Interrupted("allreduce #0".into())).unwrap_err();
            assert!(matches!(e, Error::Interrupted(_)), "{e}");
        }
    }

    /// A [`Waiter`] returns as soon as the condition holds, and otherwise ends with its
    /// check's error once the deadline has passed, not before.
    #[test]
    fn waiter_ends_when_done_or_at_its_deadline() {
        let (word, sleepers, flag) = (AtomicU32::new(0), AtomicU32::new(0), AtomicBool::new(false));
        let bell = || Doorbell { word: &word, sleepers: &sleepers };
        let deadline = Instant::now() + Duration::from_millis(60);
        let t0 = Instant::now();
        let stop = || if Instant::now() >= deadline { Err(crate::error::Error::Timeout("late".into())) } else { Ok(()) };
        let e = Waiter::new(bell(), deadline).until(|| flag.load(Ordering::Acquire), stop, || false).unwrap_err();
        assert!(matches!(e, crate::error::Error::Timeout(_)) && t0.elapsed() >= Duration::from_millis(60), "{e}");
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                flag.store(true, Ordering::Release);
                bell().ring(false);
            });
            let deadline = Instant::now() + Duration::from_secs(20);
            let t0 = Instant::now();
            Waiter::new(bell(), deadline).skip_spin(true).until(|| flag.load(Ordering::Acquire), || Ok(()), || false).unwrap();
            assert!(t0.elapsed() < Duration::from_secs(10));
        });
    }
}
