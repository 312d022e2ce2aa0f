//! flagos_shm: lock-free shared-memory collectives for the ranks of one node.
//!
//! Layers, one module each: [`segment`] (the shared-memory segment and its layout) →
//! [`sync`] (per-rank counters, waits with deadlines) and [`cma`] (single-copy reads from
//! a peer's process) → [`reduce`] (dtypes, reduce ops, kernels) and [`algorithms`] (the
//! collectives) → [`progress`] (a per-group thread for asynchronous calls) → `binding`
//! (PyO3, feature `python`).

pub mod algorithms;
pub mod cma;
pub mod error;
pub mod p2p;
pub mod progress;
pub mod reduce;
pub mod segment;
pub mod sync;

#[cfg(feature = "python")]
mod binding;

pub use algorithms::{Communicator, Kind};
pub use error::{Error, Result};
pub use reduce::{DType, ReduceOp, Reduction};
