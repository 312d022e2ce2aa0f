//! Criterion bench of the core's collectives between 2 ranks, run as threads of this process
//! sharing one segment in /dev/shm: allreduce (in place, float32 SUM), allgather,
//! reduce-scatter (float32 SUM) and broadcast (root 0), at small (4 B, 1 KiB, 64 KiB) and
//! large (1 MiB, 16 MiB) sizes.
//!
//! Sizes are S as nccl-tests count them (as `python -m flagos_shm.bench` does): the buffer
//! for allreduce and broadcast, the whole output for allgather and the whole input for
//! reduce-scatter (n x the per-rank piece; at least one element per rank, so S = 8 B at
//! "4 B"). Criterion's throughput is S per call (= algbw).
//!
//! Rank 0 is criterion's timing thread; for each measurement it tells rank 1 which op, size
//! and how many iterations to run (`iter_custom`), so both ranks always issue the same
//! collectives in the same order.
//!
//! Run: `cargo bench --bench collectives` (about a minute: 20 samples, 2 s of measurement
//! per case), or one op: `cargo bench --bench collectives -- allgather`.
//! FLAGOS_SHM_DIR and FLAGOS_SHM_SLOT_BYTES are honoured as by the Python backend.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use flagos_shm::segment::{self, DEFAULT_SLOT_BYTES};
use flagos_shm::{Communicator, DType, ReduceOp};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const RANKS: usize = 2;
/// Requested sizes S in bytes.
const SIZES: [usize; 5] = [4, 1 << 10, 64 << 10, 1 << 20, 16 << 20];
const MAX_ELEMS: usize = SIZES[SIZES.len() - 1] / 4;

#[derive(Clone, Copy, Debug)]
enum Op {
    Allreduce,
    Allgather,
    ReduceScatter,
    Broadcast,
}

impl Op {
    const ALL: [Op; 4] = [Op::Allreduce, Op::Allgather, Op::ReduceScatter, Op::Broadcast];

    fn name(self) -> &'static str {
        match self {
            Op::Allreduce => "allreduce",
            Op::Allgather => "allgather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
        }
    }

    /// (element count passed to the core, S in bytes) for a requested S.
    fn count(self, bytes: usize) -> (usize, usize) {
        match self {
            Op::Allreduce | Op::Broadcast => {
                let c = (bytes / 4).max(1);
                (c, c * 4)
            }
            Op::Allgather | Op::ReduceScatter => {
                let c = (bytes / 4 / RANKS).max(1);
                (c, c * RANKS * 4)
            }
        }
    }
}

/// One rank's buffers, large enough for every case; zero-filled, so repeated in-place sums
/// stay finite (as in the Python benchmark).
struct Buffers {
    input: Vec<f32>,
    output: Vec<f32>,
}

impl Buffers {
    fn new() -> Self {
        Buffers { input: vec![0.0; MAX_ELEMS], output: vec![0.0; MAX_ELEMS] }
    }

    /// Runs `op` on `count` elements (see `Op::count`) `iters` times.
    fn run(&mut self, comm: &mut Communicator, op: Op, count: usize, iters: u64) {
        let input = self.input.as_mut_ptr().cast::<u8>();
        let output = self.output.as_mut_ptr().cast::<u8>();
        for _ in 0..iters {
            // SAFETY: `Op::count` keeps count (allreduce, broadcast) and RANKS * count
            // (allgather output, reduce-scatter input) within MAX_ELEMS, the length of both
            // buffers; the two buffers do not overlap and live for the whole call.
            let r = unsafe {
                match op {
                    Op::Allreduce => comm.allreduce(input, count, DType::F32, ReduceOp::Sum, 1.0),
                    Op::Allgather => comm.allgather(input, output, count, DType::F32),
                    Op::ReduceScatter => comm.reduce_scatter(input, output, count, DType::F32, ReduceOp::Sum, 1.0),
                    Op::Broadcast => comm.broadcast(input, count, DType::F32, 0),
                }
            };
            r.unwrap_or_else(|e| panic!("{} of {count} elements failed: {e}", op.name()));
        }
    }
}

fn bench(c: &mut Criterion) {
    let dir = std::env::var("FLAGOS_SHM_DIR").unwrap_or_else(|_| "/dev/shm".into());
    let slot = std::env::var("FLAGOS_SHM_SLOT_BYTES").ok().and_then(|s| s.parse().ok()).unwrap_or(DEFAULT_SLOT_BYTES);
    let path = segment::create(dir.as_ref(), RANKS, slot).expect("create segment");
    let (tx, rx) = mpsc::channel::<Option<(Op, usize, u64)>>();
    let p1 = path.clone();
    let peer = std::thread::spawn(move || {
        let mut comm = Communicator::attach(&p1, 1, RANKS, Duration::from_secs(60)).expect("attach rank 1");
        let mut bufs = Buffers::new();
        while let Ok(Some((op, count, iters))) = rx.recv() {
            bufs.run(&mut comm, op, count, iters);
        }
    });
    let mut comm = Communicator::attach(&path, 0, RANKS, Duration::from_secs(60)).expect("attach rank 0");
    let mut bufs = Buffers::new();
    for op in Op::ALL {
        let mut g = c.benchmark_group(format!("{}_f32_{RANKS}ranks", op.name()));
        for requested in SIZES {
            let (count, size) = op.count(requested);
            g.throughput(Throughput::Bytes(size as u64));
            g.sample_size(if size >= 16 << 20 { 10 } else { 20 });
            g.bench_with_input(BenchmarkId::from_parameter(size), &count, |b, &count| {
                b.iter_custom(|iters| {
                    tx.send(Some((op, count, iters))).unwrap();
                    let t = Instant::now();
                    bufs.run(&mut comm, op, count, iters);
                    t.elapsed()
                })
            });
        }
        g.finish();
    }
    tx.send(None).unwrap();
    peer.join().unwrap();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
