//! The bfloat16 and float16 reduction kernels (`reduce_bytes`: the SIMD kernels of
//! `rust/reduce/half_x86.rs` where the CPU has them, the generic ones elsewhere) against a
//! scalar reference written here: each source element converted with `half`'s `to_f32`,
//! combined in float32 in rank order, converted back once with `from_f32`. Results must be
//! equal bit for bit, NaN payloads and signed zeros included.
//!
//! Inputs: a fixed-seed generator mixing special values (NaN with and without the quiet
//! bit, +-inf, +-0, subnormals, the largest finite, values near 1 whose sums are rounding
//! ties) with random bits; every op, 1..=4 sources, lengths that cover the 32-element body,
//! the 8-element body and the tail, at two source offsets.

use flagos_shm::reduce::{reduce_bytes, DType, ReduceOp, Reduction};
use half::{bf16, f16};

const OPS: [ReduceOp; 6] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::PremulSum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max];
const LENS: [usize; 15] = [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1000];
/// PREMUL_SUM's factor: not a power of two, so the products round.
const FACTOR: f64 = 0.3;

/// A half-precision type seen through its bits and `half`'s scalar conversions.
trait Half {
    const DTYPE: DType;
    /// Special values, as bits.
    const SPECIALS: &'static [u16];
    /// Bits of 1.0: random mantissas under this exponent make sums that tie.
    const ONE: u16;
    fn to_f32(bits: u16) -> f32;
    fn from_f32(x: f32) -> u16;
}

impl Half for bf16 {
    const DTYPE: DType = DType::BF16;
    const SPECIALS: &'static [u16] = &[
        0x7fc0, 0xffc0, 0x7f81, 0xff81, 0x7fff, 0x7f80, 0xff80, 0x0000, 0x8000, 0x0001, 0x807f, 0x0080, 0x7f7f, 0xff7f, 0x3f80, 0x3f81,
        0x3b80, 0xbb80, 0x4000,
    ];
    const ONE: u16 = 0x3f80;
    fn to_f32(bits: u16) -> f32 {
        bf16::from_bits(bits).to_f32()
    }
    fn from_f32(x: f32) -> u16 {
        bf16::from_f32(x).to_bits()
    }
}

impl Half for f16 {
    const DTYPE: DType = DType::F16;
    const SPECIALS: &'static [u16] = &[
        0x7e00, 0xfe00, 0x7c01, 0xfc01, 0x7fff, 0x7c00, 0xfc00, 0x0000, 0x8000, 0x0001, 0x83ff, 0x0400, 0x7bff, 0xfbff, 0x3c00, 0x3c01,
        0x1000, 0x9000, 0x4000,
    ];
    const ONE: u16 = 0x3c00;
    fn to_f32(bits: u16) -> f32 {
        f16::from_bits(bits).to_f32()
    }
    fn from_f32(x: f32) -> u16 {
        f16::from_f32(x).to_bits()
    }
}

/// splitmix64: a fixed-seed generator, so a failure reproduces.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

fn element<T: Half>(rng: &mut Rng) -> u16 {
    let r = rng.next();
    match r % 4 {
        0 => T::SPECIALS[(r >> 8) as usize % T::SPECIALS.len()],
        // Near +-1: same exponent, random low mantissa bits and sign.
        1 => (T::ONE | ((r >> 8) as u16 & 0x3f)) ^ ((r >> 20) as u16 & 0x8000),
        _ => (r >> 32) as u16,
    }
}

/// NaN-propagating min: the accumulator `a` if NaN, else `b` if NaN (or smaller), else `a`.
fn nan_min(a: f32, b: f32) -> f32 {
    if a.is_nan() {
        a
    } else if b.is_nan() || b < a {
        b
    } else {
        a
    }
}

/// NaN-propagating max: the accumulator `a` if NaN, else `b` if NaN (or larger), else `a`.
fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() {
        a
    } else if b.is_nan() || b > a {
        b
    } else {
        a
    }
}

/// The reference result of one element.
struct Want {
    bits: u16,
    /// Set when a float32 operation met two NaN operands: IEEE 754 leaves open which one's
    /// payload the result carries, and the compiler may swap the operands of `+` and `*`
    /// (the generic kernels and this reference differ there too). The result must then be
    /// one of these: a NaN input, quieted, or the default NaN (from `inf - inf`, `0 * inf`).
    nan_choices: Option<Vec<u16>>,
}

