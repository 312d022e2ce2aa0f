//! Checked entry points onto the kernels for host buffers the caller lends as [`Buf`]s:
//! [`reduce_into`] (the reduction kernels of the collectives, on buffers outside any
//! collective) and [`convert_into`] (an element type to its accumulation type and back,
//! with the kernels' own conversions). The Python binding exposes both as
//! `flagos_shm._core.reduce_into` / `convert_into`; the multi-node hierarchy combines the
//! node leaders' partial results with them on its own thread, where torch would split the
//! work over its intra-op thread pool (docs/benchmark.md, "torch's copy threads").

use super::{reduce_raw, DType, Elem, Reduction, BLOCK};
use crate::buffer::Buf;
use crate::error::{Error, Result};
use half::{bf16, f16};

/// Bytes of `numel` elements of `es` bytes; `InvalidArgument` naming `numel` on overflow.
fn span(numel: usize, es: usize) -> Result<usize> {
    numel.checked_mul(es).ok_or_else(|| Error::InvalidArgument(format!("numel: {numel} elements overflow")))
}

/// Whether the first `n` bytes of `a` and of `b` share a byte.
fn overlap(a: &Buf<'_>, b: &Buf<'_>, n: usize) -> bool {
    let (x, y) = (a.as_ptr() as usize, b.as_ptr() as usize);
    n > 0 && x < y + n && y < x + n
}

/// `dst = srcs[0] op srcs[1] op ... op srcs[k-1]` over `numel` elements of `red.dtype`,
/// combined in list order with the collectives' rules (module docs of `reduce/mod.rs`: AVG
/// divides by `red.world`, PREMUL_SUM scales every source by `red.factor`, float16 and
/// bfloat16 accumulate in float32). `dst` may be one of the sources exactly (same start)
/// and must not otherwise overlap one; sources may overlap each other.
///
/// Errors: `InvalidArgument` for no sources, `world` 0, a buffer shorter than `numel`
/// elements or not aligned to the element size (naming `dst` or `srcs[i]`), or an overlap.
pub fn reduce_into(red: &Reduction, dst: Buf<'_>, srcs: &[Buf<'_>], numel: usize) -> Result<()> {
    let es = red.dtype.size();
    if srcs.is_empty() {
        return Err(Error::InvalidArgument("srcs: need at least one source".into()));
    }
    if red.world == 0 {
        return Err(Error::InvalidArgument("world: the divisor of AVG must be at least 1".into()));
    }
    dst.check("dst", numel, es, 1, true)?;
    for (i, s) in srcs.iter().enumerate() {
        s.check(&format!("srcs[{i}]"), numel, es, 1, false)?;
    }
    let need = span(numel, es)?;
    if let Some(i) = srcs.iter().position(|s| s.as_ptr() != dst.as_ptr() && overlap(&dst, s, need)) {
        return Err(Error::InvalidArgument(format!("dst/srcs[{i}]: the ranges overlap without being the same buffer")));
    }
    if numel == 0 {
        return Ok(());
    }
    let ptrs: Vec<*const u8> = srcs.iter().map(|s| s.as_ptr()).collect();
    // SAFETY: every buffer was checked above to hold `numel` elements, aligned to the
    // element size and not null; `dst` is writable and equals a source exactly or
    // overlaps none (the contract of `reduce_raw`); `srcs` is not empty.
    unsafe { reduce_raw(red, dst.as_mut_ptr(), &ptrs, numel) };
    Ok(())
}

/// Widens `len` elements at `src` into their accumulation type at `dst`.
///
/// # Safety
/// `src` valid for `len` reads of `T`, `dst` for `len` writes of `T::Acc`, both aligned,
/// not overlapping.
#[inline(always)]
unsafe fn widen<T: Elem>(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: the caller's contract.
    let (s, d) = unsafe { (std::slice::from_raw_parts(src as *const T, len), std::slice::from_raw_parts_mut(dst as *mut T::Acc, len)) };
    for (s, d) in s.chunks(BLOCK).zip(d.chunks_mut(BLOCK)) {
        T::load_block(s, d);
    }
}

/// Narrows `len` accumulation-type elements at `src` into `T` at `dst` (the kernels'
/// final rounding or truncation).
///
/// # Safety
/// As [`widen`], with the roles of `T` and `T::Acc` swapped.
#[inline(always)]
unsafe fn narrow<T: Elem>(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: the caller's contract.
    let (s, d) = unsafe { (std::slice::from_raw_parts(src as *const T::Acc, len), std::slice::from_raw_parts_mut(dst as *mut T, len)) };
    for (s, d) in s.chunks(BLOCK).zip(d.chunks_mut(BLOCK)) {
        T::store_block(s, d);
    }
}

