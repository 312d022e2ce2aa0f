//! Keeping the binding's threads out of an interpreter that is exiting.
//!
//! Three kinds of code here enter Python from a thread that does not hold the GIL: the
//! completion callbacks of queued calls (on the progress thread, or on a thread waiting
//! for them), the signal checks of a thread waiting in a call, and the return of a
//! blocking call to its Python caller. Once CPython finalizes, none of them may: a GIL
//! request from a thread other than the finalizing one ends that thread with
//! `pthread_exit` (CPython 3.11-3.13; 3.14 blocks it forever instead), whose forced unwind
//! through this module's Rust frames aborts the process ("FATAL: exception not rethrown",
//! "terminate called without an active exception"), and pyo3 panics when its first GIL
//! request comes after finalization ("The Python interpreter is not initialized"). Gloo
//! aborts the same way when a daemon thread's collective ends during finalization.
//!
//! So `flagos_shm`'s `atexit` handler calls [`python_exiting`]: from then on, on every
//! thread but the one exiting (the one that ran the handler, which finalizes), a callback
//! on a progress thread is leaked, a waiting call stops checking for signals, and a
//! blocking call that returns parks its thread until the process exits
//! ([`detach_blocking`]), as CPython 3.14 does with such threads once it finalizes.

use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::ThreadId;
use std::time::Duration;

/// Set by [`python_exiting`].
static PYTHON_EXITING: AtomicBool = AtomicBool::new(false);
/// The thread that called [`python_exiting`]: the one running the `atexit` handlers, which
/// goes on to finalize the interpreter.
static EXITING_THREAD: OnceLock<ThreadId> = OnceLock::new();
/// Threads between their look at [`PYTHON_EXITING`] and their return from Python, and
/// threads whose blocking call has ended until they hold the GIL again ([`Entry`]).
static ENTRIES: AtomicUsize = AtomicUsize::new(0);

/// Tells the binding that the interpreter is exiting (`flagos_shm` calls it from an `atexit`
/// handler, which runs before the interpreter finalizes, after shutting down the groups that
/// still had queued work). From now on, on threads other than the caller's:
/// - a completion callback that runs on a progress thread does not take the GIL; it is
///   leaked, with the tensors it holds, so memory a call still running uses stays valid
///   until the process exits;
/// - a thread waiting in a call no longer takes the GIL to check for signals;
/// - a blocking call that returns from now on does not return to Python: its thread parks
///   until the process exits ([`detach_blocking`]).
///
/// Returns once the threads already inside Python on the binding's behalf have left it, and
/// the threads whose blocking call has ended (or, for an inline call, has let go of the
/// communicator: [`returning`]) hold the GIL again (it is released meanwhile, so that they
/// can take it).
///
/// Without it, a call queued with `async_op=True` and never waited for could finish after
/// Python had finalized, and a daemon thread's collective could end (a peer exited) while it
/// finalized: the thread's GIL request then panicked in pyo3 or ended the thread through a
/// forced unwind, and the process aborted (SIGABRT at exit).
#[pyfunction]
pub(super) fn python_exiting(py: Python<'_>) {
    // The first caller's thread is the exiting one; a second call (a test) changes nothing.
    let _ = EXITING_THREAD.set(std::thread::current().id());
    PYTHON_EXITING.store(true, SeqCst);
    // SeqCst on both sides (the store above, an entry's increment before its load): an
    // entry this loop does not see sees the flag.
    py.detach(|| {
        while ENTRIES.load(SeqCst) > 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    });
}

/// Whether [`python_exiting`] has run, on another thread than the calling one.
fn exiting_elsewhere() -> bool {
    PYTHON_EXITING.load(SeqCst) && EXITING_THREAD.get() != Some(&std::thread::current().id())
}

/// Counts a thread as about to enter Python, or inside it, until dropped; made before the
/// thread looks at [`PYTHON_EXITING`], so [`python_exiting`] waits for it.
pub(super) struct Entry(());

impl Entry {
    fn new() -> Entry {
        ENTRIES.fetch_add(1, SeqCst);
        Entry(())
    }

    /// A completion callback's entry, and whether the callback may call into Python: not
    /// on a progress thread once [`python_exiting`] has run (the caller then leaks it). A
    /// thread waiting for the call runs its callback as before.
    pub(super) fn callback() -> (Entry, bool) {
        let entry = Entry::new();
        (entry, !(PYTHON_EXITING.load(SeqCst) && crate::progress::on_progress_thread()))
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        ENTRIES.fetch_sub(1, SeqCst);
    }
}

/// A waiting thread's signal check (the interrupt hook of a call or of `wait_ticket`): takes
/// the GIL to run Python's signal handlers; true when one raised, its exception left in
/// `raised`. False without entering Python once [`python_exiting`] has run, except on the
/// exiting thread.
pub(super) fn signal_raised(raised: &Mutex<Option<PyErr>>) -> bool {
    let _entry = Entry::new();
    if exiting_elsewhere() {
        return false;
    }
    Python::attach(|py| match py.check_signals() {
        Ok(()) => false,
        Err(e) => {
            *raised.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            true
        }
    })
}