/// The documented formula, one element at a time.
fn reference<T: Half>(op: ReduceOp, srcs: &[&[u16]]) -> Vec<Want> {
    let f = FACTOR as f32;
    let world = srcs.len() as f32;
    (0..srcs[0].len())
        .map(|i| {
            let x = |r: usize| T::to_f32(srcs[r][i]);
            let mut acc = if op == ReduceOp::PremulSum { x(0) * f } else { x(0) };
            let mut two_nans = false;
            for r in 1..srcs.len() {
                let v = x(r);
                let arithmetic = !matches!(op, ReduceOp::Min | ReduceOp::Max);
                two_nans |= arithmetic && acc.is_nan() && v.is_nan();
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + v,
                    ReduceOp::PremulSum => acc + v * f,
                    ReduceOp::Product => acc * v,
                    ReduceOp::Min => nan_min(acc, v),
                    ReduceOp::Max => nan_max(acc, v),
                    _ => unreachable!(),
                };
            }
            if op == ReduceOp::Avg {
                acc /= world;
            }
            let nan_choices = two_nans.then(|| {
                let quieted = (0..srcs.len()).map(x).filter(|v| v.is_nan()).map(T::from_f32);
                quieted.chain([T::from_f32(f32::from_bits(0xffc0_0000))]).collect()
            });
            Want { bits: T::from_f32(acc), nan_choices }
        })
        .collect()
}

fn bytes(v: &[u16]) -> &[u8] {
    // SAFETY: u16 has no padding; the same memory viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 2) }
}

fn reduce<T: Half>(op: ReduceOp, srcs: &[&[u16]]) -> Vec<u16> {
    let red = Reduction::new(T::DTYPE, op, FACTOR, srcs.len()).unwrap();
    let mut out = vec![0u16; srcs[0].len()];
    // SAFETY: u16 has no padding; `out` is uniquely borrowed.
    let dst = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), out.len() * 2) };
    let views: Vec<&[u8]> = srcs.iter().map(|s| bytes(s)).collect();
    reduce_bytes(&red, dst, &views).unwrap();
    out
}

fn check_all<T: Half>(seed: u64) {
    let mut rng = Rng(seed);
    let mut bad = Vec::new();
    let mut compared = 0usize;
    for op in OPS {
        for n in 1..=4 {
            for len in LENS {
                for offset in [0, 3] {
                    let data: Vec<Vec<u16>> = (0..n).map(|_| (0..len + offset).map(|_| element::<T>(&mut rng)).collect()).collect();
                    let srcs: Vec<&[u16]> = data.iter().map(|d| &d[offset..]).collect();
                    let want = reference::<T>(op, &srcs);
                    let got = reduce::<T>(op, &srcs);
                    compared += len;
                    for i in 0..len {
                        let ok = match &want[i].nan_choices {
                            None => got[i] == want[i].bits,
                            Some(choices) => choices.contains(&got[i]),
                        };
                        if !ok && bad.len() < 10 {
                            let ins: Vec<String> = srcs.iter().map(|s| format!("{:#06x}", s[i])).collect();
                            bad.push(format!(
                                "{:?} {op:?} n={n} len={len} offset={offset} i={i}: inputs {ins:?} gave {:#06x}, want {:#06x}",
                                T::DTYPE,
                                got[i],
                                want[i].bits
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(compared > 0);
    assert!(bad.is_empty(), "mismatches:\n{}", bad.join("\n"));
}

#[test]
fn bf16_kernels_match_scalar_reference_bit_for_bit() {
    for seed in 0..4 {
        check_all::<bf16>(seed);
    }
}

#[test]
fn f16_kernels_match_scalar_reference_bit_for_bit() {
    for seed in 0..4 {
        check_all::<f16>(seed);
    }
}

/// Ties, with the expected bits worked out by hand (not by `half`): the float32 sums are
/// exactly halfway between two half-precision neighbours and must round to the even one.
#[test]
fn sums_that_tie_round_to_even() {
    // bfloat16: 1 + 2^-8 lies halfway between 1 (0x3f80, even) and 0x3f81; (1 + 2^-7) +
    // 2^-8 lies halfway between 0x3f81 and 0x3f82 (even). The same below 0 with the sign.
    // Repeated to 40 elements, so the 32-wide body, the 8-wide body and no tail all see it.
    // (dtype, first source, second source, expected sum), repeated cyclically.
    type Case = (DType, [u16; 4], [u16; 4], [u16; 4]);
    let cases: [Case; 2] = [
        (DType::BF16, [0x3f80, 0x3f81, 0xbf80, 0xbf81], [0x3b80, 0x3b80, 0xbb80, 0xbb80], [0x3f80, 0x3f82, 0xbf80, 0xbf82]),
        // float16: 1 + 2^-11 and (1 + 2^-10) + 2^-11.
        (DType::F16, [0x3c00, 0x3c01, 0xbc00, 0xbc01], [0x1000, 0x1000, 0x9000, 0x9000], [0x3c00, 0x3c02, 0xbc00, 0xbc02]),
    ];
    for (dtype, a, b, want) in cases {
        for len in [4, 7, 40] {
            let a: Vec<u16> = a.iter().cycle().take(len).copied().collect();
            let b: Vec<u16> = b.iter().cycle().take(len).copied().collect();
            let want: Vec<u16> = want.iter().cycle().take(len).copied().collect();
            let got = match dtype {
                DType::BF16 => reduce::<bf16>(ReduceOp::Sum, &[&a, &b]),
                _ => reduce::<f16>(ReduceOp::Sum, &[&a, &b]),
            };
            assert_eq!(got, want, "{dtype:?} len={len}");
        }
    }
}
