//! The core's [`Error`] as a Python exception: one class per variant (module docs of the
//! parent), with the core's message unchanged.

use crate::error::Error;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};

/// Where an interrupt hook leaves the exception a signal handler raised (Ctrl-C:
/// `KeyboardInterrupt`), for the call it interrupted to raise instead of `RuntimeError`.
pub(super) type Pending = Arc<Mutex<Option<PyErr>>>;

/// `e` as a Python exception: `ValueError` for bad arguments and disagreeing ranks,
/// `TypeError` for an unsupported dtype / op, `OSError` (with its errno, so Python picks
/// the subclass) for I/O, the exception in `pending` for an interrupted wait (when there is
/// one), `RuntimeError` for the rest.
pub(super) fn to_py(e: Error, pending: Option<&Pending>) -> PyErr {
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

/// A `Result` of the core as a `PyResult` (no interrupt hook involved).
pub(super) fn py_result<T>(r: Result<T, Error>) -> PyResult<T> {
    r.map_err(|e| to_py(e, None))
}