/// `py.detach(f)` for a call that may block (a collective, a wait, a point-to-point
/// transfer): if `f` returns after [`python_exiting`] has begun, on a thread other than the
/// exiting one, the thread parks until the process exits instead of taking the GIL back
/// (module docs). (It parked only once the interpreter finalized; a daemon thread whose
/// collective ended between the exit handler and finalization then waited for the GIL and
/// met finalization there: 2-5 aborts in 8 runs of a daemon thread looping over 64 MiB
/// allreduces while the main thread returned, Intel Xeon VM, 2026-12-06.) Every non-daemon
/// thread has been joined before `atexit` handlers run, so only a thread started by a later
/// handler and joined there would wait for good.
///
/// From the moment `f` returns until the thread holds the GIL again it counts as an
/// [`Entry`], so [`python_exiting`] (which waits with the GIL released for the entries to
/// leave) lets a call that ends before it runs take the GIL before the exiting thread goes
/// on towards finalization; the thread then meets `flagos_shm`'s exit checks on its way
/// back to the caller (`backend/exiting.py`).
pub(super) fn detach_blocking<T: Send>(py: Python<'_>, f: impl Send + FnOnce() -> T) -> T {
    let (out, entry) = py.detach(|| {
        let out = IN_CALL.with(|flag| {
            let outer = flag.0.swap(true, SeqCst); // true when nested (a callback's call)
            let out = f();
            flag.0.store(outer, SeqCst);
            out
        });
        let entry = RETURNING.with(|r| r.take()).unwrap_or_else(Entry::new);
        if exiting_elsewhere() {
            drop(entry);
            // Listed with the threads in calls again (threads_in_calls): it runs no Python
            // from now on, so the exit handler must not wait for it. (Unlisted, its frames,
            // still in flagos_shm's code, made the handler wait its whole 2 s bound in about
            // half the runs of a daemon thread looping over allreduces: a review, 2026-12-06.)
            IN_CALL.with(|flag| flag.0.store(true, SeqCst));
            loop {
                std::thread::park();
            }
        }
        (out, entry)
    });
    drop(entry);
    out
}

/// The threads that have made a call through [`detach_blocking`]: their ids (Python's
/// `threading.get_ident()`, which is `pthread_self()` on Linux) and whether they are inside
/// the call now.
static CALLERS: Mutex<Vec<(u64, Arc<AtomicBool>)>> = Mutex::new(Vec::new());

/// This thread's entry in [`CALLERS`], made at its first call and removed when it ends.
struct InCall(Arc<AtomicBool>);

impl InCall {
    fn register() -> InCall {
        let flag = Arc::new(AtomicBool::new(false));
        // SAFETY: pthread_self has no preconditions and only returns the caller's id.
        let id = unsafe { libc::pthread_self() } as u64;
        lock_callers().push((id, Arc::clone(&flag)));
        InCall(flag)
    }
}

impl Drop for InCall {
    fn drop(&mut self) {
        lock_callers().retain(|(_, flag)| !Arc::ptr_eq(flag, &self.0));
    }
}

fn lock_callers() -> std::sync::MutexGuard<'static, Vec<(u64, Arc<AtomicBool>)>> {
    CALLERS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether the calling thread is one of flagos_shm's progress threads (running a completion
/// callback, when Python asks): `flagos_shm`'s exit handler joins them as it closes their
/// groups, so they must go back from a call rather than park there
/// (`flagos_shm.backend.exiting`).
#[pyfunction]
pub(super) fn on_progress_thread() -> bool {
    crate::progress::on_progress_thread()
}

/// The ids (as `threading.get_ident()` gives them) of the threads blocked in a call made
/// through [`detach_blocking`] now: waiting in the core, with no Python code to run until
/// their call ends, or parked for good after it ended once the exit began. `flagos_shm`'s
/// exit handler does not wait for them.
#[pyfunction]
pub(super) fn threads_in_calls() -> Vec<u64> {
    lock_callers().iter().filter(|(_, flag)| flag.load(SeqCst)).map(|(id, _)| *id).collect()
}

thread_local! {
    /// This thread's flag in [`CALLERS`].
    static IN_CALL: InCall = InCall::register();
    /// The entry [`returning`] made for this thread's call, for [`detach_blocking`].
    static RETURNING: std::cell::Cell<Option<Entry>> = const { std::cell::Cell::new(None) };
}

/// Counts the calling thread, inside a call run by [`detach_blocking`], as returning to
/// Python from now on rather than from the call's end: for a call whose end someone waits
/// for (a group's shutdown waits for the inline calls of other threads to leave the
/// communicator), so that once that wait is over, [`python_exiting`] waits for the thread
/// too. Idempotent within a call.
pub(super) fn returning() {
    RETURNING.with(|r| {
        let entry = r.take().unwrap_or_else(Entry::new);
        r.set(Some(entry));
    });
}
