//! Python values to the core's types and back: seconds to [`Duration`], dtype names,
//! reduce-op codes, buffer addresses to [`Buf`], plans to and from dicts, stream modes.
//! Every failure is a `ValueError` / `TypeError` naming the argument.

use super::errors::py_result;
use crate::buffer::Buf;
use crate::plan::{Plan, KEYS, NEVER};
use crate::reduce::{DType, ReduceOp};
use crate::stream::Mode;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// The longest timeout the core is given (about 31 years): a deadline further out, which a
/// `Duration` holds, would overflow an `Instant` (a panic, seen with `timeout_s=1e19`).
const LONGEST_TIMEOUT: Duration = Duration::from_secs(1_000_000_000);

/// `secs` (argument `name`) as a duration, at most [`LONGEST_TIMEOUT`]; ValueError for a
/// negative, NaN or infinite value, or one beyond a `Duration` (over 2**64 seconds).
pub(super) fn duration(name: &str, secs: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(secs)
        .map(|d| d.min(LONGEST_TIMEOUT))
        .map_err(|_| PyValueError::new_err(format!("{name}: expected a non-negative number of seconds, got {secs}")))
}

/// An optional per-call timeout (argument `timeout_s`).
pub(super) fn timeout(secs: Option<f64>) -> PyResult<Option<Duration>> {
    secs.map(|s| duration("timeout_s", s)).transpose()
}

/// The core dtype named `name` (TypeError otherwise, from the core).
pub(super) fn dtype(name: &str) -> PyResult<DType> {
    py_result(DType::from_name(name))
}

/// [`dtype`] of each name.
pub(super) fn dtypes(names: &[String]) -> PyResult<Vec<DType>> {
    names.iter().map(|n| dtype(n)).collect()
}

/// The reduce op with torch's `RedOpType` code `code` (TypeError otherwise, from the core).
pub(super) fn reduce_op(code: u32) -> PyResult<ReduceOp> {
    py_result(ReduceOp::from_code(code))
}

/// The one place where caller memory becomes a [`Buf`]: `nbytes` bytes at address `ptr`
/// (argument `name`). The core checks every count against `nbytes`; here only the range
/// itself is checked (not null when non-empty, no wrap-around).
pub(super) fn host_buf(name: &str, ptr: usize, nbytes: usize) -> PyResult<Buf<'static>> {
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
pub(super) fn host_bufs(name: &str, ptrs: &[usize], nbytes: &[usize]) -> PyResult<Vec<Buf<'static>>> {
    if ptrs.len() != nbytes.len() {
        return Err(PyValueError::new_err(format!("{name}: {} addresses but {} byte lengths", ptrs.len(), nbytes.len())));
    }
    ptrs.iter().zip(nbytes).enumerate().map(|(i, (&p, &b))| host_buf(&format!("{name}[{i}]"), p, b)).collect()
}

/// The input and output buffers of a collective (arguments `in_ptr`, `out_ptr`).
pub(super) fn in_out(in_ptr: usize, in_nbytes: usize, out_ptr: usize, out_nbytes: usize) -> PyResult<(Buf<'static>, Buf<'static>)> {
    Ok((host_buf("in_ptr", in_ptr, in_nbytes)?, host_buf("out_ptr", out_ptr, out_nbytes)?))
}

/// A coalesced collective's input and output buffer lists (arguments `in_ptrs`, `out_ptrs`).
pub(super) type BufLists = (Vec<Buf<'static>>, Vec<Buf<'static>>);

/// [`in_out`] of lists.
pub(super) fn in_outs(in_ptrs: &[usize], in_nbytes: &[usize], out_ptrs: &[usize], out_nbytes: &[usize]) -> PyResult<BufLists> {
    Ok((host_bufs("in_ptrs", in_ptrs, in_nbytes)?, host_bufs("out_ptrs", out_ptrs, out_nbytes)?))
}

/// The stream mode named `mode` (`"plain"`, `"stream"` or `"auto"`; ValueError naming
/// argument `arg` otherwise).
pub(super) fn stream_mode(arg: &str, mode: &str) -> PyResult<Mode> {
    Mode::from_name(mode).ok_or_else(|| PyValueError::new_err(format!("{arg}: expected 'plain', 'stream' or 'auto', got {mode:?}")))
}

/// A plan as the Python side holds it: `PLAN_KEYS` to byte thresholds, None for
/// [`NEVER`] (the one-shot limit is never None).
pub(super) fn plan_dict(p: &Plan) -> BTreeMap<&'static str, Option<usize>> {
    let never = |v: usize| (v != NEVER).then_some(v);
    KEYS.iter().zip(p.values()).enumerate().map(|(i, (k, v))| (*k, if i == 0 { Some(v) } else { never(v) })).collect()
}

/// The plan of a dict with exactly the keys of `PLAN_KEYS` (argument `plan`), None
/// meaning never. ValueError naming the missing or unknown keys, or a key whose value is
/// negative or does not fit the core's sizes; TypeError for a key that is not a str or a
/// value that is not an int or None, naming its key.
pub(super) fn plan_from_dict(plan: &Bound<'_, PyDict>) -> PyResult<Plan> {
    let mut given = HashMap::new();
    for (k, x) in plan.iter() {
        let k: String = k.extract().map_err(|_| PyTypeError::new_err(format!("plan: key {k}: expected a str")))?;
        given.insert(k, x);
    }
    let missing: Vec<&str> = KEYS.iter().copied().filter(|k| !given.contains_key(*k)).collect();
    let mut unknown: Vec<&String> = given.keys().filter(|k| !KEYS.contains(&k.as_str())).collect();
    unknown.sort();
    if !missing.is_empty() || !unknown.is_empty() {
        return Err(PyValueError::new_err(format!("plan: expected exactly the keys {KEYS:?}; missing {missing:?}, unknown {unknown:?}")));
    }
    let mut v = [NEVER; KEYS.len()];
    for (slot, k) in v.iter_mut().zip(KEYS) {
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
    Ok(Plan::from_values(v))
}
