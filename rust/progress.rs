//! Asynchronous progress: one background thread per communicator that runs queued
//! collectives in issue order.
//!
//! A [`Progress`] owns a group's [`Communicator`]. Callers either
//!
//! * run a collective **inline** on their own thread ([`Progress::run`]): the call first
//!   waits until every collective queued before it has finished, so the group's sequence
//!   stays in issue order; this is the latency path of synchronous calls; or
//! * **submit** it ([`Progress::submit`]): it is appended to a FIFO queue and the call
//!   returns at once; the progress thread runs queued collectives one after another and
//!   hands each result to the job's completion callback. This is the path of
//!   `async_op=True` and of DDP's bucket allreduces.
//!
//! The thread is started on the first submission (groups that never go asynchronous cost
//! no thread) and sleeps on a condition variable of its own while the queue is empty: an
//! idle group uses no CPU, and synchronous calls do not wake it. It runs under
//! `SCHED_BATCH` (unless the communicator's `Settings::progress_batch` is false), so that its wake-ups do not
//! preempt the thread that submitted (see `batch_policy`). Every collective, inline or
//! queued, honours the communicator's timeout and abort flag, so a queued job cannot wait
//! forever; [`Progress::close`] aborts the group
//! if work is still queued or running (queued jobs then fail without running), joins the
//! thread and drops the communicator (unmapping the segment).
//!
//! Locking: `state` guards the queue and the "a collective is running" flag; `comm` is
//! held only while a collective runs. Completion callbacks run with neither lock held, so
//! a callback may submit further work or take other locks (e.g. Python's GIL).
//!
//! Calls issued from completion callbacks: every rank must place them at the same position
//! of the group's sequence, whichever thread runs the callback and whenever. The place is
//! where NCCL puts them (its futures complete at enqueue, so a `.then` callback runs when
//! it is attached): right after the calls issued before the job's future was taken
//! ([`Progress::anchor`], which the c10d adapter calls from `getFuture`), ahead of those
//! issued after it, and after the calls of callbacks whose futures were taken earlier at
//! the same point. So a call an anchored job's callback issues is queued right after the
//! anchor (and after such earlier callbacks' calls), and while that callback has not
//! returned, no other thread starts a job: the callback's thread runs the jobs up to its own
//! calls, their callbacks nested in it, except that an anchored job's callback anchored
//! after this one waits until this one has returned (NCCL attached it later: see
//! [`Shared::execute`]). DDP's comm hooks take the future at issue: PowerSGD's callbacks'
//! allreduces go right after their bucket's, before the next bucket's, on every rank. A job
//! whose future nobody took runs no user callback and holds nothing back.

use crate::algorithms::{AbortHandle, Communicator};
use crate::error::{Error, Result};
use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

/// How often [`Progress::help_until_by`] asks its `stop` hook while it waits.
pub const STOP_CHECK: std::time::Duration = std::time::Duration::from_millis(20);

/// A collective to run on the communicator.
pub type Task = Box<dyn FnOnce(&mut Communicator) -> Result<()> + Send>;
/// Receives a submitted task's result, on the progress thread.
pub type Done = Box<dyn FnOnce(Result<()>) + Send>;
/// The results part of a [`Done`] ([`Progress::submit_with_results`]): receives the result,
/// or hands it back (`Some`) to decline, and the whole `done` then runs at once instead.
pub type Results = Box<dyn FnOnce(Result<()>) -> Option<Result<()>> + Send>;

thread_local! {
    static ON_PROGRESS_THREAD: Cell<bool> = const { Cell::new(false) };
    /// Set while this thread runs a completion callback.
    static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
    /// The innermost completion callback running on this thread: (its group's [`Shared`]
    /// address, its job's ticket); (0, 0) when none.
    static CALLBACK: Cell<(usize, u64)> = const { Cell::new((0, 0)) };
}

/// Whether the calling thread is a progress thread (e.g. to skip work that only makes
/// sense on the thread that issued a call, such as polling for Ctrl-C).
pub fn on_progress_thread() -> bool {
    ON_PROGRESS_THREAD.with(Cell::get)
}

