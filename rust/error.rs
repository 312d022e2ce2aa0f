//! Error type of the core. Each variant maps to one Python exception class in
//! `binding/errors.rs`: `InvalidArgument` and `Mismatch` to `ValueError`, `Unsupported` to
//! `TypeError`, `Io` to `OSError`, and the rest to `RuntimeError`.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    /// A caller passed a bad argument (wrong count, null buffer, bad root).
    #[error("{0}")]
    InvalidArgument(String),
    /// Ranks disagree on the collective issued at one position of the group's sequence,
    /// or a peer reported that its own arguments were invalid (`Communicator::fail`).
    #[error("{0}")]
    Mismatch(String),
    /// A dtype / reduce-op combination that is not defined (e.g. BAND on float32).
    #[error("{0}")]
    Unsupported(String),
    /// The deadline passed before every rank arrived.
    #[error("{0}")]
    Timeout(String),
    /// A peer process exited while the others waited for it.
    #[error("{0}")]
    PeerDied(String),
    /// The group was aborted (by `abort()`, or by a rank after an unrecoverable error).
    #[error("{0}")]
    Aborted(String),
    /// The caller's interrupt hook asked to stop waiting (e.g. Ctrl-C in Python).
    #[error("interrupted while waiting in {0}")]
    Interrupted(String),
    /// Creating, sizing or mapping the segment failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }
}
