//! Element types, reduce operations and the reduction kernels.
//!
//! Semantics (shared by every collective that reduces):
//! - Sources are combined in rank order `0, 1, ..., n-1`; every rank that computes an
//!   element computes it the same way, so results are bitwise identical on every rank.
//! - `float16` and `bfloat16` accumulate in `float32` and round once at the end
//!   (round-to-nearest-even, as `half`'s `from_f32`; on x86-64 with AVX2 the kernels of
//!   `half_x86` do this with the same bits as the generic ones).
//! - When a float step meets two NaNs, which one's payload the result carries is left
//!   open (by IEEE 754 and by the compiler, which may swap the operands of `+` and `*`);
//!   the result is a NaN either way, and the same on every rank of a node.
//! - Integer SUM and PRODUCT wrap around in the tensor's own type (two's complement), as
//!   NCCL and Gloo do. Integers accumulate in `i64`: wrapping `i64` arithmetic truncated to
//!   the element type gives the same bits as wrapping arithmetic in that type.
//! - AVG divides by the group size `n`. Floats: `sum / n` in the accumulation type.
//!   Integers: the sum is computed in `i64` (exact for every type but `int64`, which wraps)
//!   and divided by `n` rounding toward zero (C / NCCL integer division).
//! - PREMUL_SUM (floats only): `sum_r(factor * x_r)`, the factor converted to the
//!   accumulation type.
//! - MIN and MAX on floats propagate NaN, like `torch.minimum` / `torch.maximum`.
//! - BAND, BOR, BXOR: integer and bool types only. On bool, SUM and MAX are logical or,
//!   PRODUCT and MIN logical and; AVG and PREMUL_SUM are not defined.

use crate::error::{Error, Result};
use half::{bf16, f16};

/// The bfloat16 / float16 kernels for x86-64 (AVX2, F16C), used where the CPU has them.
#[cfg(target_arch = "x86_64")]
mod half_x86;
/// Checked reductions and conversions on host buffers outside the collectives.
mod host;
pub use host::{convert_into, reduce_into};

/// Element type of a buffer. Discriminants are the wire codes used in descriptors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum DType {
    F32 = 1,
    F64 = 2,
    F16 = 3,
    BF16 = 4,
    I8 = 5,
    U8 = 6,
    I16 = 7,
    I32 = 8,
    I64 = 9,
    Bool = 10,
}

impl DType {
    pub const ALL: [DType; 10] =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I8, DType::U8, DType::I16, DType::I32, DType::I64, DType::Bool];

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// The torch name of the type (`"float32"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::Bool => "bool",
        }
    }

    /// Parses a torch dtype name; `Unsupported` names the accepted ones otherwise.
    pub fn from_name(name: &str) -> Result<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name).ok_or_else(|| {
            let names: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
            Error::Unsupported(format!("dtype {name:?} is not supported; expected one of {names:?}"))
        })
    }

    /// The dtype in which partial results of `op` over this type are carried when a
    /// reduction is split into levels (within each node, then across nodes), so that the
    /// split gives what one level gives: `float16`/`bfloat16` in `float32` (rounded once at
    /// the end, as the kernels do), integer AVG in `int64` (the exact sum, divided once);
    /// every other pair in the type itself (integer sums wrap alike at every width).
    pub fn carried_in(self, op: ReduceOp) -> DType {
        match (self, op) {
            (DType::F16 | DType::BF16, _) => DType::F32,
            (DType::I8 | DType::U8 | DType::I16 | DType::I32, ReduceOp::Avg) => DType::I64,
            _ => self,
        }
    }

    pub fn from_code(code: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| *d as u32 == code)
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
}