struct Job {
    ticket: u64,
    task: Task,
    done: Done,
    /// Set by [`Progress::anchor`].
    anchor: Option<Anchor>,
    /// Issued from the callback of a job anchored `n`-th: `Some(n)` (orders the calls of
    /// callbacks anchored at the same point, see [`State::position`]).
    key: Option<u64>,
    /// The part of `done` that delivers the results ([`Progress::submit_with_results`]).
    results: Option<Results>,
}

/// Where the calls of a job's callbacks go ([`Progress::anchor`]).
#[derive(Clone, Copy)]
struct Anchor {
    /// The last job issued other than from a callback when the job's future was taken (the
    /// job itself if later, or if the future was taken in one of the group's callbacks).
    after: u64,
    /// Anchors set before this one (orders the callbacks anchored at one point).
    n: u64,
}

/// A job claimed (its task running or done) whose callback has not returned yet.
struct Open {
    ticket: u64,
    /// Order of claiming: callbacks run in this order (see [`State::callbacks_before_done`]).
    seq: u64,
    /// The thread that claimed it and runs its callback.
    thread: std::thread::ThreadId,
    anchor: Option<Anchor>,
    /// How many waits its callback is in, on its own thread, for calls issued after it
    /// ([`Shared::suspend`]); while any, later callbacks may run as if it had returned.
    suspended: u32,
    /// Its callback, put off until another callback has returned (see
    /// [`Shared::execute`]); later callbacks may run meanwhile.
    parked: Option<Parked>,
}

/// A callback put off until the callback of open job `under` has returned.
struct Parked {
    under: u64,
    done: Done,
    /// The job's results part, if it has one ([`Progress::submit_with_results`]): run
    /// ahead of `done` when the callback the job is parked in waits for it.
    results: Option<Results>,
    /// The job's result (`Ok(())` once handed to `results`).
    result: Result<()>,
    /// `results` has run: the job is finished for the callback waiting for it, while
    /// `done` stays parked.
    delivered: bool,
}

/// What [`Progress::help_until_by`] does next on the waiting thread.
enum Helped {
    /// Run a queued job, claimed `seq`-th.
    Job(Job, u64),
    /// Run the callback of the job waited for, parked by this thread ([`State::unpark`]).
    Callback(Done, Result<()>),
    /// Run the results part of the job waited for; its callback stays parked.
    Results(Results, Result<()>),
    /// Return: the results part of the job waited for has run.
    Delivered,
}

struct State {
    /// Jobs not started yet, in the order they will run (issue order, except that a call
    /// issued from a callback goes right after the callback's anchor: see the module docs).
    queue: VecDeque<Job>,
    /// Ticket of the next submission (tickets start at 1).
    next_ticket: u64,
    /// Claimed jobs whose callbacks have not returned, in claiming order. A job is queued,
    /// open, or finished.
    open: Vec<Open>,
    /// `seq` of the next claim.
    next_seq: u64,
    /// `Anchor::n` of the next anchor.
    next_anchor: u64,
    /// Ticket of the last job submitted other than from one of the group's callbacks.
    last_plain: u64,
    /// A collective (inline or queued) is running or has been claimed.
    busy: bool,
    /// `close` was called: no new submissions; the thread exits once the queue is empty.
    closing: bool,
    /// `close` found work queued or running: jobs that have not started yet complete
    /// with [`SHUT_DOWN`] instead of running.
    cancelled: bool,
    /// The progress thread is blocked on the condition variable with nothing to do.
    parked: bool,
    /// Times the progress thread returned from that wait (an idle thread does not).
    wakeups: u64,
}

impl State {
    /// Whether the job claimed `seq`-th may run its callback: every job claimed before it
    /// has returned from its callback or is suspended. So callbacks run in the order their
    /// jobs ran, and a completed work implies the works that ran before it are complete.
    fn callbacks_before_done(&self, seq: u64) -> bool {
        self.open.iter().all(|o| o.seq >= seq || o.suspended > 0 || o.parked.is_some())
    }

    /// Whether job `ticket`'s callback has returned (or it never ran: ticket 0).
    fn is_finished(&self, ticket: u64) -> bool {
        ticket < self.next_ticket && !self.is_queued(ticket) && !self.open.iter().any(|o| o.ticket == ticket)
    }

