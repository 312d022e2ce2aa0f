//! bfloat16 and float16 reduction kernels for x86-64: AVX2, plus F16C for float16. Chosen
//! at run time by [`reduce_raw`](super::reduce_raw) when [`available`] says the CPU has the
//! features; otherwise the generic kernels in `reduce/mod.rs` run (and always on aarch64).
//!
//! Semantics, bit for bit the same as the generic kernels (and as converting each element
//! with `half`'s `to_f32`, combining in float32 and converting back with `from_f32`; only
//! which payload survives a step that meets two NaNs is left open, as the module docs of
//! `reduce/mod.rs` say). Tested in `rust/tests/half_kernels.rs`; speed in docs/benchmark.md.
//! - Each source element is widened to float32 exactly. bfloat16: its 16 bits become the
//!   high half of the float32. float16: `VCVTPH2PS` (exact for every value, subnormals
//!   included; a NaN keeps its sign and payload and gets the quiet bit, as `f16::to_f32`).
//! - Sources are combined in rank order `0, 1, ..., n-1`, one float32 operation per step,
//!   never fused: SUM and AVG `acc + x`, PREMUL_SUM `acc + x * factor` (the first source
//!   `x * factor`), PRODUCT `acc * x`; AVG then divides by the group size. MIN and MAX
//!   propagate NaN: the accumulator if it is NaN, else `x` if it is NaN, else the smaller
//!   (larger) of the two, the accumulator on ties (so `min(+0, -0)` keeps the first).
//! - The float32 result is rounded once, to nearest with ties to even.
//!   bfloat16: `(x + 0x7fff + lsb) >> 16`, where `lsb` is bit 16 of `x`; a NaN becomes its
//!   high 16 bits with the quiet bit (0x0040) set. This is `half::bf16::from_f32` (half
//!   2.x, `bfloat/convert.rs`, `f32_to_bf16`) written without branches.
//!   float16: `VCVTPS2PH` with the rounding given in the instruction (`_MM_FROUND_TO_NEAREST_INT`,
//!   not MXCSR); overflow gives infinity, tiny values round to subnormals or zero, and a NaN
//!   keeps its sign and the top 10 payload bits with the quiet bit (0x0200) set. That is
//!   what `half::f16::from_f32` returns, which uses the same instruction where the CPU has
//!   F16C and otherwise computes the same bits in software (`f32_to_f16_fallback`).
//!
//! Each step reduces 32 elements (one 64-byte line of every source) held in registers,
//! then 16; the last `len % 16` elements go through the same vector code via zero-padded
//! copies, so the tail cannot round differently from the body.
//!
//! The helpers here are `#[inline(always)]` without target features of their own, like
//! the generic kernels: they are compiled inside [`bf16_avx2`] and [`f16_avx2_f16c`], whose
//! target features let the intrinsics inline.

use super::{DType, ReduceOp, Reduction};
use std::arch::x86_64::*;

/// Elements per unit, what a [`Format`] loads and stores at once: two float32 vectors.
const UNIT: usize = 16;
/// Units per step of the main loop: 32 elements, 64 bytes of each half-precision source.
const UNROLL: usize = 2;

/// One unit (16 elements) widened to float32, in an order of the format's choosing that
/// its `store` undoes (the ops are lane-wise, so the order does not matter in between).
type Pair = [__m256; 2];

/// Whether this CPU has a kernel here for `dtype` (bfloat16: AVX2; float16: AVX2 and F16C).
pub(super) fn available(dtype: DType) -> bool {
    match dtype {
        DType::BF16 => is_x86_feature_detected!("avx2"),
        DType::F16 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c"),
        _ => false,
    }
}

