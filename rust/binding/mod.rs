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
//! Here: the module and its segment functions. `Communicator` (with the fork guard and the
//! collectives, generated from one spec each) is in `communicator.rs`, `P2PChannel`
//! (point-to-point between two ranks) in `p2p.rs`, `copy_bytes` (the host copy of
//! `flagos_shm.staging`) in `staging.rs`, `reduce_into` / `convert_into` (host reductions of
//! the multi-node hierarchy) in `reduce.rs`; the mapping of the core's errors to exceptions
//! in `errors.rs`, and of Python values to the core's types in `convert.rs`; keeping the
//! binding's threads out of an exiting interpreter (`python_exiting`) in `exit.rs`.

use crate::algorithms::{Kind, ONE_SHOT_MAX_BYTES};
use crate::reduce::{DType, ReduceOp, Reduction};
use crate::segment::{self, DEFAULT_SLOT_BYTES};
use errors::py_result;
use pyo3::prelude::*;
use pyo3::types::IntoPyDict;
use std::path::Path;

mod communicator;
mod convert;
mod errors;
mod exit;
mod p2p;
mod reduce;
mod staging;

/// Creates a shared-memory segment for `world_size` ranks with `slot_bytes` per chunk
/// slot in directory `dir` (group rank 0 only) and returns its path. The file is named
/// `flagos_shm-<32 random hex digits>`, mode 0600, its pages reserved.
///
/// Raises ValueError for a bad geometry, OSError (naming the path, the bytes needed and
/// the bytes free) when the directory cannot hold it.
#[pyfunction]
fn create_segment(py: Python<'_>, dir: &str, world_size: usize, slot_bytes: usize) -> PyResult<String> {
    let dir = dir.to_owned();
    let path = py.detach(|| segment::create(Path::new(&dir), world_size, slot_bytes));
    py_result(path).map(|p| p.to_string_lossy().into_owned())
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
    py_result(segment::check_geometry(world_size, slot_bytes))?;
    Ok(segment::segment_bytes(world_size, slot_bytes))
}

/// The core's vocabulary, for Python to derive its tables from (each a dict in code order):
/// `DTYPE_CODES` (dtype name to the code in descriptors), `REDUCE_OPS` (op name to torch's
/// `RedOpType` code), `REDUCE_OP_DTYPES` (dtype name to the codes of the ops it takes, by
/// `Reduction::new`), `CARRY_DTYPES` (dtype name to, per op code, the dtype name partial
/// results are carried in across levels: `DType::carried_in`), `KINDS` (collective kind
/// name to its descriptor code).
fn add_vocabulary(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let dtypes: Vec<(&str, u32)> = DType::ALL.iter().map(|&d| (d.name(), d as u32)).collect();
    let ops: Vec<(&str, u32)> = ReduceOp::ALL.iter().map(|&o| (o.name(), o as u32)).collect();
    let takes = |d: DType| ReduceOp::ALL.iter().filter(|&&o| Reduction::new(d, o, 1.0, 1).is_ok()).map(|&o| o as u32).collect::<Vec<_>>();
    let rules: Vec<(&str, Vec<u32>)> = DType::ALL.iter().map(|&d| (d.name(), takes(d))).collect();
    let carry = |d: DType| ReduceOp::ALL.iter().map(|&o| (o as u32, d.carried_in(o).name())).collect::<Vec<_>>();
    let carried: Vec<(&str, Vec<(u32, &str)>)> = DType::ALL.iter().map(|&d| (d.name(), carry(d))).collect();
    let carried = carried.into_iter().map(|(d, by_op)| Ok((d, by_op.into_py_dict(m.py())?))).collect::<PyResult<Vec<_>>>()?;
    let kinds: Vec<(&str, u8)> = Kind::ALL.iter().map(|&k| (k.name(), k as u8)).collect();
    m.add("DTYPE_CODES", dtypes.into_py_dict(m.py())?)?;
    m.add("REDUCE_OPS", ops.into_py_dict(m.py())?)?;
    m.add("REDUCE_OP_DTYPES", rules.into_py_dict(m.py())?)?;
    m.add("CARRY_DTYPES", carried.into_py_dict(m.py())?)?;
    m.add("KINDS", kinds.into_py_dict(m.py())?)?;
    Ok(())
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(create_segment, m)?)?;
    m.add_function(wrap_pyfunction!(default_slot_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(segment_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(process_exited, m)?)?;
    m.add_function(wrap_pyfunction!(exit::python_exiting, m)?)?;
    m.add_function(wrap_pyfunction!(exit::threads_in_calls, m)?)?;
    m.add_function(wrap_pyfunction!(exit::on_progress_thread, m)?)?;
    m.add_function(wrap_pyfunction!(communicator::accepts_early, m)?)?;
    m.add_function(wrap_pyfunction!(staging::copy_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(reduce::reduce_into, m)?)?;
    m.add_function(wrap_pyfunction!(reduce::convert_into, m)?)?;
    m.add_class::<communicator::PyCommunicator>()?;
    m.add_class::<p2p::PyP2PChannel>()?;
    m.add("DEFAULT_SLOT_BYTES", DEFAULT_SLOT_BYTES)?;
    m.add("SMALL_SLOT_BYTES", segment::SMALL_SLOT_BYTES)?;
    m.add("ONE_SHOT_MAX_BYTES", ONE_SHOT_MAX_BYTES)?;
    m.add("CMA_MIN_BYTES", crate::algorithms::CMA_MIN_BYTES)?;
    m.add("PLAN_KEYS", crate::plan::KEYS.to_vec())?;
    m.add("PLAN_FALLBACK", convert::plan_dict(&crate::plan::Plan::FALLBACK))?;
    m.add("SEGMENT_PREFIX", segment::NAME_PREFIX)?;
    m.add("DTYPES", DType::ALL.iter().map(|d| d.name()).collect::<Vec<_>>())?;
    add_vocabulary(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