    fn is_queued(&self, ticket: u64) -> bool {
        self.queue.iter().any(|j| j.ticket == ticket)
    }

    /// Whether thread `me` may start the front job now: nothing runs, and no anchored
    /// callback of another thread holds it back. After `close` cancelled the queue nothing
    /// is held back: those jobs do not run.
    ///
    /// Two threads can each hold an anchored callback only if a future was taken while its
    /// job ran and another thread was already running a later one. Then each callback's
    /// thread may go on while the other's waits for its own calls (suspended): they could
    /// otherwise wait for each other for good.
    fn may_claim(&self, me: std::thread::ThreadId) -> bool {
        if self.busy {
            return false;
        }
        let mine = self.open.iter().any(|o| o.thread == me);
        self.cancelled || self.open.iter().all(|o| o.thread == me || o.anchor.is_none() || (mine && o.suspended > 0))
    }

    /// Takes the front job for thread `me` (checked by `may_claim`).
    fn claim(&mut self, me: std::thread::ThreadId) -> Option<(Job, u64)> {
        let job = self.queue.pop_front()?;
        let seq = self.next_seq;
        self.next_seq += 1;
        self.busy = true;
        self.open.push(Open { ticket: job.ticket, seq, thread: me, anchor: job.anchor, suspended: 0, parked: None });
        Some((job, seq))
    }

    /// The anchor of open job `origin`'s callback, if it has one.
    fn anchor_of(&self, origin: Option<u64>) -> Option<Anchor> {
        origin.and_then(|t| self.open.iter().find(|o| o.ticket == t)).and_then(|o| o.anchor)
    }

    /// Where a job issued now goes in the queue: from the callback of open job `origin`
    /// with an anchor, right after the anchor (the front if it has started), and after the
    /// calls queued there by callbacks anchored before it (NCCL runs those callbacks first:
    /// they were attached first); otherwise (no callback, or no anchor) at the back.
    fn position(&self, origin: Option<u64>) -> usize {
        self.position_after(self.anchor_of(origin))
    }

    /// [`Self::position`], given the origin's anchor.
    fn position_after(&self, anchor: Option<Anchor>) -> usize {
        let Some(anchor) = anchor else {
            return self.queue.len();
        };
        let mut at = self.queue.iter().position(|j| j.ticket == anchor.after).map_or(0, |i| i + 1);
        while self.queue.get(at).is_some_and(|j| j.key.is_some_and(|k| k < anchor.n)) {
            at += 1;
        }
        at
    }

    /// What thread `me`, waiting for job `ticket`, does if it parked that job's callback
    /// (it waits from the callback the job is parked in). With a results part, that part
    /// runs now and the callback stays parked: the waiter gets the results, and the
    /// callbacks attached to the job's future still run after the waiting one has
    /// returned, as NCCL runs them (their calls go after the waiting callback's). Without
    /// one, the whole callback runs now.
    /// None: nothing parked by `me` (wait as for any job).
    fn unpark(&mut self, ticket: u64, me: std::thread::ThreadId) -> Option<Helped> {
        let o = self.open.iter_mut().find(|o| o.ticket == ticket && o.thread == me)?;
        let p = o.parked.as_mut()?;
        if p.delivered {
            return Some(Helped::Delivered);
        }
        if let Some(results) = p.results.take() {
            p.delivered = true;
            return Some(Helped::Results(results, std::mem::replace(&mut p.result, Ok(()))));
        }
        o.parked.take().map(|p| Helped::Callback(p.done, p.result))
    }

    /// Takes job `ticket`'s parked callback (its results part declined).
    fn unpark_whole(&mut self, ticket: u64) -> Option<Done> {
        let o = self.open.iter_mut().find(|o| o.ticket == ticket)?;
        o.parked.take().map(|p| p.done)
    }

