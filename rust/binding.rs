//! PyO3 binding: the extension module `flagos_shm._core`.
//!
//! Buffers are passed as raw addresses (`tensor.data_ptr()`), each followed by its length
//! in bytes, plus an element count, so the Python side copies nothing. The core checks
//! the count against every byte length (`ValueError` naming the argument otherwise,
//! before anything is written); the Python layer (`flagos_shm.staging`) guarantees that
//! each address and length describe contiguous host memory, and keeps
//! the tensor alive for the call (for a call given a `done` callback: until the callback
//! has been called). Every collective releases the GIL for its whole
//! duration; while it waits it re-takes the GIL briefly every few milliseconds only to
//! check for signals, so Ctrl-C interrupts a waiting rank (and aborts its group).
//!
//! Exceptions: `ValueError` for bad arguments and for ranks that disagree on a call (or a
//! peer that rejected its arguments), `TypeError` for an unsupported dtype / reduce op,
//! `OSError` when the segment cannot be created or mapped, `RuntimeError` for timeouts,
//! dead peers and aborted groups, `KeyboardInterrupt` (or whatever a signal handler
//! raised) when interrupted.
//!
//! `Communicator` is here; `P2PChannel` (point-to-point between two ranks) is in `binding/p2p.rs`,
//! `copy_bytes` (the host copy of `flagos_shm.staging`) in `binding/staging.rs`, `reduce_into` /
//! `convert_into` (host reductions of the multi-node hierarchy) in `binding/reduce.rs`.

use crate::algorithms::{AbortHandle, Communicator, Kind, ONE_SHOT_MAX_BYTES};
use crate::buffer::Buf;
use crate::error::Error;
use crate::progress::{self, Progress};
use crate::reduce::{DType, ReduceOp};
use crate::segment::{self, DEFAULT_SLOT_BYTES};
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod p2p;
mod reduce;
mod staging;

type Pending = Arc<Mutex<Option<PyErr>>>;

fn to_py(e: Error, pending: Option<&Pending>) -> PyErr {
    match e {
        Error::InvalidArgument(m) | Error::Mismatch(m) => PyValueError::new_err(m),
        Error::Unsupported(m) => PyTypeError::new_err(m),
        // (errno, message): Python picks the OSError subclass (FileNotFoundError, ...).
        Error::Io { ref source, .. } => match source.raw_os_error() {
            Some(errno) => PyOSError::new_err((errno, e.to_string())),
            None => PyOSError::new_err(e.to_string()),
        },
        Error::Interrupted(_) => {
            pending.and_then(|p| p.lock().ok().and_then(|mut g| g.take())).unwrap_or_else(|| PyRuntimeError::new_err(e.to_string()))
        }
        Error::Timeout(m) | Error::PeerDied(m) | Error::Aborted(m) => PyRuntimeError::new_err(m),
    }
}

fn duration(name: &str, secs: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(secs)
        .map_err(|_| PyValueError::new_err(format!("{name}: expected a non-negative number of seconds, got {secs}")))
}

fn dtype(name: &str) -> PyResult<DType> {
    DType::from_name(name).map_err(|e| to_py(e, None))
}

fn reduce_op(code: u32) -> PyResult<ReduceOp> {
    ReduceOp::from_code(code).map_err(|e| to_py(e, None))
}

/// The one place where caller memory becomes a [`Buf`]: `nbytes` bytes at address `ptr`
/// (argument `name`). The core checks every count against `nbytes`; here only the range
/// itself is checked (not null when non-empty, no wrap-around).
fn host_buf(name: &str, ptr: usize, nbytes: usize) -> PyResult<Buf<'static>> {
    if nbytes > 0 && ptr == 0 {
        return Err(PyValueError::new_err(format!("{name}: null buffer address for {nbytes} bytes")));
    }
    if ptr.checked_add(nbytes).is_none_or(|end| end > isize::MAX as usize) {
        return Err(PyValueError::new_err(format!("{name}: {nbytes} bytes at {ptr:#x} wrap around the address space")));
    }
    // SAFETY: binding contract (module docs): the Python layer passes the address and byte
    // length of live, contiguous host memory (a tensor's storage) that it keeps alive and
    // leaves alone until the call returns or, for a queued call, until its `done` callback
    // has been called. The core never accesses more than `nbytes` bytes from `ptr`.
    Ok(unsafe { Buf::from_raw_parts(ptr as *mut u8, nbytes) })
}

