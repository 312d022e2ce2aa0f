//! The staging part of the binding: `flagos_shm._core.copy_bytes`, the host copy that
//! `flagos_shm.staging` uses between contiguous host buffers (see the parent module for
//! the buffer contract).

use super::convert::host_buf;
use pyo3::prelude::*;

/// Copies `nbytes` bytes from address `src` to address `dst` on the calling thread, with
/// the GIL released; the two ranges may overlap (a `memmove`).
///
/// Why not `dst.copy_(src)`: torch parallelises a CPU copy of 32768 elements or more over
/// its intra-op threads (as many as the CPUs by default). With several ranks on the
/// node, each with such a pool, the pools' threads outnumber the CPUs and a copy waits
/// for descheduled threads: on the AMD EPYC 2-vCPU VM, two `mp.spawn` ranks copying
/// 1 MiB with torch took 7.7 ms (median) against 34 us on one thread (docs/benchmark.md,
/// "torch's copy threads"). Gloo copies with `memcpy` on its calling thread too.
///
/// Raises ValueError (naming `dst` or `src`) for a null address with `nbytes > 0` or a
/// range that wraps around the address space. The caller vouches for the memory: both
/// ranges are live host memory it keeps alive and leaves alone during the call.
#[pyfunction]
pub(super) fn copy_bytes(py: Python<'_>, dst: usize, src: usize, nbytes: usize) -> PyResult<()> {
    let (d, s) = (host_buf("dst", dst, nbytes)?, host_buf("src", src, nbytes)?);
    if nbytes == 0 {
        return Ok(());
    }
    py.detach(move || {
        // SAFETY: both ranges were checked above (not null, no wrap-around) and are
        // `nbytes` long; the binding contract makes them live host memory for the call.
        // `copy` allows overlapping ranges.
        unsafe { std::ptr::copy(s.as_ptr(), d.as_mut_ptr(), nbytes) }
    });
    Ok(())
}