    /// Takes the first (in running order) callback parked until job `under`'s returned.
    fn next_parked(&mut self, under: u64) -> Option<(u64, Done, Result<()>)> {
        let o = self.open.iter_mut().find(|o| o.parked.as_ref().is_some_and(|p| p.under == under))?;
        let ticket = o.ticket;
        o.parked.take().map(|p| (ticket, p.done, p.result))
    }

    fn set_suspended(&mut self, ticket: u64, on: bool) {
        if let Some(o) = self.open.iter_mut().find(|o| o.ticket == ticket) {
            o.suspended = if on { o.suspended + 1 } else { o.suspended.saturating_sub(1) };
        }
    }
}

/// A callback suspended by [`Shared::suspend`]; resumes (in the bookkeeping) on drop.
struct Suspended<'a>(&'a Shared, Option<u64>);

impl Drop for Suspended<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.1 {
            lock(&self.0.state).set_suspended(t, false);
        }
    }
}

/// The error of a job that `close` found still queued.
pub const SHUT_DOWN: &str = "the process group was shut down with this collective still queued";

struct Shared {
    comm: Mutex<Option<Communicator>>,
    /// Aborts the group without the `comm` lock (which a running collective holds).
    aborter: AbortHandle,
    state: Mutex<State>,
    /// Signalled when a job is queued, when `busy` clears, when a callback has returned,
    /// and on close (what inline callers and helpers wait for).
    changed: Condvar,
    /// Signalled only when the progress thread may have something to do: a job queued,
    /// `busy` cleared while jobs are queued, close. Kept apart from `changed` so that a
    /// synchronous call of a group that once went asynchronous does not wake its idle
    /// thread for nothing (a futex wake and, on a shared CPU, two context switches: 14.2
    /// against 9.6 us per 4-byte allreduce on the AMD EPYC VM).
    queued: Condvar,
    /// Whether the thread moves itself to `SCHED_BATCH` (`Settings::progress_batch`).
    batch: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn closed() -> Error {
    Error::Aborted("the communicator is closed".into())
}

impl Shared {
    /// Runs `f` on the communicator (error if closed). Called with `busy` claimed.
    fn with_comm<R>(&self, f: impl FnOnce(&mut Communicator) -> Result<R>) -> Result<R> {
        let mut guard = lock(&self.comm);
        let comm = guard.as_mut().ok_or_else(closed)?;
        f(comm)
    }

    fn release(&self) {
        // The progress thread parks on `queued` while `busy` is set; it must look again when
        // there is a job for it, and also when `close` is waiting to join it (a close that
        // came while an inline call held `busy` found it parked: woken only on `changed`, it
        // would never see `closing`, and the close would wait forever).
        let waiting = {
            let mut st = lock(&self.state);
            st.busy = false;
            !st.queue.is_empty() || st.closing
        };
        self.wake(waiting);
    }

    /// Wakes the waiters on `changed`, and the progress thread too if `thread`.
    fn wake(&self, thread: bool) {
        self.changed.notify_all();
        if thread {
            self.queued.notify_all();
        }
    }

    /// Runs a job claimed (`State::claim`) as the `seq`-th: the task, then (with no lock
    /// held) its callback.
    ///
    /// The next job's collective may start as soon as this one's has finished (`busy` is
    /// released first; if this job is anchored, only on this thread: module docs), but callbacks run in the
    /// order the jobs ran: this one waits until the earlier jobs' callbacks have returned,
    /// or are suspended (they wait, on their own thread, for a call issued after them:
    /// [`Shared::suspend`]). So a completed work implies that every work that ran before it
    /// on the group is complete too (results written back), as on a single device stream,
    /// except a work whose callback waits for it.
    ///
    /// Run on the thread of an anchored callback (waiting for its own calls) whose future
    /// was taken before this job's, an anchored job's callback is *parked* until that
    /// callback has returned: NCCL would have run it after (it was attached later), so the
    /// calls it issues must come after that callback's. Waiting for the job itself from
    /// the callback ([`Progress::help_until`]) runs its results part then (the callback
    /// stays parked), or, if it has none, the whole callback.
    fn execute(&self, job: Job, seq: u64) {
        self.execute_by(job, seq, None);
    }