/// [`host_buf`] for each `(ptrs[i], nbytes[i])` (arguments `name[i]`); the two lists must
/// have the same length.
fn host_bufs(name: &str, ptrs: &[usize], nbytes: &[usize]) -> PyResult<Vec<Buf<'static>>> {
    if ptrs.len() != nbytes.len() {
        return Err(PyValueError::new_err(format!("{name}: {} addresses but {} byte lengths", ptrs.len(), nbytes.len())));
    }
    ptrs.iter().zip(nbytes).enumerate().map(|(i, (&p, &b))| host_buf(&format!("{name}[{i}]"), p, b)).collect()
}

fn dtypes(names: &[String]) -> PyResult<Vec<DType>> {
    names.iter().map(|n| dtype(n)).collect()
}

/// Creates a shared-memory segment for `world_size` ranks with `slot_bytes` per chunk
/// slot in directory `dir` (group rank 0 only) and returns its path. The file is named
/// `flagos_shm-<32 random hex digits>`, mode 0600, its pages reserved.
///
/// Raises ValueError for a bad geometry, OSError (naming the path, the bytes needed and
/// the bytes free) when the directory cannot hold it.
#[pyfunction]
fn create_segment(py: Python<'_>, dir: &str, world_size: usize, slot_bytes: usize) -> PyResult<String> {
    let dir = dir.to_owned();
    py.detach(|| segment::create(Path::new(&dir), world_size, slot_bytes))
        .map(|p| p.to_string_lossy().into_owned())
        .map_err(|e| to_py(e, None))
}

/// The slot size (bytes) a new segment of `world_size` ranks in `dir` gets when none is
/// asked for: `DEFAULT_SLOT_BYTES` where the file system is large enough for it (the
/// segment at most 1/32 of its total size), else `SMALL_SLOT_BYTES` (`rust/segment.rs`).
#[pyfunction]
fn default_slot_bytes(dir: &str, world_size: usize) -> usize {
    segment::default_slot_bytes(Path::new(dir), world_size)
}

/// Whether the process `pid` has exited (gone, or a zombie); `False` for 0 and for
/// values that are not process ids. The liveness test the core applies to peers.
#[pyfunction]
fn process_exited(pid: u32) -> bool {
    crate::shm::wait::pid_dead(pid)
}

/// Size in bytes of a segment for `world_size` ranks with `slot_bytes` per chunk slot.
#[pyfunction]
fn segment_bytes(world_size: usize, slot_bytes: usize) -> PyResult<usize> {
    segment::check_geometry(world_size, slot_bytes).map_err(|e| to_py(e, None))?;
    Ok(segment::segment_bytes(world_size, slot_bytes))
}

/// One rank's handle on a group's shared-memory segment (see `rust/algorithms.rs`).
///
/// `Communicator(path, rank, world_size, timeout_s, peer_pids=None)` maps the segment at
/// `path`, checks its header, waits until all `world_size` ranks attached (at most
/// `timeout_s` seconds; `RuntimeError` at once if a rank whose process id is in
/// `peer_pids`, a list indexed by rank with 0 for unknown, exits before attaching) and
/// unlinks the file. Collectives take buffer addresses, each followed by its length in
/// bytes, and element counts; `dtype` is
/// a torch dtype name, `op` torch's `RedOpType` number, `factor` PREMUL_SUM's factor,
/// `timeout_s` overrides the communicator's timeout for one call.
#[pyclass(name = "Communicator", module = "flagos_shm._core")]
struct PyCommunicator {
    /// Closed and dropped only in the process that created it; see `Drop` (a forked
    /// child leaks one reference, so its copy is never dropped).
    inner: Arc<Progress>,
    /// The process that created the communicator. After a fork, the child has a copy of
    /// the mapping, the counters' values and the locks, but not the progress thread: any
    /// use there would pair with the parent's peers (taking the parent's place) or wait
    /// on a lock held by a thread that does not exist. Every method checks it first.
    owner_pid: u32,
    aborter: AbortHandle,
    pending: Pending,
    #[pyo3(get)]
    rank: usize,
    #[pyo3(get)]
    world_size: usize,
    #[pyo3(get)]
    slot_bytes: usize,
    #[pyo3(get)]
    segment_bytes: usize,
    /// Whether every rank can read every peer's memory (probed at attach; `FLAGOS_SHM_CMA`).
    #[pyo3(get)]
    single_copy_available: bool,
    #[pyo3(get)]
    path: String,
}