/// Reduce operation; discriminants follow torch's `ReduceOp.RedOpType`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum ReduceOp {
    Sum = 0,
    Avg = 1,
    Product = 2,
    Min = 3,
    Max = 4,
    Band = 5,
    Bor = 6,
    Bxor = 7,
    PremulSum = 8,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 9] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Band,
        ReduceOp::Bor,
        ReduceOp::Bxor,
        ReduceOp::PremulSum,
    ];

    pub fn from_code(code: u32) -> Result<ReduceOp> {
        ReduceOp::ALL
            .into_iter()
            .find(|o| *o as u32 == code)
            .ok_or_else(|| Error::InvalidArgument(format!("op: unknown reduce op code {code}; expected 0..=8 (torch RedOpType)")))
    }

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "SUM",
            ReduceOp::Avg => "AVG",
            ReduceOp::Product => "PRODUCT",
            ReduceOp::Min => "MIN",
            ReduceOp::Max => "MAX",
            ReduceOp::Band => "BAND",
            ReduceOp::Bor => "BOR",
            ReduceOp::Bxor => "BXOR",
            ReduceOp::PremulSum => "PREMUL_SUM",
        }
    }
}

/// A reduce op with its parameters, checked against a dtype.
#[derive(Clone, Copy, Debug)]
pub struct Reduction {
    pub dtype: DType,
    pub op: ReduceOp,
    /// PREMUL_SUM's factor; 1.0 otherwise.
    pub factor: f64,
    /// Group size `n`, the divisor of AVG.
    pub world: usize,
}

impl Reduction {
    /// Checks that `op` is defined on `dtype` (module docs); `Unsupported` otherwise.
    pub fn new(dtype: DType, op: ReduceOp, factor: f64, world: usize) -> Result<Reduction> {
        let bitwise = matches!(op, ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor);
        let ok = match dtype {
            DType::Bool => !matches!(op, ReduceOp::Avg | ReduceOp::PremulSum),
            d if d.is_float() => !bitwise,
            _ => op != ReduceOp::PremulSum,
        };
        if !ok {
            return Err(Error::Unsupported(format!(
                "reduce op {} is not defined for dtype {} (bitwise ops need integer or bool tensors, \
                 PREMUL_SUM needs floating point, AVG is not defined for bool)",
                op.name(),
                dtype.name()
            )));
        }
        Ok(Reduction { dtype, op, factor: if op == ReduceOp::PremulSum { factor } else { 1.0 }, world })
    }
}

/// Elements are reduced in blocks of this many so the accumulator stays in L1.
const BLOCK: usize = 256;

/// How an element type is loaded into and stored from its accumulation type, one block
/// at a time (so conversions can use the slice routines of `half` and otherwise plain
/// loops the compiler vectorises). On x86-64 with AVX2 (and F16C for float16) the half
/// types take the explicit kernels of `half_x86` instead; these are the fallback.
trait Elem: Copy {
    type Acc: Copy + Default;
    fn load_block(src: &[Self], acc: &mut [Self::Acc]);
    fn store_block(acc: &[Self::Acc], dst: &mut [Self]);
}

macro_rules! elem_same {
    ($t:ty) => {
        impl Elem for $t {
            type Acc = $t;
            #[inline(always)]
            fn load_block(src: &[$t], acc: &mut [$t]) {
                acc.copy_from_slice(src);
            }
            #[inline(always)]
            fn store_block(acc: &[$t], dst: &mut [$t]) {
                dst.copy_from_slice(acc);
            }
        }
    };
}
elem_same!(f32);
elem_same!(f64);

impl Elem for f16 {
    type Acc = f32;
    #[inline(always)]
    fn load_block(src: &[f16], acc: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(acc);
    }
    #[inline(always)]
    fn store_block(acc: &[f32], dst: &mut [f16]) {
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(acc);
    }
}

