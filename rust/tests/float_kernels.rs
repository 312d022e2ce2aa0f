//! The float32 and float64 reduction kernels (`reduce_raw`) against a scalar reference
//! written here, with the output apart from the sources and in place (equal to the first or
//! the second source, as the single-copy reductions call it; the kernels take a different
//! loop for each). Results must be equal bit for bit, signed zeros included: the reference
//! combines in rank order. NaN payloads must match for MIN and MAX, whose rule the kernels
//! spell out (a NaN wins, the first one if both are); for SUM, PRODUCT and AVG any NaN
//! matches a NaN, since which operand's payload an addition of two NaNs keeps is the
//! hardware's and the compiler's choice (Rust does not fix it).
//!
//! Inputs: a fixed-seed generator mixing special values (NaNs with two payloads, +-inf,
//! +-0, subnormals) with random values; SUM, PRODUCT, MIN, MAX and AVG, 1..=4 sources,
//! lengths around the kernels' 256-element block.

mod common;

use common::Rng;
use flagos_shm::reduce::{reduce_raw, DType, ReduceOp, Reduction};

const OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];
const LENS: [usize; 8] = [0, 1, 7, 255, 256, 257, 513, 1000];

/// Where the output goes.
#[derive(Clone, Copy, Debug)]
enum Out {
    Apart,
    /// Into source k, which then holds the result.
    Source(usize),
}

trait Float: Copy + PartialOrd + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> + std::ops::Div<Output = Self> {
    const DTYPE: DType;
    fn specials() -> Vec<Self>;
    fn random(rng: &mut Rng) -> Self;
    fn from_usize(n: usize) -> Self;
    fn bits(self) -> u64;
    fn is_nan_bits(bits: u64) -> bool;
}

impl Float for f32 {
    const DTYPE: DType = DType::F32;
    fn specials() -> Vec<f32> {
        vec![f32::from_bits(0x7fc0_0001), f32::from_bits(0xffc0_0002), f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, f32::from_bits(1)]
    }
    fn random(rng: &mut Rng) -> f32 {
        (rng.next() % 2_000_001) as f32 / 1000.0 - 1000.0
    }
    fn from_usize(n: usize) -> f32 {
        n as f32
    }
    fn bits(self) -> u64 {
        self.to_bits() as u64
    }
    fn is_nan_bits(bits: u64) -> bool {
        f32::from_bits(bits as u32).is_nan()
    }
}

impl Float for f64 {
    const DTYPE: DType = DType::F64;
    fn specials() -> Vec<f64> {
        vec![
            f64::from_bits(0x7ff8_0000_0000_0001),
            f64::from_bits(0xfff8_0000_0000_0002),
            f64::INFINITY,
            f64::NEG_INFINITY,
            0.0,
            -0.0,
            f64::from_bits(1),
        ]
    }
    fn random(rng: &mut Rng) -> f64 {
        (rng.next() % 2_000_001) as f64 / 1000.0 - 1000.0
    }
    fn from_usize(n: usize) -> f64 {
        n as f64
    }
    fn bits(self) -> u64 {
        self.to_bits()
    }
    fn is_nan_bits(bits: u64) -> bool {
        f64::from_bits(bits).is_nan()
    }
}

/// NaN-propagating MIN/MAX: a NaN on either side wins, the first one if both are.
#[allow(clippy::eq_op)]
fn pick<T: Float>(a: T, b: T, take_b: bool) -> T {
    if a != a {
        a
    } else if b != b || take_b {
        b
    } else {
        a
    }
}

fn reference<T: Float>(op: ReduceOp, srcs: &[Vec<T>]) -> Vec<u64> {
    (0..srcs[0].len())
        .map(|i| {
            let mut acc = srcs[0][i];
            for s in &srcs[1..] {
                let x = s[i];
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + x,
                    ReduceOp::Product => acc * x,
                    ReduceOp::Min => pick(acc, x, x < acc),
                    ReduceOp::Max => pick(acc, x, x > acc),
                    _ => unreachable!(),
                };
            }
            if op == ReduceOp::Avg {
                acc = acc / T::from_usize(srcs.len());
            }
            acc.bits()
        })
        .collect()
}

fn input<T: Float>(rng: &mut Rng, len: usize) -> Vec<T> {
    let sp = T::specials();
    (0..len).map(|_| if rng.next() % 5 == 0 { sp[(rng.next() % sp.len() as u64) as usize] } else { T::random(rng) }).collect()
}

fn check<T: Float>(seed: u64) {
    let mut rng = Rng(seed);
    for op in OPS {
        for n in 1..=4 {
            for len in LENS {
                for out in [Out::Apart, Out::Source(0), Out::Source(1)] {
                    if matches!(out, Out::Source(k) if k >= n) {
                        continue;
                    }
                    let mut srcs: Vec<Vec<T>> = (0..n).map(|_| input(&mut rng, len)).collect();
                    let want = reference(op, &srcs);
                    let red = Reduction::new(T::DTYPE, op, 1.0, n).unwrap();
                    let mut apart = vec![T::from_usize(7); len];
                    let ptrs: Vec<*const u8> = srcs.iter_mut().map(|s| s.as_mut_ptr() as *const u8).collect();
                    let dst = match out {
                        Out::Apart => apart.as_mut_ptr() as *mut u8,
                        Out::Source(k) => ptrs[k] as *mut u8,
                    };
                    // SAFETY: every buffer holds `len` aligned elements and lives through
                    // the call; `dst` is a separate buffer or exactly source k, which
                    // reduce_raw allows, and nothing else touches them meanwhile.
                    unsafe { reduce_raw(&red, dst, &ptrs, len) };
                    let got: Vec<u64> = match out {
                        Out::Apart => apart.iter().map(|x| x.bits()).collect(),
                        Out::Source(k) => srcs[k].iter().map(|x| x.bits()).collect(),
                    };
                    let any_nan = !matches!(op, ReduceOp::Min | ReduceOp::Max);
                    let same = |g: u64, w: u64| g == w || (any_nan && T::is_nan_bits(g) && T::is_nan_bits(w));
                    if let Some(i) = (0..len).find(|&i| !same(got[i], want[i])) {
                        panic!("{:?} {op:?} n={n} len={len} out={out:?}: element {i} is {:#x}, want {:#x}", T::DTYPE, got[i], want[i]);
                    }
                }
            }
        }
    }
}

#[test]
fn f32_kernels_match_scalar_reference_apart_and_in_place() {
    check::<f32>(0x5eed_0032);
}

#[test]
fn f64_kernels_match_scalar_reference_apart_and_in_place() {
    check::<f64>(0x5eed_0064);
}