impl PyCommunicator {
    /// Whether this process created the communicator (false in a forked child).
    fn owned(&self) -> bool {
        std::process::id() == self.owner_pid
    }

    /// `RuntimeError` unless called in the process that created the communicator; checked
    /// before anything touches the segment, the counters or the progress thread's locks.
    fn check_owner(&self) -> PyResult<()> {
        if self.owned() {
            return Ok(());
        }
        Err(PyRuntimeError::new_err(format!(
            "flagos_shm: this communicator (rank {} of {}) was created by pid {}, used in pid {}: \
             a forked child must create its own process group",
            self.rank,
            self.world_size,
            self.owner_pid,
            std::process::id()
        )))
    }

    /// Runs `f` on the communicator on the calling thread with the GIL released, after
    /// every previously submitted collective has finished.
    fn run<R: Send>(
        &self,
        py: Python<'_>,
        timeout_s: Option<f64>,
        f: impl FnOnce(&mut Communicator) -> Result<R, Error> + Send,
    ) -> PyResult<R> {
        self.check_owner()?;
        let t = timeout_s.map(|s| duration("timeout_s", s)).transpose()?;
        py.detach(|| self.inner.run(|comm| with_timeout(comm, t, f))).map_err(|e| to_py(e, Some(&self.pending)))
    }

    /// Runs collective `f` inline (`done` is None: returns 0 when it has finished, raising
    /// its error) or queues it on the progress thread (`done` is a callable: returns its
    /// ticket at once, for `wait_ticket`; `done(None)` or `done(exception)` is called
    /// later, with the GIL held, on the progress thread or on a thread in `wait_ticket`).
    fn dispatch(
        &self,
        py: Python<'_>,
        timeout_s: Option<f64>,
        done: Option<Py<PyAny>>,
        f: impl FnOnce(&mut Communicator) -> Result<(), Error> + Send + 'static,
    ) -> PyResult<u64> {
        self.check_owner()?;
        let Some(callback) = done else {
            return self.run(py, timeout_s, f).map(|()| 0);
        };
        let t = timeout_s.map(|s| duration("timeout_s", s)).transpose()?;
        // A job run by `wait_ticket` on a Python thread can be interrupted by Ctrl-C: the
        // hook left Python's KeyboardInterrupt in `pending`; hand that to the callback.
        let pending = Arc::clone(&self.pending);
        Ok(self.inner.submit(
            Box::new(move |comm| with_timeout(comm, t, f)),
            Box::new(move |result| {
                Python::attach(|py| {
                    let arg = match result {
                        Ok(()) => py.None(),
                        Err(e) => to_py(e, Some(&pending)).into_value(py).into_any(),
                    };
                    if let Err(err) = callback.call1(py, (arg,)) {
                        err.write_unraisable(py, Some(callback.bind(py)));
                    }
                    drop(callback);
                })
            }),
        ))
    }
}

/// Runs `f` with the communicator's timeout set to `t` (when given) for this call only.
fn with_timeout<R>(
    comm: &mut Communicator,
    t: Option<Duration>,
    f: impl FnOnce(&mut Communicator) -> Result<R, Error>,
) -> Result<R, Error> {
    let saved = comm.timeout();
    if let Some(t) = t {
        comm.set_timeout(t);
    }
    let r = f(comm);
    comm.set_timeout(saved);
    r
}

impl Drop for PyCommunicator {
    fn drop(&mut self) {
        if !self.owned() {
            // A forked child's copy: closing (also `Progress`'s own Drop) would join a
            // thread that does not exist here and take locks a parent thread may have held
            // at the fork. Leak a reference so it is never dropped (the mapping goes away
            // when the child exits); nothing is written or unlinked.
            std::mem::forget(Arc::clone(&self.inner));
            return;
        }
        // Joining the progress thread needs the GIL released: its completion callbacks take it.
        let inner = &self.inner;
        Python::attach(|py| py.detach(|| inner.close()));
    }
}

