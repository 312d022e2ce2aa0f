//! [`Buf`]: a caller's buffer as the core sees it, a start address and a length in bytes.
//!
//! Every public collective of [`crate::Communicator`] takes its buffers as `Buf`s and
//! checks, in Rust, that each is long enough for what the call moves (element count x
//! element size, times the group size where the call moves one piece per rank) before it
//! touches anything: a wrong count is an `InvalidArgument` error naming the argument, not
//! an out-of-bounds write. The `unsafe` code below this type (segment, sync, single-copy
//! transfers, reduction kernels) may then rely on the lengths it is given.
//!
//! A `Buf` is made safely from a slice ([`Buf::from_slice`] for a buffer only read,
//! [`Buf::from_mut_slice`] for one that may be written), or, in exactly one place, the
//! Python binding, from an address and a length ([`Buf::from_raw_parts`]), where the
//! Python layer vouches for the memory.

use crate::error::{Error, Result};
use std::marker::PhantomData;

/// Element types whose every bit pattern is a valid value and that have no padding, so
/// a collective may write any bytes into a slice of them. Sealed: implemented for the
/// primitive numbers and the half types only.
pub trait Plain: Copy + sealed::Sealed {}

mod sealed {
    pub trait Sealed {}
}

macro_rules! plain {
    ($($t:ty),*) => { $(impl sealed::Sealed for $t {} impl Plain for $t {})* };
}
plain!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64, half::f16, half::bf16);

/// A byte range of caller memory lent to one collective. See the module docs.
#[derive(Clone, Copy, Debug)]
pub struct Buf<'a> {
    ptr: *mut u8,
    len: usize,
    writable: bool,
    _borrow: PhantomData<&'a mut [u8]>,
}

// SAFETY: a `Buf` is a borrow of plain bytes (like `&mut [u8]`, which is Send); the
// collectives that use it serialise all access through `&mut Communicator`.
unsafe impl Send for Buf<'_> {}

impl Buf<'static> {
    /// A zero-length buffer (e.g. the unused output of a non-root gather).
    pub fn empty() -> Buf<'static> {
        Buf { ptr: std::ptr::null_mut(), len: 0, writable: true, _borrow: PhantomData }
    }
}

