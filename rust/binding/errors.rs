//! The core's [`Error`] as a Python exception: one class per variant (module docs of the
//! parent), with the core's message unchanged, and a [`Error::Disagree`]'s fields as
//! attributes of its `ValueError` (see [`disagreement`]).

use crate::error::{Disagreement, Error};
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;
use std::sync::{Arc, Mutex};

/// Where an interrupt hook leaves the exception a signal handler raised (Ctrl-C:
/// `KeyboardInterrupt`), for the call it interrupted to raise instead of `RuntimeError`.
pub(super) type Pending = Arc<Mutex<Option<PyErr>>>;

/// `e` as a Python exception: `ValueError` for bad arguments and disagreeing ranks (with
/// fields for [`Error::Disagree`]),
/// `TypeError` for an unsupported dtype / op, `OSError` (with its errno, so Python picks
/// the subclass) for I/O, the exception in `pending` for an interrupted wait (when there is
/// one), `RuntimeError` for the rest.
pub(super) fn to_py(e: Error, pending: Option<&Pending>) -> PyErr {
    match e {
        Error::InvalidArgument(m) | Error::Mismatch(m) => PyValueError::new_err(m),
        Error::Disagree { message, on } => disagreement(message, &on),
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

/// `ValueError(message)` with what the ranks disagreed on as attributes, for a caller that
/// names the arguments of its user's call (`flagos_shm.backend.collectives.alltoall_errors`):
/// `kind` (`"counts"`: per-peer counts; `"calls"`: different calls at one position), `rank`
/// and `peer` (group ranks), `expected` and `got` (counts: what `peer` expects from `rank`
/// and what `rank` sends it, in elements; calls: the collective kind names `rank` and
/// `peer` called), and for counts `pairs` (how many pairs disagree).
fn disagreement(message: String, on: &Disagreement) -> PyErr {
    let err = PyValueError::new_err(message);
    Python::attach(|py| {
        let fields = || -> PyResult<Vec<(&str, Bound<'_, PyAny>)>> {
            Ok(match *on {
                Disagreement::Counts { rank, peer, expected, got, pairs } => vec![
                    ("kind", "counts".into_bound_py_any(py)?),
                    ("rank", rank.into_bound_py_any(py)?),
                    ("peer", peer.into_bound_py_any(py)?),
                    ("expected", expected.into_bound_py_any(py)?),
                    ("got", got.into_bound_py_any(py)?),
                    ("pairs", pairs.into_bound_py_any(py)?),
                ],
                Disagreement::Calls { rank, peer, expected, got } => vec![
                    ("kind", "calls".into_bound_py_any(py)?),
                    ("rank", rank.into_bound_py_any(py)?),
                    ("peer", peer.into_bound_py_any(py)?),
                    ("expected", expected.into_bound_py_any(py)?),
                    ("got", got.into_bound_py_any(py)?),
                ],
            })
        };
        let value = err.value(py);
        // Only memory can make this fail; the exception is still right without the fields.
        let _ = fields().and_then(|f| f.into_iter().try_for_each(|(k, v)| value.setattr(k, v)));
    });
    err
}

/// A `Result` of the core as a `PyResult` (no interrupt hook involved).
pub(super) fn py_result<T>(r: Result<T, Error>) -> PyResult<T> {
    r.map_err(|e| to_py(e, None))
}