#[pymethods]
impl PyCommunicator {
    #[new]
    #[pyo3(signature = (path, rank, world_size, timeout_s, peer_pids=None))]
    fn new(py: Python<'_>, path: &str, rank: usize, world_size: usize, timeout_s: f64, peer_pids: Option<Vec<u32>>) -> PyResult<Self> {
        let timeout = duration("timeout_s", timeout_s)?;
        let p = path.to_owned();
        let pending: Pending = Arc::new(Mutex::new(None));
        let hook_pending = Arc::clone(&pending);
        let hook = move || {
            if progress::on_progress_thread() {
                return false; // signals are handled by the thread waiting on the work
            }
            Python::attach(|py| match py.check_signals() {
                Ok(()) => false,
                Err(e) => {
                    *hook_pending.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    true
                }
            })
        };
        let mut comm = py
            .detach(|| {
                Communicator::attach_with(Path::new(&p), rank, world_size, timeout, Some(&hook), peer_pids.as_deref().unwrap_or(&[]))
            })
            .map_err(|e| to_py(e, Some(&pending)))?;
        comm.set_interrupt(Some(Box::new(hook)));
        Ok(PyCommunicator {
            aborter: comm.abort_handle(),
            slot_bytes: comm.slot_bytes(),
            segment_bytes: comm.segment_len(),
            single_copy_available: comm.single_copy_available(),
            inner: Arc::new(Progress::new(comm)),
            owner_pid: std::process::id(),
            pending,
            rank,
            world_size,
            path: path.to_owned(),
        })
    }

    /// Number of collectives issued on this communicator so far.
    #[getter]
    fn seq(&self, py: Python<'_>) -> PyResult<u64> {
        self.check_owner()?;
        Ok(py.detach(|| self.inner.run(|c| Ok(c.seq())).unwrap_or(0)))
    }

    /// Sets the default timeout of later calls, in seconds.
    fn set_timeout(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let t = duration("timeout_s", timeout_s)?;
        self.run(py, None, |c| {
            c.set_timeout(t);
            Ok(())
        })
    }

    /// Allgather message size in bytes (whole output) from which single-copy transfers are
    /// used; None when the group cannot use them or its plan never does.
    #[getter]
    fn single_copy_min_bytes(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        self.run(py, None, |c| Ok(c.single_copy_min_bytes()))
    }