    /// [`Self::execute`], the job's collective given up by `deadline` if it has one: the
    /// communicator's timeout, for that job, is at most the time left (a wait with a
    /// timeout that runs the job itself gives up then, aborting the group, as it would
    /// if another thread ran the job).
    fn execute_by(&self, job: Job, seq: u64, deadline: Option<Instant>) {
        let cancelled = lock(&self.state).cancelled;
        let result = if cancelled {
            Err(Error::Aborted(SHUT_DOWN.into()))
        } else {
            self.with_comm(|comm| {
                let t = deadline.map(|d| comm.timeout().min(d.saturating_duration_since(Instant::now())));
                comm.with_timeout(t, job.task)
            })
        };
        self.release();
        let under = self.own_callback();
        {
            let mut st = lock(&self.state);
            let theirs = st.anchor_of(under);
            let mine = st.open.iter_mut().find(|o| o.ticket == job.ticket);
            if let (Some(o), Some(theirs), Some(under)) = (mine, theirs, under) {
                if o.anchor.is_some_and(|mine| theirs.n < mine.n) {
                    o.parked = Some(Parked { under, done: job.done, results: job.results, result, delivered: false });
                    drop(st);
                    self.changed.notify_all();
                    return;
                }
            }
            while !st.callbacks_before_done(seq) {
                st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        }
        self.callback(job.ticket, job.done, result);
    }

    /// Runs job `ticket`'s callback on this thread, then the callbacks parked until it
    /// returned (in running order).
    fn callback(&self, ticket: u64, done: Done, result: Result<()>) {
        self.callback_only(ticket, done, result);
        loop {
            let next = lock(&self.state).next_parked(ticket);
            match next {
                Some((t, done, result)) => self.callback(t, done, result),
                None => break,
            }
        }
    }

    /// Runs job `ticket`'s callback, marked as this group's on this thread, and records
    /// its return.
    fn callback_only(&self, ticket: u64, done: Done, result: Result<()>) {
        /// Records the callback as returned even if it panics, so later ones still run.
        struct Finished<'a>(&'a Shared, u64);
        impl Drop for Finished<'_> {
            fn drop(&mut self) {
                let mut st = lock(&self.0.state);
                if let Some(i) = st.open.iter().position(|o| o.ticket == self.1) {
                    st.open.remove(i);
                }
                // An anchored callback that returned may let the progress thread start the
                // jobs it held back.
                let thread = !st.queue.is_empty() || st.closing;
                drop(st);
                self.0.wake(thread);
            }
        }
        let _finished = Finished(self, ticket);
        /// Marks this thread as running a callback of this group (restored on unwind too).
        struct InCallback(bool, (usize, u64));
        impl Drop for InCallback {
            fn drop(&mut self) {
                IN_CALLBACK.with(|c| c.set(self.0));
                CALLBACK.with(|c| c.set(self.1));
            }
        }
        let _in_callback = InCallback(IN_CALLBACK.with(|c| c.replace(true)), CALLBACK.with(|c| c.replace((self.id(), ticket))));
        done(result);
    }

    /// This group's identity for [`CALLBACK`].
    fn id(&self) -> usize {
        self as *const Shared as usize
    }

    /// The ticket of the callback of this group running on the calling thread, if any.
    fn own_callback(&self) -> Option<u64> {
        let (id, ticket) = CALLBACK.with(Cell::get);
        (id == self.id()).then_some(ticket)
    }

    /// Marks the callback running on this thread (if it is one of this group's) suspended
    /// until the guard drops: it is about to wait for calls issued after it, which run on
    /// this thread; their callbacks must not wait for it to return.
    fn suspend(&self) -> Suspended<'_> {
        let ticket = self.own_callback();
        if let Some(t) = ticket {
            lock(&self.state).set_suspended(t, true);
            self.changed.notify_all();
        }
        Suspended(self, ticket)
    }

    fn thread_main(&self) {
        ON_PROGRESS_THREAD.with(|c| c.set(true));
        if self.batch {
            batch_policy();
        }
        let me = std::thread::current().id();
        loop {
            let (job, seq) = {
                let mut st = lock(&self.state);
                loop {
                    if st.may_claim(me) {
                        if let Some(claimed) = st.claim(me) {
                            break claimed;
                        }
                    }
                    if st.closing && st.queue.is_empty() && !st.busy {
                        return;
                    }
                    st.parked = true;
                    st = self.queued.wait(st).unwrap_or_else(|p| p.into_inner());
                    st.parked = false;
                    st.wakeups += 1;
                }
            };
            self.execute(job, seq);
        }
    }
}

