//! flagos_shm: lock-free shared-memory collectives for the ranks of one node.
//!
//! Layers, one module each: [`shm`] (the shared-memory file layer and the wait type that
//! group segments and point-to-point pairs share) → [`segment`] (the group's segment and
//! its layout) →
//! `sync` (per-rank counters, waits with deadlines, every control-block access) and
//! `cma` (single-copy reads from a peer's process) → [`reduce`] (dtypes, reduce ops,
//! kernels), `desc` (collective descriptors) and `buffer` (caller buffers with their
//! lengths) → `group` (a rank's communicator: attach, probe, step plumbing; [`plan`]: the
//! thresholds that choose each call's algorithm) →
//! [`algorithms`] (the collectives' checked face and the slot algorithms) and
//! `single_copy` (the `process_vm_readv` algorithms), both copying into the slots through
//! [`stream`] (plain or streaming stores, chosen by timing the calls) → [`progress`] (a per-group thread
//! for asynchronous calls); [`p2p`] (point-to-point channels between two ranks) →
//! `binding` (PyO3, feature `python`).

// Public: what the integration tests (rust/tests/) and the benches (benches/) name by
// path, and the point-to-point channels; every other module is internal to the crate.
pub mod algorithms;
pub(crate) mod buffer;
pub(crate) mod cma;
pub(crate) mod desc;
pub(crate) mod error;
pub(crate) mod group;
pub mod p2p;
pub mod plan;
pub mod progress;
pub mod reduce;
pub mod segment;
pub mod shm;
pub(crate) mod single_copy;
pub mod stream;
pub(crate) mod sync;

#[cfg(feature = "python")]
mod binding;

pub use algorithms::{Communicator, Kind};
pub use buffer::Buf;
pub use error::{Disagreement, Error, Result};
pub use group::Settings;
pub use plan::Plan;
pub use reduce::{DType, ReduceOp, Reduction};