    /// The plan later calls use (`rust/plan.rs`): a dict of byte thresholds keyed by
    /// `PLAN_KEYS`: `one_shot_max_bytes` (allreduce one-shot up to it) and, per collective
    /// with a single-copy path, the band `<collective>_single_copy_min_bytes` (None: never;
    /// also None when the group cannot use single-copy transfers) to below
    /// `<collective>_single_copy_max_bytes` (None: no end).
    #[getter]
    fn plan(&self, py: Python<'_>) -> PyResult<std::collections::BTreeMap<&'static str, Option<usize>>> {
        let p = self.run(py, None, |c| Ok(c.plan()))?;
        Ok(plan_dict(&p))
    }

    /// Sets the plan of later calls (after every queued call) from a dict with exactly the
    /// keys of `PLAN_KEYS`, byte thresholds as in `plan`, None meaning never. Every rank
    /// must set the same plan before its next collective, or calls they move differently
    /// raise ValueError (a mismatch) on every rank.
    ///
    /// Raises ValueError (`plan` naming the missing or unknown keys, or a key whose value
    /// is negative or does not fit the core's sizes) or TypeError (not a dict, a key that is
    /// not a str, a value that is not an int or None, naming its key); the plan in use is
    /// then unchanged.
    fn set_plan(&self, py: Python<'_>, plan: &Bound<'_, pyo3::types::PyDict>) -> PyResult<()> {
        use pyo3::types::{PyBool, PyInt};
        let mut given = std::collections::HashMap::new();
        for (k, x) in plan.iter() {
            let k: String = k.extract().map_err(|_| PyTypeError::new_err(format!("plan: key {k}: expected a str")))?;
            given.insert(k, x);
        }
        let missing: Vec<&str> = crate::plan::KEYS.iter().copied().filter(|k| !given.contains_key(*k)).collect();
        let mut unknown: Vec<&String> = given.keys().filter(|k| !crate::plan::KEYS.contains(&k.as_str())).collect();
        unknown.sort();
        if !missing.is_empty() || !unknown.is_empty() {
            return Err(PyValueError::new_err(format!(
                "plan: expected exactly the keys {:?}; missing {missing:?}, unknown {unknown:?}",
                crate::plan::KEYS
            )));
        }
        let mut v = [crate::plan::NEVER; crate::plan::KEYS.len()];
        for (slot, k) in v.iter_mut().zip(crate::plan::KEYS) {
            let x = &given[k];
            if x.is_none() {
                continue;
            }
            if !x.is_instance_of::<PyInt>() || x.is_instance_of::<PyBool>() {
                return Err(PyTypeError::new_err(format!("plan: {k}={x}: expected an int number of bytes or None")));
            }
            *slot = x
                .extract::<usize>()
                .map_err(|_| PyValueError::new_err(format!("plan: {k}={x}: expected bytes from 0 to {} or None", usize::MAX)))?;
        }
        let plan = crate::plan::Plan::from_values(v);
        self.run(py, None, move |c| {
            c.set_plan(plan);
            Ok(())
        })
    }

    /// How this rank copies into its slots: `"plain"`, `"stream"` or `"auto"`
    /// (`FLAGOS_SHM_STREAM`, read at attach, or the last `set_stream_mode`;
    /// `rust/stream.rs`).
    #[getter]
    fn stream_mode(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.run(py, None, |c| Ok(c.stream_mode().name()))
    }

    /// Sets how later calls (after every queued call) copy into this rank's slots:
    /// `"plain"`, `"stream"` or `"auto"` (which starts its timings afresh). Ranks need not
    /// agree. Raises ValueError naming `mode` for any other word.
    fn set_stream_mode(&self, py: Python<'_>, mode: &str) -> PyResult<()> {
        let m = crate::stream::Mode::from_name(mode)
            .ok_or_else(|| PyValueError::new_err(format!("mode: expected 'plain', 'stream' or 'auto', got {mode:?}")))?;
        self.run(py, None, move |c| {
            c.set_stream_mode(m);
            Ok(())
        })
    }

    /// Blocks until every rank of the group called barrier().
    #[pyo3(signature = (timeout_s=None, done=None))]
    fn barrier(&self, py: Python<'_>, timeout_s: Option<f64>, done: Option<Py<PyAny>>) -> PyResult<u64> {
        self.dispatch(py, timeout_s, done, |c| c.barrier())
    }

    /// Takes this rank's turn at the next position of the group's sequence as a rank whose
    /// arguments to `collective` were invalid, so that peers raise ValueError instead of
    /// waiting. `message` is for symmetry with the caller's own error and is not sent.
    #[pyo3(signature = (collective, message="", timeout_s=None))]
    fn fail(&self, py: Python<'_>, collective: &str, message: &str, timeout_s: Option<f64>) -> PyResult<()> {
        let _ = message;
        let kind = Kind::from_name(collective);
        self.run(py, timeout_s, |c| c.fail(kind))
    }

    /// In-place allreduce of `numel` elements in the `nbytes` bytes at address `ptr`.
    #[pyo3(signature = (ptr, nbytes, numel, dtype, op, factor=1.0, timeout_s=None, done=None))]
    #[allow(clippy::too_many_arguments)]
    fn allreduce(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        numel: usize,
        dtype: &str,
        op: u32,
        factor: f64,
        timeout_s: Option<f64>,
        done: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let (dt, op) = (self::dtype(dtype)?, reduce_op(op)?);
        let b = host_buf("ptr", ptr, nbytes)?;
        self.dispatch(py, timeout_s, done, move |c| c.allreduce(b, numel, dt, op, factor))
    }

    /// In-place broadcast of `numel` elements at `ptr` (`nbytes`) from group rank `root`.
    #[pyo3(signature = (ptr, nbytes, numel, dtype, root, timeout_s=None, done=None))]
    #[allow(clippy::too_many_arguments)]
    fn broadcast(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        numel: usize,
        dtype: &str,
        root: usize,
        timeout_s: Option<f64>,
        done: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let dt = self::dtype(dtype)?;
        let b = host_buf("ptr", ptr, nbytes)?;
        self.dispatch(py, timeout_s, done, move |c| c.broadcast(b, numel, dt, root))
    }

    /// In-place reduce of `numel` elements at `ptr` (`nbytes`) to group rank `root` (only
    /// the root's buffer is written).
    #[pyo3(signature = (ptr, nbytes, numel, dtype, op, root, factor=1.0, timeout_s=None, done=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        numel: usize,
        dtype: &str,
        op: u32,
        root: usize,
        factor: f64,
        timeout_s: Option<f64>,
        done: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let (dt, op) = (self::dtype(dtype)?, reduce_op(op)?);
        let b = host_buf("ptr", ptr, nbytes)?;
        self.dispatch(py, timeout_s, done, move |c| c.reduce(b, numel, dt, op, factor, root))
    }