/// Moves the calling thread to `SCHED_BATCH` (Linux): the same share of the CPU as
/// before (nice 0), but its wake-ups do not preempt the thread running on that CPU. When
/// a rank and its progress thread share one CPU (pinned ranks), a submission otherwise
/// hands the CPU to the woken progress thread at once, and `async_op=True` followed by
/// `wait()` paid for the switches there and back (and for the completion callback waiting
/// for the GIL): 50 us against 9 us for the same call run synchronously (AMD EPYC
/// 2-vCPU VM, 4-byte allreduce, 2 pinned ranks). Now the issuing thread keeps the CPU
/// and, if it waits, runs the queued call itself ([`Progress::help_until`]); on an idle
/// CPU the thread runs at once as before. Best effort: an error leaves the policy as it was.
fn batch_policy() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: `param` is a valid sched_param; pid 0 is the calling thread.
        let _ = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    }
}

/// A communicator plus its (lazily started) progress thread. See the module docs.
pub struct Progress {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Progress {
    pub fn new(comm: Communicator) -> Progress {
        Progress {
            shared: Arc::new(Shared {
                aborter: comm.abort_handle(),
                batch: comm.settings().progress_batch,
                comm: Mutex::new(Some(comm)),
                state: Mutex::new(State {
                    queue: VecDeque::new(),
                    next_ticket: 1,
                    open: Vec::new(),
                    next_seq: 0,
                    next_anchor: 0,
                    last_plain: 0,
                    busy: false,
                    closing: false,
                    cancelled: false,
                    parked: false,
                    wakeups: 0,
                }),
                changed: Condvar::new(),
                queued: Condvar::new(),
            }),
            thread: Mutex::new(None),
        }
    }

    /// Runs `f` on the calling thread once every previously submitted job has finished,
    /// its completion callback included (so a synchronous call that returned implies the
    /// asynchronous ones issued before it are complete). Called from a completion callback,
    /// it does not wait for callbacks (its own has not returned yet); called from one of
    /// this group's callbacks, it runs where a call issued from that callback goes (module
    /// docs): it first runs, on the calling thread, the jobs still queued up to the
    /// callback's anchor (all those queued if the job has none), their callbacks included,
    /// this callback suspended meanwhile.
    ///
    /// Errors: `Aborted` if the communicator is closed; otherwise whatever `f` returns.
    pub fn run<R>(&self, f: impl FnOnce(&mut Communicator) -> Result<R>) -> Result<R> {
        if let Some(own) = self.shared.own_callback() {
            let _suspended = self.shared.suspend();
            let me = std::thread::current().id();
            loop {
                let claimed = {
                    let mut st = lock(&self.shared.state);
                    loop {
                        if st.may_claim(me) {
                            break;
                        }
                        st = self.shared.changed.wait(st).unwrap_or_else(|p| p.into_inner());
                    }
                    if st.position(Some(own)) == 0 {
                        st.busy = true; // nothing left before this call: run it
                        None
                    } else {
                        st.claim(me)
                    }
                };
                match claimed {
                    Some((job, seq)) => self.shared.execute(job, seq),
                    None => break,
                }
            }
        } else {
            let in_callback = IN_CALLBACK.with(|c| c.get());
            let mut st = lock(&self.shared.state);
            while st.busy || !st.queue.is_empty() || (!in_callback && !st.open.is_empty()) {
                st = self.shared.changed.wait(st).unwrap_or_else(|p| p.into_inner());
            }
            st.busy = true;
        }
        let result = self.shared.with_comm(f);
        self.shared.release();
        result
    }

    /// Whether the calling thread runs one of this group's completion callbacks: a call it
    /// submits must then be run by it ([`Self::help_until`]), since the progress thread (if
    /// that is not this thread) runs it only after the callbacks before it have returned.
    pub fn in_own_callback(&self) -> bool {
        self.shared.own_callback().is_some()
    }