impl<'a> Buf<'a> {
    /// A buffer the collective may only read (an input).
    pub fn from_slice(s: &'a [u8]) -> Buf<'a> {
        Buf { ptr: s.as_ptr() as *mut u8, len: s.len(), writable: false, _borrow: PhantomData }
    }

    /// A buffer the collective may read and write.
    pub fn from_mut_slice(s: &'a mut [u8]) -> Buf<'a> {
        Buf { ptr: s.as_mut_ptr(), len: s.len(), writable: true, _borrow: PhantomData }
    }

    /// A read-only buffer over the bytes of a slice of plain numbers.
    pub fn from_elems<T: Plain>(s: &'a [T]) -> Buf<'a> {
        Buf { ptr: s.as_ptr() as *mut u8, len: std::mem::size_of_val(s), writable: false, _borrow: PhantomData }
    }

    /// A writable buffer over the bytes of a slice of plain numbers.
    pub fn from_elems_mut<T: Plain>(s: &'a mut [T]) -> Buf<'a> {
        Buf { ptr: s.as_mut_ptr().cast(), len: std::mem::size_of_val(s), writable: true, _borrow: PhantomData }
    }

    /// A writable buffer of `len` bytes at `ptr`.
    ///
    /// # Safety
    /// Unless `len` is 0, `ptr` must be valid for reads and writes of `len` bytes for as
    /// long as the returned `Buf` (or a copy of it) is used, and nothing else may access
    /// those bytes while a collective given this `Buf` runs, except other `Buf`s of the
    /// same call where the collective's docs allow it (in-place allgather).
    pub unsafe fn from_raw_parts(ptr: *mut u8, len: usize) -> Buf<'a> {
        Buf { ptr, len, writable: true, _borrow: PhantomData }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the collective may write it.
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// The start address for writing; only valid on a buffer that passed
    /// [`Self::check`] with `write = true`.
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        debug_assert!(self.writable);
        self.ptr
    }

    /// Checks that the buffer can hold `pieces * count` elements of `es` bytes (and is
    /// writable if `write`, aligned to `es` and not null when non-empty).
    ///
    /// Errors: `InvalidArgument` naming the argument `name` and the bytes needed.
    pub(crate) fn check(&self, name: &str, count: usize, es: usize, pieces: usize, write: bool) -> Result<()> {
        let need = count.checked_mul(es).and_then(|b| b.checked_mul(pieces)).ok_or_else(|| {
            Error::InvalidArgument(format!("{name}: {pieces} x {count} elements of {es} bytes overflow the address space"))
        })?;
        if self.len < need {
            let per = if pieces > 1 { format!(" x {pieces} ranks") } else { String::new() };
            return Err(Error::InvalidArgument(format!(
                "{name}: buffer of {} bytes is too small for {count} elements of {es} bytes{per} ({need} bytes)",
                self.len
            )));
        }
        if need > 0 && self.ptr.is_null() {
            return Err(Error::InvalidArgument(format!("{name}: null buffer address for {need} bytes")));
        }
        if need > 0 && (self.ptr as usize) % es != 0 {
            return Err(Error::InvalidArgument(format!(
                "{name}: address {:#x} is not aligned to the element size {es}",
                self.ptr as usize
            )));
        }
        if need > 0 && write && !self.writable {
            return Err(Error::InvalidArgument(format!("{name}: the collective writes this buffer but it is read-only")));
        }
        Ok(())
    }
}

/// Checks that the first `in_bytes` of `input` and the first `out_bytes` of `output` share
/// no byte, except where `input` starts exactly `in_place` bytes into `output` (an
/// allgather's input that is this rank's piece of its output). The collectives copy with
/// `copy_nonoverlapping`, so any other overlap would be undefined behaviour, not just a
/// wrong result. Call after both buffers passed [`Buf::check`] for these lengths.
///
/// Errors: `InvalidArgument` naming `out_ptr` and the collective `what`.
pub(crate) fn check_disjoint(
    what: &str,
    input: &Buf<'_>,
    in_bytes: usize,
    output: &Buf<'_>,
    out_bytes: usize,
    in_place: Option<usize>,
) -> Result<()> {
    let (i, o) = (input.ptr as usize, output.ptr as usize);
    if in_bytes == 0 || out_bytes == 0 || i >= o + out_bytes || o >= i + in_bytes {
        return Ok(());
    }
    if in_place.is_some_and(|at| i == o + at && at + in_bytes <= out_bytes) {
        return Ok(());
    }
    let allowed = if in_place.is_some() { " other than as this rank's piece of it" } else { "" };
    Err(Error::InvalidArgument(format!("out_ptr: the output of {what} overlaps its input{allowed}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_names_the_argument_and_the_bytes_needed() {
        let mut v = [0u64; 4];
        // SAFETY: u64 has no padding; the byte view covers exactly `v`.
        let bytes = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), 32) };
        let b = Buf::from_mut_slice(bytes);
        assert!(b.check("nbytes", 8, 4, 1, true).is_ok());
        let e = b.check("out_nbytes", 8, 4, 2, true).unwrap_err().to_string();
        assert!(e.starts_with("out_nbytes:") && e.contains("32 bytes") && e.contains("64 bytes"), "{e}");
        assert!(b.check("x", usize::MAX, 8, 2, true).is_err());
        assert!(Buf::empty().check("in_nbytes", 0, 4, 3, true).is_ok());
        assert!(Buf::empty().check("in_nbytes", 1, 4, 1, false).unwrap_err().to_string().starts_with("in_nbytes:"));
    }

    #[test]
    fn read_only_buffers_refuse_writes() {
        let v = [0u8; 8];
        let b = Buf::from_slice(&v);
        assert!(b.check("in_nbytes", 8, 1, 1, false).is_ok());
        assert!(b.check("nbytes", 8, 1, 1, true).unwrap_err().to_string().contains("read-only"));
    }
}