/// Reduces `srcs` (rank order, each `len` elements of `red.dtype`) into `dst`.
///
/// # Safety
/// As [`reduce_raw`](super::reduce_raw), and [`available`]`(red.dtype)` must be true.
pub(super) unsafe fn reduce(red: &Reduction, dst: *mut u8, srcs: &[*const u8], len: usize) {
    match red.dtype {
        // SAFETY: `available` checked AVX2; pointer contract forwarded.
        DType::BF16 => unsafe { bf16_avx2(red, dst.cast(), srcs, len) },
        // SAFETY: `available` checked AVX2 and F16C; pointer contract forwarded.
        DType::F16 => unsafe { f16_avx2_f16c(red, dst.cast(), srcs, len) },
        _ => unreachable!("reduce called without available()"),
    }
}

/// # Safety
/// As [`reduce`]; the CPU must support AVX2.
#[target_feature(enable = "avx2")]
unsafe fn bf16_avx2(red: &Reduction, dst: *mut u16, srcs: &[*const u8], len: usize) {
    // SAFETY: forwarded; `by_op` is inline(always), so it is compiled with AVX2.
    unsafe { by_op::<Bf16>(red, dst, srcs, len) }
}

/// # Safety
/// As [`reduce`]; the CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_avx2_f16c(red: &Reduction, dst: *mut u16, srcs: &[*const u8], len: usize) {
    // SAFETY: forwarded; `by_op` is inline(always), so it is compiled with AVX2 and F16C.
    unsafe { by_op::<F16>(red, dst, srcs, len) }
}

/// A half-precision format: 16 elements to and from two float32 vectors.
trait Format {
    /// Loads 16 elements from `p` and widens them to float32 exactly.
    ///
    /// # Safety
    /// `p` readable for 16 `u16`; the CPU has the format's features (module docs).
    unsafe fn load(p: *const u16) -> Pair;
    /// Rounds a unit from [`load`](Format::load)'s order to the format (module docs) and
    /// stores it at `p`.
    ///
    /// # Safety
    /// `p` writable for 16 `u16`; the CPU has the format's features.
    unsafe fn store(p: *mut u16, v: Pair);
}

struct Bf16;
impl Bf16 {
    /// Rounds 8 float32 lanes to bfloat16 bits, each in the high half of its 32-bit lane
    /// (the low half is left over).
    ///
    /// # Safety
    /// The CPU supports AVX2.
    #[inline(always)]
    unsafe fn round_high(v: __m256) -> __m256i {
        // SAFETY: AVX2 per the contract.
        unsafe {
            let x = _mm256_castps_si256(v);
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
            // No overflow: only NaNs have x + 0x8000 > u32::MAX, and they take `nan`.
            let rounded = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb);
            let nan = _mm256_or_si256(x, _mm256_set1_epi32(0x0040_0000));
            let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            _mm256_blendv_epi8(rounded, nan, is_nan)
        }
    }
}

impl Format for Bf16 {
    #[inline(always)]
    unsafe fn load(p: *const u16) -> Pair {
        // SAFETY: `p` readable for 32 bytes (unaligned load); AVX2 per the contract.
        // Each 32-bit lane holds two elements: the even one (low word) shifted up, and the
        // odd one (high word) with the low word cleared, are each a float32. No shuffles.
        unsafe {
            let v = _mm256_loadu_si256(p.cast());
            let even = _mm256_slli_epi32::<16>(v);
            let odd = _mm256_and_si256(v, _mm256_set1_epi32(0xffff_0000u32 as i32));
            [_mm256_castsi256_ps(even), _mm256_castsi256_ps(odd)]
        }
    }

    #[inline(always)]
    unsafe fn store(p: *mut u16, v: Pair) {
        // SAFETY: `p` writable for 32 bytes (unaligned store); AVX2 per the contract. The
        // even elements' bits go back to the low words, the odd ones' stay in the high
        // words, as `load` took them.
        unsafe {
            let even = _mm256_srli_epi32::<16>(Self::round_high(v[0]));
            let packed = _mm256_blend_epi16::<0b1010_1010>(even, Self::round_high(v[1]));
            _mm256_storeu_si256(p.cast(), packed);
        }
    }
}