    /// Queues `task` and returns its ticket; `done` later receives its result, on the
    /// progress thread (or on a thread in [`Self::help_until`]). If the communicator is
    /// closing, `done` receives `Aborted` at once, on the calling thread (ticket 0).
    ///
    /// Issued from one of this group's callbacks, the job is queued where the module docs
    /// say (after the callback's anchor); otherwise at the back.
    pub fn submit(&self, task: Task, done: Done) -> u64 {
        self.submit_with_results(task, None, done)
    }

    /// [`Self::submit`], with `done` in two parts: `results` delivers the job's results
    /// (e.g. writes them back and releases its waiters) without running callbacks the
    /// user attached; `done` does all of it, or only the rest once `results` has run.
    ///
    /// `results` runs (instead of `done`, ahead of it) only when the job's callback is
    /// parked until an earlier-anchored callback has returned and that callback waits for
    /// the job ([`Shared::execute`]): the waiter needs the results now, but NCCL would run
    /// the job's callbacks after the waiting one. `done` then runs later, as parked, with
    /// `Ok(())`: the result went to `results`. If `results` declines (hands the result
    /// back), the whole `done` runs then, as for a job without one. Otherwise `results` is
    /// dropped unrun.
    pub fn submit_with_results(&self, task: Task, results: Option<Results>, done: Done) -> u64 {
        let origin = self.shared.own_callback();
        {
            let mut st = lock(&self.shared.state);
            if !st.closing {
                let ticket = st.next_ticket;
                st.next_ticket += 1;
                let anchor = st.anchor_of(origin);
                let at = st.position_after(anchor);
                let key = anchor.map(|a| a.n);
                if origin.is_none() {
                    st.last_plain = ticket;
                }
                st.queue.insert(at, Job { ticket, task, done, anchor: None, key, results });
                drop(st);
                self.ensure_thread();
                self.shared.changed.notify_all();
                self.shared.queued.notify_all();
                return ticket;
            }
        }
        done(Err(closed()));
        0
    }

    /// Returns once the job with `ticket` has completed (its callback returned), or, waited
    /// for from the callback it is parked in, once its results part has run
    /// ([`Self::submit_with_results`]).
    ///
    /// Queued jobs up to `ticket` that the progress thread has not claimed yet are run
    /// here, on the calling thread, in issue order: a caller that waits right after
    /// submitting (`async_op=True` then `wait()`) does not pay for a thread switch.
    pub fn help_until(&self, ticket: u64) {
        self.help_until_by(ticket, &|| false, None);
    }

    /// [`Self::help_until`], giving up when `stop()` returns `true` (checked every
    /// [`STOP_CHECK`] while the job runs elsewhere, with no lock held; e.g. Ctrl-C) or at
    /// `deadline` (a wait with a timeout: a job it runs on this thread gets at most the
    /// time left, [`Shared::execute_by`]). Returns `false` when it gave up; the job itself
    /// goes on.
    pub fn help_until_by(&self, ticket: u64, stop: &dyn Fn() -> bool, deadline: Option<Instant>) -> bool {
        let _suspended = self.shared.suspend();
        let me = std::thread::current().id();
        loop {
            let next = {
                let mut st = lock(&self.shared.state);
                loop {
                    if st.is_finished(ticket) {
                        return true;
                    }
                    if let Some(next) = st.unpark(ticket, me) {
                        // Parked by this thread until a callback it is in returns, and
                        // waited for from that callback.
                        break next;
                    }
                    if st.is_queued(ticket) && st.may_claim(me) {
                        let (job, seq) = st.claim(me).expect("a job is queued");
                        break Helped::Job(job, seq);
                    }
                    let (guard, waited) = self.shared.changed.wait_timeout(st, STOP_CHECK).unwrap_or_else(|p| p.into_inner());
                    st = guard;
                    if waited.timed_out() {
                        drop(st);
                        if stop() || deadline.is_some_and(|d| Instant::now() >= d) {
                            return false;
                        }
                        st = lock(&self.shared.state);
                    }
                }
            };
            match next {
                Helped::Job(job, seq) => self.shared.execute_by(job, seq, deadline),
                Helped::Callback(done, result) => self.shared.callback(ticket, done, result),
                Helped::Results(results, result) => {
                    if let Some(result) = results(result) {
                        // Declined: the whole callback runs now instead.
                        let parked = lock(&self.shared.state).unpark_whole(ticket);
                        if let Some(done) = parked {
                            self.shared.callback(ticket, done, result);
                        }
                    }
                }
                Helped::Delivered => return true,
            }
        }
    }

