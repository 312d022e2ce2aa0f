//! The host-reduction part of the binding: `flagos_shm._core.reduce_into` and
//! `convert_into`, the core's reduction kernels and conversions on host buffers outside
//! any collective (see the parent module for the buffer contract). The multi-node
//! hierarchy (`flagos_shm.backend.hierarchy`) combines the node leaders' partial results
//! with them on its own thread, with the GIL released, where torch's element-wise ops of
//! 32768 elements or more would run on its intra-op thread pool (docs/benchmark.md,
//! "torch's copy threads").

use super::convert::{dtype, host_buf, host_bufs, reduce_op};
use super::errors::to_py;
use crate::reduce::{self, Reduction};
use pyo3::prelude::*;

/// `dst = srcs[0] op srcs[1] op ... op srcs[k-1]`: `numel` elements of core dtype
/// `dtype` (`"float32"`, ...), reduce op code `op` (torch's `RedOpType`: SUM 0, AVG 1,
/// PRODUCT 2, MIN 3, MAX 4, BAND 5, BOR 6, BXOR 7, PREMUL_SUM 8), combined in list order
/// with the collectives' rules: AVG divides the sum by `world`, PREMUL_SUM scales every
/// source by `factor` first, float16 / bfloat16 accumulate in float32. Each address is
/// followed by its length in bytes (`srcs_nbytes[i]` for `srcs[i]`). `dst` may be one of
/// the sources exactly.
///
/// Raises ValueError (naming `dst`, `srcs[i]` or `world`) for a buffer shorter than
/// `numel` elements, misaligned, null or overlapping `dst` other than exactly, no
/// sources, or `world` 0; TypeError for an unknown dtype or an op the dtype does not take.
#[pyfunction]
#[pyo3(signature = (dst, dst_nbytes, srcs, srcs_nbytes, numel, dtype_name, op, factor=1.0, world=1))]
#[allow(clippy::too_many_arguments)]
pub(super) fn reduce_into(
    py: Python<'_>,
    dst: usize,
    dst_nbytes: usize,
    srcs: Vec<usize>,
    srcs_nbytes: Vec<usize>,
    numel: usize,
    dtype_name: &str,
    op: u32,
    factor: f64,
    world: usize,
) -> PyResult<()> {
    let (d, s) = (host_buf("dst", dst, dst_nbytes)?, host_bufs("srcs", &srcs, &srcs_nbytes)?);
    let red = Reduction::new(dtype(dtype_name)?, reduce_op(op)?, factor, world).map_err(|e| to_py(e, None))?;
    py.detach(move || reduce::reduce_into(&red, d, &s, numel)).map_err(|e| to_py(e, None))
}

/// Converts `numel` elements of core dtype `src_dtype` at `src` into `dst_dtype` at `dst`,
/// between a type and its accumulation type (float16 / bfloat16 and float32; int8, uint8,
/// int16, int32 and int64), with the kernels' rounding (to nearest, ties to even) and
/// truncation (the low bits, as torch); the same dtype is a copy.
///
/// Raises ValueError (naming `dst` or `src`) for a short, misaligned, null or overlapping
/// buffer; TypeError for an unknown dtype or any other pair.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn convert_into(
    py: Python<'_>,
    dst: usize,
    dst_nbytes: usize,
    dst_dtype: &str,
    src: usize,
    src_nbytes: usize,
    src_dtype: &str,
    numel: usize,
) -> PyResult<()> {
    let (d, s) = (host_buf("dst", dst, dst_nbytes)?, host_buf("src", src, src_nbytes)?);
    let (to, from) = (dtype(dst_dtype)?, dtype(src_dtype)?);
    py.detach(move || reduce::convert_into(d, to, s, from, numel)).map_err(|e| to_py(e, None))
}