struct F16;
impl Format for F16 {
    #[inline(always)]
    unsafe fn load(p: *const u16) -> Pair {
        // SAFETY: `p` readable for 32 bytes (unaligned loads); F16C per the contract.
        unsafe { [_mm256_cvtph_ps(_mm_loadu_si128(p.cast())), _mm256_cvtph_ps(_mm_loadu_si128(p.add(8).cast()))] }
    }

    #[inline(always)]
    unsafe fn store(p: *mut u16, v: Pair) {
        // SAFETY: `p` writable for 32 bytes (unaligned stores); F16C per the contract.
        // The immediate selects round-to-nearest-even regardless of MXCSR.
        unsafe {
            _mm_storeu_si128(p.cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v[0]));
            _mm_storeu_si128(p.add(8).cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v[1]));
        }
    }
}

/// Picks the per-source and final steps of `red.op` (module docs) and runs [`run`].
///
/// # Safety
/// As [`reduce`]; compiled only inside a function with the features of `F`.
#[inline(always)]
unsafe fn by_op<F: Format>(red: &Reduction, dst: *mut u16, srcs: &[*const u8], len: usize) {
    // SAFETY: the intrinsics here and in the closures below need AVX, which the calling
    // kernel enables.
    let (n, f) = unsafe { (_mm256_set1_ps(red.world as f32), _mm256_set1_ps(red.factor as f32)) };
    let id = |a: __m256| a;
    // SAFETY: as above.
    let add = |a: __m256, b: __m256| unsafe { _mm256_add_ps(a, b) };
    // SAFETY: as above.
    let mul = |a: __m256, b: __m256| unsafe { _mm256_mul_ps(a, b) };
    // SAFETY: as above.
    let avg = |a: __m256| unsafe { _mm256_div_ps(a, n) };
    // SAFETY: as above.
    let premul = |a: __m256| unsafe { _mm256_mul_ps(a, f) };
    // SAFETY: as above.
    let min = |a: __m256, b: __m256| unsafe { nan_min(a, b) };
    // SAFETY: as above.
    let max = |a: __m256, b: __m256| unsafe { nan_max(a, b) };
    // SAFETY: `run`'s contract is this function's.
    unsafe {
        match red.op {
            ReduceOp::Sum => run::<F>(dst, srcs, len, id, add, id),
            ReduceOp::Avg => run::<F>(dst, srcs, len, id, add, avg),
            ReduceOp::PremulSum => run::<F>(dst, srcs, len, premul, add, id),
            ReduceOp::Product => run::<F>(dst, srcs, len, id, mul, id),
            ReduceOp::Min => run::<F>(dst, srcs, len, id, min, id),
            ReduceOp::Max => run::<F>(dst, srcs, len, id, max, id),
            ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => unreachable!("checked by Reduction::new"),
        }
    }
}

/// NaN-propagating minimum, lane-wise, as the generic `fmin`: `a` if NaN, else `b` if NaN,
/// else `b < a ? b : a`.
///
/// # Safety
/// The CPU supports AVX.
#[inline(always)]
unsafe fn nan_min(a: __m256, b: __m256) -> __m256 {
    // SAFETY: AVX per the contract. `min_ps(b, a)` is `b < a ? b : a`, which is `a` when
    // either is NaN; the blends then put a NaN `b`, and over it a NaN `a`, in place.
    unsafe {
        let m = _mm256_min_ps(b, a);
        let m = _mm256_blendv_ps(m, b, _mm256_cmp_ps::<_CMP_UNORD_Q>(b, b));
        _mm256_blendv_ps(m, a, _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a))
    }
}

/// NaN-propagating maximum, as [`nan_min`] with `b > a ? b : a`.
///
/// # Safety
/// The CPU supports AVX.
#[inline(always)]
unsafe fn nan_max(a: __m256, b: __m256) -> __m256 {
    // SAFETY: as in `nan_min`; `max_ps(b, a)` is `b > a ? b : a`.
    unsafe {
        let m = _mm256_max_ps(b, a);
        let m = _mm256_blendv_ps(m, b, _mm256_cmp_ps::<_CMP_UNORD_Q>(b, b));
        _mm256_blendv_ps(m, a, _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a))
    }
}