/// Converts `numel` elements of `from` at `src` into `to` at `dst`, between a type and the
/// type the kernels accumulate it in: float16 / bfloat16 and float32 (widening is exact;
/// narrowing rounds to nearest, ties to even, as the kernels' final step), int8 / uint8 /
/// int16 / int32 and int64 (widening is exact; narrowing keeps the low bits, two's
/// complement, as torch's conversion). The same dtype on both sides is a plain copy.
///
/// Errors: `Unsupported` for any other pair; `InvalidArgument` for a buffer shorter than
/// `numel` elements or misaligned (naming `dst` or `src`), or buffers that overlap.
pub fn convert_into(dst: Buf<'_>, to: DType, src: Buf<'_>, from: DType, numel: usize) -> Result<()> {
    dst.check("dst", numel, to.size(), 1, true)?;
    src.check("src", numel, from.size(), 1, false)?;
    let (dn, sn) = (span(numel, to.size())?, span(numel, from.size())?);
    let (d, s) = (dst.as_ptr() as usize, src.as_ptr() as usize);
    if dn > 0 && sn > 0 && d < s + sn && s < d + dn {
        return Err(Error::InvalidArgument("dst/src: the ranges overlap".into()));
    }
    use DType::*;
    let pair = matches!((from, to), (F16 | BF16, F32) | (F32, F16 | BF16) | (I8 | U8 | I16 | I32, I64) | (I64, I8 | U8 | I16 | I32));
    if from != to && !pair {
        return Err(Error::Unsupported(format!(
            "convert: {} to {} is not a conversion between a type and its accumulation type",
            from.name(),
            to.name()
        )));
    }
    if numel == 0 {
        return Ok(());
    }
    let (dp, sp) = (dst.as_mut_ptr(), src.as_ptr());
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the contract of `convert_raw` was checked above; the CPU has AVX2.
        unsafe { convert_avx2(dp, to, sp, from, numel) };
        return Ok(());
    }
    // SAFETY: the contract of `convert_raw` was checked above.
    unsafe { convert_raw(dp, to, sp, from, numel) };
    Ok(())
}

/// [`convert_raw`] compiled for AVX2 (chosen at run time, as the reduction kernels are).
///
/// # Safety
/// As [`convert_raw`]; the CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn convert_avx2(dp: *mut u8, to: DType, sp: *const u8, from: DType, numel: usize) {
    // SAFETY: forwarded; `convert_raw` is inline(always), so its loops get this
    // function's target features.
    unsafe { convert_raw(dp, to, sp, from, numel) }
}

/// The conversion of [`convert_into`] on raw pointers.
///
/// # Safety
/// `(from, to)` is the same type or one of `convert_into`'s pairs; `sp` is valid for
/// reads of `numel` elements of `from`, `dp` for writes of `numel` elements of `to`, both
/// aligned, not overlapping.
#[inline(always)]
unsafe fn convert_raw(dp: *mut u8, to: DType, sp: *const u8, from: DType, numel: usize) {
    use DType::*;
    // SAFETY: (every arm) the caller's contract; each arm's `T` / `T::Acc` are the types
    // of the source and the destination.
    unsafe {
        match (from, to) {
            (a, b) if a == b => std::ptr::copy_nonoverlapping(sp, dp, numel * a.size()),
            (F16, F32) => widen::<f16>(dp, sp, numel),
            (BF16, F32) => widen::<bf16>(dp, sp, numel),
            (F32, F16) => narrow::<f16>(dp, sp, numel),
            (F32, BF16) => narrow::<bf16>(dp, sp, numel),
            (I8, I64) => widen::<i8>(dp, sp, numel),
            (U8, I64) => widen::<u8>(dp, sp, numel),
            (I16, I64) => widen::<i16>(dp, sp, numel),
            (I32, I64) => widen::<i32>(dp, sp, numel),
            (I64, I8) => narrow::<i8>(dp, sp, numel),
            (I64, U8) => narrow::<u8>(dp, sp, numel),
            (I64, I16) => narrow::<i16>(dp, sp, numel),
            (I64, I32) => narrow::<i32>(dp, sp, numel),
            _ => unreachable!("checked by convert_into"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::ReduceOp;

    #[test]
    fn reduce_into_combines_in_order_and_checks_its_buffers() {
        let a = [1.5f32, -2.0, 3.0];
        let b = [0.25f32, 4.0, -1.0];
        let mut out = [0f32; 3];
        let red = Reduction::new(DType::F32, ReduceOp::Avg, 1.0, 2).unwrap();
        reduce_into(&red, Buf::from_elems_mut(&mut out), &[Buf::from_elems(&a), Buf::from_elems(&b)], 3).unwrap();
        assert_eq!(out, [0.875, 1.0, 1.0]);
        let e = reduce_into(&red, Buf::from_elems_mut(&mut out), &[Buf::from_elems(&a[..2])], 3).unwrap_err();
        assert!(e.to_string().contains("srcs[0]"), "{e}");
        let mut same = [1i32, 2, 3];
        let ptr = same.as_mut_ptr() as *mut u8;
        // SAFETY: `same` lives through the call and is reached only through these Bufs.
        let (d, s) = unsafe { (Buf::from_raw_parts(ptr, 12), Buf::from_raw_parts(ptr.add(4), 8)) };
        let red = Reduction::new(DType::I32, ReduceOp::Sum, 1.0, 1).unwrap();
        let e = reduce_into(&red, d, &[s], 2).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
    }

    #[test]
    fn convert_into_rounds_and_truncates_like_the_kernels() {
        let wide = [1.0f32 + f32::EPSILON, 65504.0, 1e-8];
        let mut h = [f16::ZERO; 3];
        convert_into(Buf::from_elems_mut(&mut h), DType::F16, Buf::from_elems(&wide), DType::F32, 3).unwrap();
        assert_eq!(h, [f16::from_f32(wide[0]), f16::from_f32(wide[1]), f16::from_f32(wide[2])]);
        let big = [300i64, -129, 7];
        let mut small = [0i8; 3];
        convert_into(Buf::from_elems_mut(&mut small), DType::I8, Buf::from_elems(&big), DType::I64, 3).unwrap();
        assert_eq!(small, [300i64 as i8, -129i64 as i8, 7]);
        let e = convert_into(Buf::from_elems_mut(&mut small), DType::I8, Buf::from_elems(&wide), DType::F32, 3);
        assert!(matches!(e, Err(Error::Unsupported(_))));
    }
}