    /// Allgather: `in_ptr` holds `numel` elements, `out_ptr` receives `world_size * numel`
    /// (rank r's at `[r * numel, (r + 1) * numel)`).
    #[pyo3(signature = (in_ptr, in_nbytes, out_ptr, out_nbytes, numel, dtype, timeout_s=None, done=None))]
    #[allow(clippy::too_many_arguments)]
    fn allgather(
        &self,
        py: Python<'_>,
        in_ptr: usize,
        in_nbytes: usize,
        out_ptr: usize,
        out_nbytes: usize,
        numel: usize,
        dtype: &str,
        timeout_s: Option<f64>,
        done: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let dt = self::dtype(dtype)?;
        let (i, o) = (host_buf("in_ptr", in_ptr, in_nbytes)?, host_buf("out_ptr", out_ptr, out_nbytes)?);
        self.dispatch(py, timeout_s, done, move |c| c.allgather(i, o, numel, dt))
    }

    /// Reduce-scatter: `in_ptr` holds `world_size * numel` elements, `out_ptr` receives
    /// the `numel`-element reduction of piece `rank`.
    #[pyo3(signature = (in_ptr, in_nbytes, out_ptr, out_nbytes, numel, dtype, op, factor=1.0, timeout_s=None, done=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        in_ptr: usize,
        in_nbytes: usize,
        out_ptr: usize,
        out_nbytes: usize,
        numel: usize,
        dtype: &str,
        op: u32,
        factor: f64,
        timeout_s: Option<f64>,
        done: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let (dt, op) = (self::dtype(dtype)?, reduce_op(op)?);
        let (i, o) = (host_buf("in_ptr", in_ptr, in_nbytes)?, host_buf("out_ptr", out_ptr, out_nbytes)?);
        self.dispatch(py, timeout_s, done, move |c| c.reduce_scatter(i, o, numel, dt, op, factor))
    }

    /// Gather to `root`: `in_ptr` holds `numel` elements; the root's `out_ptr` receives
    /// `world_size * numel` (non-roots pass 0, 0).
    #[pyo3(signature = (in_ptr, in_nbytes, out_ptr, out_nbytes, numel, dtype, root, timeout_s=None, done=None))]
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &self,
        py: Python<'_>,
        in_ptr: usize,
        in_nbytes: usize,
        out_ptr: usize,
        out_nbytes: usize,
        numel: usize,
        dtype: &str,
        root: usize,
        timeout_s: Option<f64>,
        done: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let dt = self::dtype(dtype)?;
        let (i, o) = (host_buf("in_ptr", in_ptr, in_nbytes)?, host_buf("out_ptr", out_ptr, out_nbytes)?);
        self.dispatch(py, timeout_s, done, move |c| c.gather(i, o, numel, dt, root))
    }

    /// Scatter from `root`: the root's `in_ptr` holds `world_size * numel` elements
    /// (non-roots pass 0, 0); `out_ptr` receives this rank's `numel`-element piece.
    #[pyo3(signature = (in_ptr, in_nbytes, out_ptr, out_nbytes, numel, dtype, root, timeout_s=None, done=None))]
    #[allow(clippy::too_many_arguments)]
    fn scatter(
        &self,
        py: Python<'_>,
        in_ptr: usize,
        in_nbytes: usize,
        out_ptr: usize,
        out_nbytes: usize,
        numel: usize,
        dtype: &str,
        root: usize,
        timeout_s: Option<f64>,
        done: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let dt = self::dtype(dtype)?;
        let (i, o) = (host_buf("in_ptr", in_ptr, in_nbytes)?, host_buf("out_ptr", out_ptr, out_nbytes)?);
        self.dispatch(py, timeout_s, done, move |c| c.scatter(i, o, numel, dt, root))
    }

    /// All-to-all: `in_ptr` and `out_ptr` hold `world_size * numel` elements each (must
    /// not overlap); input piece q goes to rank q, rank q's piece lands in output piece q.
    #[pyo3(signature = (in_ptr, in_nbytes, out_ptr, out_nbytes, numel, dtype, timeout_s=None, done=None))]
    #[allow(clippy::too_many_arguments)]
    fn alltoall(
        &self,
        py: Python<'_>,
        in_ptr: usize,
        in_nbytes: usize,
        out_ptr: usize,
        out_nbytes: usize,
        numel: usize,
        dtype: &str,
        timeout_s: Option<f64>,
        done: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let dt = self::dtype(dtype)?;
        let (i, o) = (host_buf("in_ptr", in_ptr, in_nbytes)?, host_buf("out_ptr", out_ptr, out_nbytes)?);
        self.dispatch(py, timeout_s, done, move |c| c.alltoall(i, o, numel, dt))
    }

    /// All-to-all with per-peer counts: `in_ptr` holds `sum(send_counts)` elements, piece q
    /// (`send_counts[q]`, pieces back to back) for rank q; `out_ptr` receives
    /// `sum(recv_counts)`, piece q from rank q. One collective: ValueError on every rank,
    /// before any data moves, when some rank's send count to a peer differs from that
    /// peer's receive count (naming the pair).
    #[pyo3(signature = (in_ptr, in_nbytes, out_ptr, out_nbytes, send_counts, recv_counts, dtype, timeout_s=None, done=None))]
    #[allow(clippy::too_many_arguments)]
    fn alltoallv(
        &self,
        py: Python<'_>,
        in_ptr: usize,
        in_nbytes: usize,
        out_ptr: usize,
        out_nbytes: usize,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
        dtype: &str,
        timeout_s: Option<f64>,
        done: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let dt = self::dtype(dtype)?;
        let (i, o) = (host_buf("in_ptr", in_ptr, in_nbytes)?, host_buf("out_ptr", out_ptr, out_nbytes)?);
        self.dispatch(py, timeout_s, done, move |c| c.alltoallv(i, o, &send_counts, &recv_counts, dt))
    }

    /// In-place allreduce of each buffer `ptrs[i]` (`nbytes[i]` bytes, `numels[i]`
    /// elements of `dtypes[i]`) with one op, as one synchronised batch.
    #[pyo3(signature = (ptrs, nbytes, numels, dtypes, op, factor=1.0, timeout_s=None, done=None))]
    #[allow(clippy::too_many_arguments)]
    fn allreduce_coalesced(
        &self,
        py: Python<'_>,
        ptrs: Vec<usize>,
        nbytes: Vec<usize>,
        numels: Vec<usize>,
        dtypes: Vec<String>,
        op: u32,
        factor: f64,
        timeout_s: Option<f64>,
        done: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let (dts, op) = (self::dtypes(&dtypes)?, reduce_op(op)?);
        let bufs = host_bufs("ptrs", &ptrs, &nbytes)?;
        self.dispatch(py, timeout_s, done, move |c| c.allreduce_coalesced(&bufs, &numels, &dts, op, factor))
    }

    /// Allgather of each `in_ptrs[i]` (`numels[i]` elements) into `out_ptrs[i]`
    /// (`world_size * numels[i]`), as one batch; dtypes may differ between tensors.
    #[pyo3(signature = (in_ptrs, in_nbytes, out_ptrs, out_nbytes, numels, dtypes, timeout_s=None, done=None))]
    #[allow(clippy::too_many_arguments)]
    fn allgather_coalesced(
        &self,
        py: Python<'_>,
        in_ptrs: Vec<usize>,
        in_nbytes: Vec<usize>,
        out_ptrs: Vec<usize>,
        out_nbytes: Vec<usize>,
        numels: Vec<usize>,
        dtypes: Vec<String>,
        timeout_s: Option<f64>,
        done: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let dts = self::dtypes(&dtypes)?;
        let (i, o) = (host_bufs("in_ptrs", &in_ptrs, &in_nbytes)?, host_bufs("out_ptrs", &out_ptrs, &out_nbytes)?);
        self.dispatch(py, timeout_s, done, move |c| c.allgather_coalesced(&i, &o, &numels, &dts))
    }

    /// Reduce-scatter of each `in_ptrs[i]` (`world_size * numels[i]` elements) into
    /// `out_ptrs[i]` (`numels[i]`), with one op, as one batch.
    #[pyo3(signature = (in_ptrs, in_nbytes, out_ptrs, out_nbytes, numels, dtypes, op, factor=1.0, timeout_s=None, done=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_coalesced(
        &self,
        py: Python<'_>,
        in_ptrs: Vec<usize>,
        in_nbytes: Vec<usize>,
        out_ptrs: Vec<usize>,
        out_nbytes: Vec<usize>,
        numels: Vec<usize>,
        dtypes: Vec<String>,
        op: u32,
        factor: f64,
        timeout_s: Option<f64>,
        done: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let (dts, op) = (self::dtypes(&dtypes)?, reduce_op(op)?);
        let (i, o) = (host_bufs("in_ptrs", &in_ptrs, &in_nbytes)?, host_bufs("out_ptrs", &out_ptrs, &out_nbytes)?);
        self.dispatch(py, timeout_s, done, move |c| c.reduce_scatter_coalesced(&i, &o, &numels, &dts, op, factor))
    }

    /// Blocks (GIL released) until the call that returned `ticket` has completed and its
    /// `done` callback has returned; runs still-queued calls up to it on this thread.
    /// Raises the signal handler's exception (KeyboardInterrupt for Ctrl-C) when a signal
    /// arrives while the call runs on the progress thread; the call itself goes on (the
    /// caller aborts the group to stop it).
    fn wait_ticket(&self, py: Python<'_>, ticket: u64) -> PyResult<()> {
        self.check_owner()?;
        let raised: Pending = Arc::new(Mutex::new(None));
        let stop = || {
            Python::attach(|py| match py.check_signals() {
                Ok(()) => false,
                Err(e) => {
                    *raised.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    true
                }
            })
        };
        if py.detach(|| self.inner.help_until_or(ticket, &stop)) {
            return Ok(());
        }
        let err = raised.lock().unwrap_or_else(|p| p.into_inner()).take();
        Err(err.unwrap_or_else(|| PyRuntimeError::new_err("wait_ticket: interrupted")))
    }

    /// Aborts the group: every rank's pending and later calls raise RuntimeError. Safe to
    /// call from another thread while a collective is running. Does nothing in a process
    /// other than the creator (a forked child must not abort its parent's group).
    fn abort(&self) {
        if self.owned() {
            self.aborter.abort();
        }
    }

    /// Unmaps the segment; later calls raise RuntimeError. Idempotent. With collectives
    /// still queued or running it aborts the group first: the running one raises at once
    /// and every queued one completes with RuntimeError ("the process group was shut down
    /// with this collective still queued") without running. In a
    /// process other than the creator (a forked child) it does nothing: the parent's
    /// group is not touched.
    fn close(&self, py: Python<'_>) {
        if self.owned() {
            py.detach(|| self.inner.close());
        }
    }

    /// Whether `close` was called (always true in a forked child, where it is unusable).
    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        !self.owned() || py.detach(|| self.inner.is_closed())
    }

    /// The progress thread of asynchronous calls: `(running, parked, wakeups)`: started and
    /// not yet joined by `close`; blocked with nothing to do; times it woke from that wait.
    /// An idle thread sleeps without polling, so `wakeups` stays put while nothing is
    /// submitted (tests check this instead of measuring CPU time).
    #[getter]
    fn progress_thread(&self, py: Python<'_>) -> (bool, bool, u64) {
        if !self.owned() {
            return (false, false, 0);
        }
        py.detach(|| {
            let (parked, wakeups) = self.inner.thread_parked();
            (self.inner.thread_running(), parked, wakeups)
        })
    }

    fn __repr__(&self) -> String {
        format!("Communicator(rank={}, world_size={}, slot_bytes={}, path={:?})", self.rank, self.world_size, self.slot_bytes, self.path)
    }
}