impl Elem for bf16 {
    type Acc = f32;
    #[inline(always)]
    fn load_block(src: &[bf16], acc: &mut [f32]) {
        for (a, s) in acc.iter_mut().zip(src) {
            *a = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
    #[inline(always)]
    fn store_block(acc: &[f32], dst: &mut [bf16]) {
        // Round to nearest, ties to even; NaN stays a (quiet) NaN. Same results as
        // `bf16::from_f32`, written branch-free so the loop vectorises.
        for (d, a) in dst.iter_mut().zip(acc) {
            let x = a.to_bits();
            let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
            let nan = ((x >> 16) as u16) | 0x40;
            *d = bf16::from_bits(if a.is_nan() { nan } else { rounded });
        }
    }
}

macro_rules! elem_int {
    ($t:ty) => {
        impl Elem for $t {
            type Acc = i64;
            #[inline(always)]
            fn load_block(src: &[$t], acc: &mut [i64]) {
                for (a, s) in acc.iter_mut().zip(src) {
                    *a = *s as i64;
                }
            }
            #[inline(always)]
            fn store_block(acc: &[i64], dst: &mut [$t]) {
                for (d, a) in dst.iter_mut().zip(acc) {
                    *d = *a as $t;
                }
            }
        }
    };
}
elem_int!(i8);
elem_int!(u8);
elem_int!(i16);
elem_int!(i32);
elem_int!(i64);

/// torch's bool: one byte holding 0 or 1. Any non-zero byte reads as true.
#[derive(Clone, Copy)]
#[repr(transparent)]
struct Bool8(u8);
impl Elem for Bool8 {
    type Acc = u8;
    #[inline(always)]
    fn load_block(src: &[Bool8], acc: &mut [u8]) {
        for (a, s) in acc.iter_mut().zip(src) {
            *a = (s.0 != 0) as u8;
        }
    }
    #[inline(always)]
    fn store_block(acc: &[u8], dst: &mut [Bool8]) {
        for (d, a) in dst.iter_mut().zip(acc) {
            *d = Bool8(*a);
        }
    }
}

/// Reduces `srcs[0..n]` (each `len` elements) into `dst` in rank order:
/// `dst[i] = fin(comb(...comb(pre(srcs[0][i]), pre(srcs[1][i]))...))`.
///
/// # Safety
/// `dst` must be valid for `len` writes and each `srcs[r]` for `len` reads of `T`, all
/// aligned for `T`; `dst` may equal any source exactly (each block of every source is
/// read before that block of `dst` is written) but must not otherwise overlap a source.
#[inline(always)]
unsafe fn reduce_with<T: Elem>(
    dst: *mut T,
    srcs: &[*const T],
    len: usize,
    pre: impl Fn(T::Acc) -> T::Acc,
    comb: impl Fn(T::Acc, T::Acc) -> T::Acc,
    fin: impl Fn(T::Acc) -> T::Acc,
) {
    let mut acc = [T::Acc::default(); BLOCK];
    let mut tmp = [T::Acc::default(); BLOCK];
    let mut start = 0;
    while start < len {
        let b = BLOCK.min(len - start);
        let (acc, tmp) = (&mut acc[..b], &mut tmp[..b]);
        // SAFETY: the caller guarantees `len` readable elements per source and `len`
        // writable elements at `dst`; `start + b <= len`.
        T::load_block(unsafe { std::slice::from_raw_parts(srcs[0].add(start), b) }, acc);
        for a in acc.iter_mut() {
            *a = pre(*a);
        }
        for src in &srcs[1..] {
            // SAFETY: as above.
            T::load_block(unsafe { std::slice::from_raw_parts(src.add(start), b) }, tmp);
            for (a, t) in acc.iter_mut().zip(tmp.iter()) {
                *a = comb(*a, pre(*t));
            }
        }
        for a in acc.iter_mut() {
            *a = fin(*a);
        }
        // SAFETY: as above; sources were fully read into `acc` before this write, so an
        // aliasing `dst == srcs[0]` is fine.
        T::store_block(acc, unsafe { std::slice::from_raw_parts_mut(dst.add(start), b) });
        start += b;
    }
}

/// [`reduce_with`] for types that accumulate in themselves (float32, float64) and ops
/// without a pre- or post-step (SUM, PRODUCT, MIN, MAX): combines straight into `dst`,
/// one pass per source, with no conversion buffers. Same results as `reduce_with`.
///
/// Each pass runs on slices ([`combine`]). Over raw pointers the compiler vectorized the
/// loop behind a run-time overlap check, which an in-place call (`dst` equal to `srcs[0]`
/// or `srcs[1]`, as the single-copy reductions make it) fails, so the loop ran one element
/// at a time: on the Intel Xeon 2-vCPU VM (Sapphire Rapids class, 2026-12-05) the
/// single-copy allreduce's in-place reduction of a 32 MiB float32 slice took 7.7 ms (SUM;
/// MAX 11.4), about 1 ns per element, and the whole 64 MiB allreduce 11.9 ms against 8.2
/// on slices.
///
/// # Safety
/// As [`reduce_with`]; `dst` may equal `srcs[0]` or `srcs[1]` exactly (the first pass
/// reads both before it writes an element), not a later source, which the later passes
/// read after the first has overwritten it.
#[inline(always)]
unsafe fn reduce_direct<T: Copy>(dst: *mut T, srcs: &[*const T], len: usize, comb: impl Fn(T, T) -> T) {
    let mut start = 0;
    while start < len {
        let b = BLOCK.min(len - start);
        // SAFETY: start < len, so both offsets stay inside the caller's buffers.
        let (d, s0) = unsafe { (dst.add(start), srcs[0].add(start)) };
        if srcs.len() == 1 {
            if std::ptr::eq(s0, d) {
                return; // one source, and it is the destination: every element is already there
            }
            // SAFETY: b elements in bounds; `copy` tolerates d == s0.
            unsafe { std::ptr::copy(s0, d, b) };
        } else {
            // SAFETY: as for `s0`; b elements of each lie inside the caller's buffers.
            unsafe { combine(d, s0, srcs[1].add(start), b, &comb) };
            for src in &srcs[2..] {
                // SAFETY: as above; `src` is not `dst` (the contract), and `combine` reads
                // element i of `d` before writing it.
                unsafe { combine(d, d, src.add(start), b, &comb) };
            }
        }
        start += b;
    }
}

/// `d[i] = comb(a[i], b[i])` for `i < len`, on slices, so the loop is vectorized without a
/// run-time overlap check.
///
/// # Safety
/// `a` and `b` readable and `d` writable for `len` elements; each of `a` and `b` is `d`
/// itself or does not overlap it ([`reduce_raw`]'s contract).
#[inline(always)]
unsafe fn combine<T: Copy>(d: *mut T, a: *const T, b: *const T, len: usize, comb: &impl Fn(T, T) -> T) {
    let same = |p: *const T| std::ptr::eq(p, d);
    // SAFETY: (each arm) every slice covers `len` elements of the caller's buffers; a
    // source equal to `d` is read through the `&mut` slice only, and the others do not
    // overlap it (the contract), so no shared slice aliases the `&mut` one.
    unsafe {
        let d = std::slice::from_raw_parts_mut(d, len);
        match (same(a), same(b)) {
            (true, true) => d.iter_mut().for_each(|x| *x = comb(*x, *x)),
            (true, false) => d.iter_mut().zip(std::slice::from_raw_parts(b, len)).for_each(|(x, y)| *x = comb(*x, *y)),
            (false, true) => d.iter_mut().zip(std::slice::from_raw_parts(a, len)).for_each(|(x, y)| *x = comb(*y, *x)),
            (false, false) => {
                let (a, b) = (std::slice::from_raw_parts(a, len), std::slice::from_raw_parts(b, len));
                d.iter_mut().zip(a.iter().zip(b)).for_each(|(x, (y, z))| *x = comb(*y, *z));
            }
        }
    }
}

#[inline(always)]
fn fmin<A: PartialOrd + Copy>(a: A, b: A) -> A {
    // NaN-propagating: a NaN on either side wins (a != a only for NaN).
    #[allow(clippy::eq_op)]
    if a != a || b != b {
        if a != a {
            a
        } else {
            b
        }
    } else if b < a {
        b
    } else {
        a
    }
}

#[inline(always)]
fn fmax<A: PartialOrd + Copy>(a: A, b: A) -> A {
    #[allow(clippy::eq_op)]
    if a != a || b != b {
        if a != a {
            a
        } else {
            b
        }
    } else if b > a {
        b
    } else {
        a
    }
}

macro_rules! float_reduce {
    ($t:ty, $acc:ty, $direct:expr, $dst:expr, $srcs:expr, $len:expr, $red:expr) => {{
        let dst = $dst as *mut $t;
        let srcs: Vec<*const $t> = $srcs.iter().map(|p| *p as *const $t).collect();
        let n = $red.world as $acc;
        let f = $red.factor as $acc;
        let id = |a: $acc| a;
        // `reduce_direct` may write over srcs[0] or srcs[1] only (its doc): a `dst` that is
        // a later source takes the blocked path, which gives the same bits.
        let direct = $direct && !srcs.iter().skip(2).any(|s| std::ptr::eq(*s, dst));
        // SAFETY: the pointer contract of `reduce_generic`, forwarded.
        unsafe {
            match $red.op {
                ReduceOp::Sum if direct => reduce_direct::<$t>(dst, &srcs, $len, |a: $t, b: $t| a + b),
                ReduceOp::Product if direct => reduce_direct::<$t>(dst, &srcs, $len, |a: $t, b: $t| a * b),
                ReduceOp::Min if direct => reduce_direct::<$t>(dst, &srcs, $len, fmin::<$t>),
                ReduceOp::Max if direct => reduce_direct::<$t>(dst, &srcs, $len, fmax::<$t>),
                ReduceOp::Sum => reduce_with::<$t>(dst, &srcs, $len, id, |a, b| a + b, id),
                ReduceOp::Avg => reduce_with::<$t>(dst, &srcs, $len, id, |a, b| a + b, |a| a / n),
                ReduceOp::PremulSum => reduce_with::<$t>(dst, &srcs, $len, |a| a * f, |a, b| a + b, id),
                ReduceOp::Product => reduce_with::<$t>(dst, &srcs, $len, id, |a, b| a * b, id),
                ReduceOp::Min => reduce_with::<$t>(dst, &srcs, $len, id, fmin, id),
                ReduceOp::Max => reduce_with::<$t>(dst, &srcs, $len, id, fmax, id),
                ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => unreachable!("checked by Reduction::new"),
            }
        }
    }};
}

macro_rules! int_reduce {
    ($t:ty, $dst:expr, $srcs:expr, $len:expr, $red:expr) => {{
        let dst = $dst as *mut $t;
        let srcs: Vec<*const $t> = $srcs.iter().map(|p| *p as *const $t).collect();
        let n = $red.world as i64;
        let id = |a: i64| a;
        // SAFETY: the pointer contract of `reduce_generic`, forwarded.
        unsafe {
            match $red.op {
                ReduceOp::Sum => reduce_with::<$t>(dst, &srcs, $len, id, i64::wrapping_add, id),
                // `wrapping_div` truncates toward zero; n >= 1.
                ReduceOp::Avg => reduce_with::<$t>(dst, &srcs, $len, id, i64::wrapping_add, |a| a.wrapping_div(n)),
                ReduceOp::Product => reduce_with::<$t>(dst, &srcs, $len, id, i64::wrapping_mul, id),
                ReduceOp::Min => reduce_with::<$t>(dst, &srcs, $len, id, std::cmp::min, id),
                ReduceOp::Max => reduce_with::<$t>(dst, &srcs, $len, id, std::cmp::max, id),
                ReduceOp::Band => reduce_with::<$t>(dst, &srcs, $len, id, |a, b| a & b, id),
                ReduceOp::Bor => reduce_with::<$t>(dst, &srcs, $len, id, |a, b| a | b, id),
                ReduceOp::Bxor => reduce_with::<$t>(dst, &srcs, $len, id, |a, b| a ^ b, id),
                ReduceOp::PremulSum => unreachable!("checked by Reduction::new"),
            }
        }
    }};
}

/// Reduces `srcs` (rank order, each `len` elements of `red.dtype`) into `dst`.
///
/// # Safety
/// `dst` must be valid for writes of `len` elements and every source for reads of `len`
/// elements, all aligned to the element size; `dst` must not overlap a source except by
/// being equal to one of them (any one: the one-shot allreduce reduces into the caller's
/// buffer, which is this rank's source). `srcs` must not be empty.
pub unsafe fn reduce_raw(red: &Reduction, dst: *mut u8, srcs: &[*const u8], len: usize) {
    debug_assert!(!srcs.is_empty());
    if len == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if half_x86::available(red.dtype) {
        // SAFETY: `available` checked the CPU features; the pointer contract is forwarded.
        return unsafe { half_x86::reduce(red, dst, srcs, len) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports the features the function is compiled for; the
        // pointer contract is forwarded.
        return unsafe { reduce_avx2(red, dst, srcs, len) };
    }
    // SAFETY: forwarded.
    unsafe { reduce_generic(red, dst, srcs, len) }
}

/// The kernels compiled for AVX2 + FMA (x86-64-v3), chosen at run time by [`reduce_raw`];
/// the generic build below is the portable fallback (SSE2 on x86-64, NEON on aarch64).
///
/// # Safety
/// As [`reduce_raw`]; the CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn reduce_avx2(red: &Reduction, dst: *mut u8, srcs: &[*const u8], len: usize) {
    // SAFETY: forwarded; `reduce_generic` is inline(always), so its loops are compiled
    // with this function's target features.
    unsafe { reduce_generic(red, dst, srcs, len) }
}

/// # Safety
/// As [`reduce_raw`].
#[inline(always)]
unsafe fn reduce_generic(red: &Reduction, dst: *mut u8, srcs: &[*const u8], len: usize) {
    // SAFETY (all arms): forwarded from this function's contract; `red` was checked by
    // `Reduction::new`, so the unreachable arms are not reached.
    match red.dtype {
        DType::F32 => float_reduce!(f32, f32, true, dst, srcs, len, red),
        DType::F64 => float_reduce!(f64, f64, true, dst, srcs, len, red),
        DType::F16 => float_reduce!(f16, f32, false, dst, srcs, len, red),
        DType::BF16 => float_reduce!(bf16, f32, false, dst, srcs, len, red),
        DType::I8 => int_reduce!(i8, dst, srcs, len, red),
        DType::U8 => int_reduce!(u8, dst, srcs, len, red),
        DType::I16 => int_reduce!(i16, dst, srcs, len, red),
        DType::I32 => int_reduce!(i32, dst, srcs, len, red),
        DType::I64 => int_reduce!(i64, dst, srcs, len, red),
        DType::Bool => {
            let dst = dst as *mut Bool8;
            let srcs: Vec<*const Bool8> = srcs.iter().map(|p| *p as *const Bool8).collect();
            let id = |a: u8| a;
            // SAFETY: forwarded from this function's contract.
            unsafe {
                match red.op {
                    ReduceOp::Sum | ReduceOp::Max | ReduceOp::Bor => reduce_with::<Bool8>(dst, &srcs, len, id, |a, b| a | b, id),
                    ReduceOp::Product | ReduceOp::Min | ReduceOp::Band => reduce_with::<Bool8>(dst, &srcs, len, id, |a, b| a & b, id),
                    ReduceOp::Bxor => reduce_with::<Bool8>(dst, &srcs, len, id, |a, b| a ^ b, id),
                    ReduceOp::Avg | ReduceOp::PremulSum => unreachable!("checked by Reduction::new"),
                }
            }
        }
    }
}

/// Safe wrapper over [`reduce_raw`] for byte slices, used by tests and benches.
/// Returns `InvalidArgument` when lengths disagree or a slice is misaligned.
pub fn reduce_bytes(red: &Reduction, dst: &mut [u8], srcs: &[&[u8]]) -> Result<()> {
    let es = red.dtype.size();
    if srcs.is_empty() {
        return Err(Error::InvalidArgument("srcs: need at least one source".into()));
    }
    if dst.len() % es != 0 || srcs.iter().any(|s| s.len() != dst.len()) {
        return Err(Error::InvalidArgument("dst/srcs: lengths must be equal multiples of the element size".into()));
    }
    let aligned = |p: usize| p % es == 0;
    if !aligned(dst.as_ptr() as usize) || srcs.iter().any(|s| !aligned(s.as_ptr() as usize)) {
        return Err(Error::InvalidArgument("dst/srcs: buffers must be aligned to the element size".into()));
    }
    let ptrs: Vec<*const u8> = srcs.iter().map(|s| s.as_ptr()).collect();
    // SAFETY: lengths and alignment checked above; `dst` is a unique borrow so it does
    // not overlap the shared borrows in `srcs`.
    unsafe { reduce_raw(red, dst.as_mut_ptr(), &ptrs, dst.len() / es) };
    Ok(())
}
