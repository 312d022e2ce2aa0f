//! Criterion bench of the core's allreduce (float32 SUM), 2 ranks as threads of this
//! process sharing one segment in /dev/shm. Rank 0 is criterion's timing thread; for each
//! measurement it tells rank 1 how many iterations to run (`iter_custom`), so both ranks
//! always issue the same number of collectives.
//!
//! Run: `cargo bench --bench allreduce` (FLAGOS_SHM_DIR and FLAGOS_SHM_SLOT_BYTES are
//! honoured as by the Python backend).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use flagos_shm::segment::{self, DEFAULT_SLOT_BYTES};
use flagos_shm::{Communicator, DType, ReduceOp};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const SIZES: [usize; 6] = [4, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20];

fn bench(c: &mut Criterion) {
    let dir = std::env::var("FLAGOS_SHM_DIR").unwrap_or_else(|_| "/dev/shm".into());
    let slot = std::env::var("FLAGOS_SHM_SLOT_BYTES").ok().and_then(|s| s.parse().ok()).unwrap_or(DEFAULT_SLOT_BYTES);
    let path = segment::create(dir.as_ref(), 2, slot).expect("create segment");
    let (tx, rx) = mpsc::channel::<Option<(usize, u64)>>();
    let p1 = path.clone();
    let peer = std::thread::spawn(move || {
        let mut comm = Communicator::attach(&p1, 1, 2, Duration::from_secs(60)).expect("attach rank 1");
        let mut buf = vec![1.0f32; SIZES[SIZES.len() - 1] / 4];
        while let Ok(Some((bytes, iters))) = rx.recv() {
            for _ in 0..iters {
                // SAFETY: `buf` holds at least bytes / 4 f32.
                unsafe { comm.allreduce(buf.as_mut_ptr().cast(), bytes / 4, DType::F32, ReduceOp::Sum, 1.0).unwrap() };
            }
        }
    });
    let mut comm = Communicator::attach(&path, 0, 2, Duration::from_secs(60)).expect("attach rank 0");
    let mut buf = vec![1.0f32; SIZES[SIZES.len() - 1] / 4];
    let mut g = c.benchmark_group("allreduce_f32_sum_2ranks");
    for bytes in SIZES {
        g.throughput(Throughput::Bytes(bytes as u64));
        if bytes >= 16 << 20 {
            g.sample_size(10);
        }
        g.bench_with_input(BenchmarkId::from_parameter(bytes), &bytes, |b, &bytes| {
            b.iter_custom(|iters| {
                tx.send(Some((bytes, iters))).unwrap();
                let t = Instant::now();
                for _ in 0..iters {
                    // SAFETY: `buf` holds at least bytes / 4 f32.
                    unsafe { comm.allreduce(buf.as_mut_ptr().cast(), bytes / 4, DType::F32, ReduceOp::Sum, 1.0).unwrap() };
                }
                t.elapsed()
            })
        });
    }
    g.finish();
    tx.send(None).unwrap();
    peer.join().unwrap();
}

criterion_group!(benches, bench);
criterion_main!(benches);