/// A plan as the Python side holds it: `PLAN_KEYS` to byte thresholds, None for
/// [`crate::plan::NEVER`] (the one-shot limit is never None).
fn plan_dict(p: &crate::plan::Plan) -> std::collections::BTreeMap<&'static str, Option<usize>> {
    let never = |v: usize| (v != crate::plan::NEVER).then_some(v);
    crate::plan::KEYS.iter().zip(p.values()).enumerate().map(|(i, (k, v))| (*k, if i == 0 { Some(v) } else { never(v) })).collect()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(create_segment, m)?)?;
    m.add_function(wrap_pyfunction!(default_slot_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(segment_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(process_exited, m)?)?;
    m.add_function(wrap_pyfunction!(staging::copy_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(reduce::reduce_into, m)?)?;
    m.add_function(wrap_pyfunction!(reduce::convert_into, m)?)?;
    m.add_class::<PyCommunicator>()?;
    m.add_class::<p2p::PyP2PChannel>()?;
    m.add("DEFAULT_SLOT_BYTES", DEFAULT_SLOT_BYTES)?;
    m.add("SMALL_SLOT_BYTES", segment::SMALL_SLOT_BYTES)?;
    m.add("ONE_SHOT_MAX_BYTES", ONE_SHOT_MAX_BYTES)?;
    m.add("CMA_MIN_BYTES", crate::algorithms::CMA_MIN_BYTES)?;
    m.add("PLAN_KEYS", crate::plan::KEYS.to_vec())?;
    m.add("PLAN_FALLBACK", plan_dict(&crate::plan::Plan::FALLBACK))?;
    m.add("SEGMENT_PREFIX", segment::NAME_PREFIX)?;
    m.add("DTYPES", DType::ALL.iter().map(|d| d.name()).collect::<Vec<_>>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
