//! Criterion bench of the reduction kernels alone (no synchronisation): reducing 2 and 4
//! sources of one chunk, per dtype, against a plain copy of the same bytes. bfloat16 and
//! float16 take the AVX2 / F16C kernels of `rust/reduce/half_x86.rs` where the CPU has them
//! (the generic ones otherwise); figures and history: docs/benchmark.md.
//!
//! Run: `cargo bench --bench kernels`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use flagos_shm::reduce::{reduce_bytes, DType, ReduceOp, Reduction};

const BYTES: usize = 512 * 1024;

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("reduce_512KiB");
    g.throughput(Throughput::Bytes(BYTES as u64));
    let srcs: Vec<Vec<u64>> = (0..4).map(|r| vec![r as u64 + 1; BYTES / 8]).collect();
    let mut dst = vec![0u64; BYTES / 8];
    let bytes = |v: &Vec<u64>| -> &[u8] {
        // SAFETY: u64 has no padding; same memory viewed as bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 8) }
    };
    g.bench_function("copy", |b| {
        b.iter(|| {
            // SAFETY: both buffers hold BYTES bytes and do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(srcs[0].as_ptr(), dst.as_mut_ptr(), BYTES / 8) }
        })
    });
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::I64] {
        for n in [2usize, 4] {
            let red = Reduction::new(dtype, ReduceOp::Sum, 1.0, n).unwrap();
            let views: Vec<&[u8]> = srcs[..n].iter().map(bytes).collect();
            g.bench_with_input(BenchmarkId::new(format!("{}_sum", dtype.name()), n), &n, |b, _| {
                // SAFETY: same memory as `dst`, viewed as bytes through a unique borrow.
                let d = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), BYTES) };
                b.iter(|| reduce_bytes(&red, d, &views).unwrap())
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