/// Reduces `V` units: `fin(comb(...comb(pre(x_0), pre(x_1))..., pre(x_{n-1})))`, lane-wise,
/// where `ld(r, k)` loads unit `k` of source `r`.
#[inline(always)]
fn reduce_units<const V: usize>(
    n: usize,
    ld: impl Fn(usize, usize) -> Pair,
    pre: impl Fn(__m256) -> __m256,
    comb: impl Fn(__m256, __m256) -> __m256,
    fin: impl Fn(__m256) -> __m256,
) -> [Pair; V] {
    // Plain loops: `array::from_fn` and `array::map` were left as calls (not inlined into
    // the target-feature kernel), which made the bfloat16 kernel 3x slower.
    let first = ld(0, 0);
    let mut acc = [[pre(first[0]), pre(first[1])]; V];
    for (k, a) in acc.iter_mut().enumerate().skip(1) {
        let x = ld(0, k);
        *a = [pre(x[0]), pre(x[1])];
    }
    for r in 1..n {
        for (k, a) in acc.iter_mut().enumerate() {
            let x = ld(r, k);
            *a = [comb(a[0], pre(x[0])), comb(a[1], pre(x[1]))];
        }
    }
    for a in acc.iter_mut() {
        *a = [fin(a[0]), fin(a[1])];
    }
    acc
}

/// The element loop: 32 elements per step, then 16, then the tail through padded copies.
///
/// # Safety
/// `dst` writable and every `srcs[r]` readable for `len` `u16`; `dst` may equal a source
/// (each element is read from every source before it is written), no other overlap;
/// `srcs` not empty; the CPU has `F`'s features and this is compiled inside a function
/// that enables them.
#[inline(always)]
unsafe fn run<F: Format>(
    dst: *mut u16,
    srcs: &[*const u8],
    len: usize,
    pre: impl Fn(__m256) -> __m256 + Copy,
    comb: impl Fn(__m256, __m256) -> __m256 + Copy,
    fin: impl Fn(__m256) -> __m256 + Copy,
) {
    let n = srcs.len();
    let src = |r: usize| srcs[r].cast::<u16>();
    let mut i = 0;
    while i + UNROLL * UNIT <= len {
        // SAFETY: i + 32 <= len, so every unit read lies inside each source.
        let acc = reduce_units::<UNROLL>(n, |r, k| unsafe { F::load(src(r).add(i + k * UNIT)) }, pre, comb, fin);
        for (k, a) in acc.into_iter().enumerate() {
            // SAFETY: as above, for `dst`; all sources of these elements were read.
            unsafe { F::store(dst.add(i + k * UNIT), a) };
        }
        i += UNROLL * UNIT;
    }
    while i + UNIT <= len {
        // SAFETY: i + 16 <= len.
        let [a] = reduce_units::<1>(n, |r, _| unsafe { F::load(src(r).add(i)) }, pre, comb, fin);
        // SAFETY: as above, for `dst`.
        unsafe { F::store(dst.add(i), a) };
        i += UNIT;
    }
    let rest = len - i;
    if rest > 0 {
        let ld = |r: usize, _| {
            let mut pad = [0u16; UNIT];
            // SAFETY: `rest` < 16 elements remain in source `r` from `i`; `pad` is local.
            unsafe {
                std::ptr::copy_nonoverlapping(src(r).add(i), pad.as_mut_ptr(), rest);
                F::load(pad.as_ptr())
            }
        };
        let [a] = reduce_units::<1>(n, ld, pre, comb, fin);
        let mut out = [0u16; UNIT];
        // SAFETY: `out` is local and 16 long; then `rest` elements remain in `dst` from `i`.
        unsafe {
            F::store(out.as_mut_ptr(), a);
            std::ptr::copy_nonoverlapping(out.as_ptr(), dst.add(i), rest);
        }
    }
}
