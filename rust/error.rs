//! Error type of the core. Each variant maps to one Python exception class in
//! `binding/errors.rs`: `InvalidArgument`, `Mismatch` and `Disagree` to `ValueError` (with
//! `Disagree`'s fields as the exception's attributes), `Unsupported` to `TypeError`, `Io` to
//! `OSError`, and the rest to `RuntimeError`.

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
    /// A `Mismatch` whose subject a caller may name in its own terms (which argument of its
    /// user's call a count came from): `message` as `Mismatch`'s, `on` the same as fields.
    #[error("{message}")]
    Disagree { message: String, on: Disagreement },
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

/// What the ranks of a [`Error::Disagree`] disagreed on, as the message states it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Disagreement {
    /// Per-peer counts (alltoallv): rank `rank` sends `got` elements to rank `peer`, which
    /// expects `expected` from it (the first such pair; `pairs` of them in all).
    Counts { rank: usize, peer: usize, expected: u64, got: u64, pairs: usize },
    /// Different calls at one position of the group's sequence: rank `rank` called
    /// collective `expected`, rank `peer` called `got` (kind names, as `Kind::name`; equal
    /// when the calls differ in something else: count, dtype, op, root, path).
    Calls { rank: usize, peer: usize, expected: &'static str, got: &'static str },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }
}