    /// Records that job `ticket`'s future has been taken (c10d `Work::getFuture`), so
    /// that callbacks may be attached to it: its callbacks' calls go after the last job
    /// issued now other than from a callback (after the job itself if that is later, or if
    /// the future is taken in one of the group's callbacks, where NCCL would run a callback
    /// attached to it at once), and after those anchored before it. See the module docs.
    /// Nothing happens if the job's callback has returned already (the future was then
    /// complete when taken: callbacks attached to it run at once, on the attaching thread).
    pub fn anchor(&self, ticket: u64) {
        let in_callback = self.shared.own_callback().is_some();
        let mut st = lock(&self.shared.state);
        let after = if in_callback { ticket } else { st.last_plain.max(ticket) };
        let anchor = Some(Anchor { after, n: st.next_anchor });
        if let Some(job) = st.queue.iter_mut().find(|j| j.ticket == ticket) {
            job.anchor = anchor;
        } else if let Some(o) = st.open.iter_mut().find(|o| o.ticket == ticket) {
            o.anchor = anchor;
        } else {
            return;
        }
        st.next_anchor += 1;
    }

    fn ensure_thread(&self) {
        let mut thread = lock(&self.thread);
        if thread.is_none() {
            let shared = Arc::clone(&self.shared);
            let handle = std::thread::Builder::new()
                .name("flagos_shm-progress".into())
                .spawn(move || shared.thread_main())
                .expect("spawning the flagos_shm progress thread");
            *thread = Some(handle);
        }
    }

    /// Whether the progress thread has been started and not yet joined by [`Progress::close`].
    pub fn thread_running(&self) -> bool {
        lock(&self.thread).is_some()
    }

    /// Whether the progress thread is blocked, idle, on its condition variable, and how many
    /// times it has returned from that wait so far: an idle thread sleeps without waking
    /// (no polling), so the count stays put while nothing is submitted.
    pub fn thread_parked(&self) -> (bool, u64) {
        let st = lock(&self.shared.state);
        (st.parked, st.wakeups)
    }

    /// Whether `close` has dropped the communicator.
    pub fn is_closed(&self) -> bool {
        lock(&self.shared.comm).is_none()
    }

    /// Stops accepting work, joins the thread and drops the communicator. Idempotent.
    ///
    /// Work still queued or running would otherwise hold the close for up to a timeout
    /// each (its peers may never issue it): if there is any, the group is aborted, which
    /// cuts the running collective short (it fails with `Aborted`, and so do the peers'
    /// calls in it), and every job not started yet completes with `Aborted`
    /// ([`SHUT_DOWN`]) without running; callbacks still run in ticket order. With nothing
    /// pending the group is left alone, so peers are not disturbed by a clean close.
    pub fn close(&self) {
        {
            let mut st = lock(&self.shared.state);
            let pending = st.busy || !st.queue.is_empty();
            if !st.closing && pending {
                st.cancelled = true;
                self.shared.aborter.abort();
            }
            st.closing = true;
        }
        self.shared.changed.notify_all();
        self.shared.queued.notify_all();
        let handle = lock(&self.thread).take();
        if let Some(h) = handle {
            if h.thread().id() == std::thread::current().id() {
                // Closed from a completion callback: the thread exits by itself once the
                // queue is empty; joining itself would deadlock.
                return;
            }
            let _ = h.join();
        }
        // Inline callers still running hold `busy`; wait for them, then drop the comm.
        let _ = self.run(|_| Ok(()));
        lock(&self.shared.comm).take();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.close();
    }
}
