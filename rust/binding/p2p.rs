//! The point-to-point part of the binding: `flagos_shm._core.P2PChannel` (see the parent
//! module for the buffer contract and the exceptions).

use super::convert::{duration, host_buf};
use super::errors::to_py;
use super::exit::detach_blocking;
use pyo3::prelude::*;
use std::path::Path;

/// One rank's end of the point-to-point channel with one peer of its group (see
/// `rust/p2p/`): a bounded shared-memory segment per pair of ranks that talk.
///
/// `P2PChannel.create(dir, slots, slot_bytes)` makes a pair segment and returns its path
/// (one side does this and publishes the path); `P2PChannel(path, side, peer_pid, peer)`
/// attaches as `side` (0: the pair's lower group rank, 1: the higher), watching process
/// `peer_pid` and naming the peer `peer` in errors; the second side to attach unlinks the
/// file. `send`/`recv`/`try_recv` take a buffer address and a byte count and release the
/// GIL while they run. Several threads may use one channel (sends and receives are
/// serialised per direction). ValueError for a size mismatch (raised on both sides),
/// RuntimeError for a timeout, a dead, closed or aborting peer.
#[pyclass(name = "P2PChannel", module = "flagos_shm._core", frozen)]
pub(super) struct PyP2PChannel {
    inner: crate::p2p::Channel,
    #[pyo3(get)]
    path: String,
}

#[pymethods]
impl PyP2PChannel {
    /// Creates a pair segment in `dir` and returns its path.
    #[staticmethod]
    #[pyo3(signature = (dir, slots=crate::p2p::DEFAULT_SLOTS, slot_bytes=crate::p2p::DEFAULT_SLOT_BYTES))]
    fn create(py: Python<'_>, dir: &str, slots: usize, slot_bytes: usize) -> PyResult<String> {
        let dir = dir.to_owned();
        py.detach(|| crate::p2p::create(Path::new(&dir), slots, slot_bytes))
            .map(|p| p.to_string_lossy().into_owned())
            .map_err(|e| to_py(e, None))
    }

    /// Bytes of one pair segment with this geometry (both directions).
    #[staticmethod]
    #[pyo3(signature = (slots=crate::p2p::DEFAULT_SLOTS, slot_bytes=crate::p2p::DEFAULT_SLOT_BYTES))]
    fn segment_bytes(slots: usize, slot_bytes: usize) -> PyResult<usize> {
        crate::p2p::check_geometry(slots, slot_bytes).map_err(|e| to_py(e, None))?;
        Ok(crate::p2p::segment_bytes(slots, slot_bytes))
    }

    /// Attaches side `side` of the pair segment at `path`; `group` and `group_rank`, when
    /// given, are the group the channel serves and the peer's rank in it: waits fail once
    /// the peer has closed that group (`Communicator.peer_left`).
    #[new]
    #[pyo3(signature = (path, side, peer_pid, peer, group=None, group_rank=0))]
    fn new(
        py: Python<'_>,
        path: &str,
        side: usize,
        peer_pid: u32,
        peer: &str,
        group: Option<PyRef<'_, super::communicator::PyCommunicator>>,
        group_rank: usize,
    ) -> PyResult<Self> {
        let (p, name) = (path.to_owned(), peer.to_owned());
        let inner = py.detach(|| crate::p2p::Channel::open(Path::new(&p), side, peer_pid, &name)).map_err(|e| to_py(e, None))?;
        if let Some(group) = group {
            let handle = group.abort_handle();
            inner.watch_peer(move || handle.peer_left(group_rank));
        }
        Ok(PyP2PChannel { inner, path: path.to_owned() })
    }

    /// Sends the `nbytes` bytes at `ptr` as one message with `tag`; returns when the
    /// peer's matching receive has taken it (acknowledged its first chunk).
    fn send(&self, py: Python<'_>, ptr: usize, nbytes: usize, tag: i64, timeout_s: f64) -> PyResult<()> {
        let buf = host_buf("ptr", ptr, nbytes)?;
        let t = duration("timeout_s", timeout_s)?;
        detach_blocking(py, move || self.inner.send(&buf, tag, t)).map_err(|e| to_py(e, None))
    }

    /// Receives the next message with `tag` (exactly `nbytes` bytes) into `ptr`.
    fn recv(&self, py: Python<'_>, ptr: usize, nbytes: usize, tag: i64, timeout_s: f64) -> PyResult<()> {
        let buf = host_buf("ptr", ptr, nbytes)?;
        let t = duration("timeout_s", timeout_s)?;
        detach_blocking(py, move || self.inner.recv(&buf, tag, t)).map_err(|e| to_py(e, None))
    }

    /// Like `recv`, but returns False at once if no message with `tag` is there yet.
    fn try_recv(&self, py: Python<'_>, ptr: usize, nbytes: usize, tag: i64, timeout_s: f64) -> PyResult<bool> {
        let buf = host_buf("ptr", ptr, nbytes)?;
        let t = duration("timeout_s", timeout_s)?;
        detach_blocking(py, move || self.inner.try_recv(&buf, tag, t)).map_err(|e| to_py(e, None))
    }

    /// Aborts the pair: both sides' waiting and later calls raise RuntimeError.
    fn abort(&self) {
        self.inner.abort();
    }

    /// Closes this side (later calls raise; the peer's waits on it raise); removes the
    /// file if the peer never attached. Idempotent.
    fn close(&self) {
        self.inner.close();
    }

    /// Whether the file name is gone (both sides attached, or closed).
    #[getter]
    fn unlinked(&self) -> bool {
        self.inner.is_unlinked()
    }

    #[getter]
    fn segment_len(&self) -> usize {
        self.inner.segment_len()
    }

    fn __repr__(&self) -> String {
        format!("P2PChannel(slots={}, slot_bytes={}, path={:?})", self.inner.slots(), self.inner.slot_bytes(), self.path)
    }
}
