//! Criterion bench of the core's collectives between 2 ranks run as two processes sharing
//! one segment in /dev/shm: allreduce (in place, float32 SUM), allgather, reduce-scatter
//! (float32 SUM) and broadcast (root 0), at small (4 B, 1 KiB, 64 KiB) and large (1 MiB,
//! 16 MiB) sizes.
//!
//! Sizes are S as nccl-tests count them (as `python -m flagos_shm.bench` does): the buffer
//! for allreduce and broadcast, the whole output for allgather and the whole input for
//! reduce-scatter (n x the per-rank piece; at least one element per rank, so S = 8 B at
//! "4 B"). Criterion's throughput is S per call (= algbw).
//!
//! Rank 0 is criterion's own process: it creates the segment, forks rank 1 (before it
//! attaches, as the first thing the bench function does) and then, for each measurement,
//! tells rank 1 over a Unix socket which op, size and how many iterations to run
//! (`iter_custom`), so both ranks always issue the same collectives in the same order.
//! Rank 1 serves these commands until told to stop, or until the socket closes or rank 0
//! dies (then it exits too: no process or segment file is left behind); rank 0 reaps it
//! at the end.
//!
//! Each process is pinned to a different CPU of the allowed set (rank r to the r-th one,
//! as `python -m flagos_shm.bench --bind` does) when at least 2 CPUs are allowed;
//! FLAGOS_SHM_BENCH_BIND=0 leaves the placement to the scheduler.
//!
//! Run: `cargo bench --bench collectives` (about a minute: 20 samples, 2 s of measurement
//! per case), or one op: `cargo bench --bench collectives -- allgather`.
//! FLAGOS_SHM_DIR and FLAGOS_SHM_SLOT_BYTES are honoured as by the Python backend.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use flagos_shm::segment::{self, DEFAULT_SLOT_BYTES};
use flagos_shm::{Buf, Communicator, DType, ReduceOp};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

const RANKS: usize = 2;
/// Requested sizes S in bytes.
const SIZES: [usize; 5] = [4, 1 << 10, 64 << 10, 1 << 20, 16 << 20];
const MAX_ELEMS: usize = SIZES[SIZES.len() - 1] / 4;

#[derive(Clone, Copy, Debug, PartialEq)]
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

    /// Runs `op` on `count` elements (see `Op::count`) `iters` times; stops at the first error.
    fn run(&mut self, comm: &mut Communicator, op: Op, count: usize, iters: u64) -> Result<(), String> {
        for _ in 0..iters {
            // `Op::count` keeps count (allreduce, broadcast) and RANKS * count (allgather
            // output, reduce-scatter input) within MAX_ELEMS, the length of both buffers.
            let (input, output) = (Buf::from_elems_mut(&mut self.input), Buf::from_elems_mut(&mut self.output));
            let r = match op {
                Op::Allreduce => comm.allreduce(input, count, DType::F32, ReduceOp::Sum, 1.0),
                Op::Allgather => comm.allgather(input, output, count, DType::F32),
                Op::ReduceScatter => comm.reduce_scatter(input, output, count, DType::F32, ReduceOp::Sum, 1.0),
                Op::Broadcast => comm.broadcast(input, count, DType::F32, 0),
            };
            r.map_err(|e| format!("{} of {count} elements failed: {e}", op.name()))?;
        }
        Ok(())
    }
}

/// A command from rank 0 to rank 1: three little-endian u64 words, `[op, count, iters]`,
/// where op is 1 + the index in `Op::ALL`; op 0 means stop.
const CMD_BYTES: usize = 24;

fn encode(cmd: Option<(Op, usize, u64)>) -> [u8; CMD_BYTES] {
    let (op, count, iters) = match cmd {
        Some((op, count, iters)) => (1 + Op::ALL.iter().position(|&o| o == op).unwrap() as u64, count as u64, iters),
        None => (0, 0, 0),
    };
    let mut b = [0u8; CMD_BYTES];
    b[0..8].copy_from_slice(&op.to_le_bytes());
    b[8..16].copy_from_slice(&count.to_le_bytes());
    b[16..24].copy_from_slice(&iters.to_le_bytes());
    b
}

/// The next command, `None` for stop; `Err` if the socket closed (rank 0 is gone) or the
/// message is malformed.
fn read_cmd(s: &mut UnixStream) -> Result<Option<(Op, usize, u64)>, String> {
    let mut b = [0u8; CMD_BYTES];
    s.read_exact(&mut b).map_err(|e| format!("reading a command: {e}"))?;
    let word = |k: usize| u64::from_le_bytes(b[8 * k..8 * k + 8].try_into().unwrap());
    match word(0) {
        0 => Ok(None),
        k => {
            let op = *Op::ALL.get(k as usize - 1).ok_or_else(|| format!("bad op code {k}"))?;
            Ok(Some((op, word(1) as usize, word(2))))
        }
    }
}

/// The CPUs this process may run on, in increasing order (empty if unknown).
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data (a bit array), for which all zeroes is a valid value.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable cpu_set_t of the size passed.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Vec::new();
    }
    // SAFETY: CPU_ISSET only reads bit `cpu` of `set`, and cpu < CPU_SETSIZE, its size in bits.
    (0..libc::CPU_SETSIZE as usize).filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) }).collect()
}

/// Pins the calling process (its calling thread, the only one when this runs) to `cpu`.
fn pin_to(cpu: usize) {
    // SAFETY: as in `allowed_cpus`: all zeroes is a valid (empty) cpu_set_t.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` came from `allowed_cpus`, so it is below CPU_SETSIZE, the set's size in
    // bits; `set` is a valid cpu_set_t of the size passed to sched_setaffinity.
    let rc = unsafe {
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        eprintln!("collectives bench: cannot pin to CPU {cpu}: {}", std::io::Error::last_os_error());
    }
}

/// Rank 1, in the forked child: attaches, then runs commands until stop. Returns the exit
/// status; never unwinds into criterion (panics are caught by the caller).
fn serve(path: &std::path::Path, mut sock: UnixStream, parent: libc::pid_t, cpu: Option<usize>) -> i32 {
    if let Some(cpu) = cpu {
        pin_to(cpu);
    }
    // While waiting for rank 0 to attach, give up as soon as it is gone (we are then
    // re-parented); attach unlinks the segment file on this error.
    // SAFETY: getppid has no preconditions and cannot fail.
    let orphaned = move || unsafe { libc::getppid() } != parent;
    let mut comm = match Communicator::attach_with(path, 1, RANKS, Duration::from_secs(60), Some(&orphaned), &[], Default::default()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("collectives bench, rank 1: attach failed: {e}");
            return 1;
        }
    };
    let mut bufs = Buffers::new();
    loop {
        let r = match read_cmd(&mut sock) {
            Ok(Some((op, count, iters))) => bufs.run(&mut comm, op, count, iters), // fails if rank 0 died
            Ok(None) => return 0,
            Err(e) => Err(e), // end-of-file: rank 0 is gone
        };
        if let Err(e) = r {
            eprintln!("collectives bench, rank 1: {e}; exiting");
            return 1;
        }
    }
}

/// Rank 1 as seen from rank 0: the command socket and the child's pid. Dropping it
/// without `stop` (rank 0 panicked) kills and reaps the child, so none is left behind.
struct Peer {
    sock: UnixStream,
    pid: libc::pid_t,
    reaped: bool,
}

impl Peer {
    fn send(&mut self, cmd: Option<(Op, usize, u64)>) {
        self.sock.write_all(&encode(cmd)).expect("rank 1 is gone (command socket closed)");
    }

    /// Waits for rank 1 to end; its wait status.
    fn reap(&mut self) -> std::io::Result<i32> {
        let mut status = 0;
        // SAFETY: `pid` is our own child, not yet reaped; `status` is a valid out-pointer.
        let rc = unsafe { libc::waitpid(self.pid, &mut status, 0) };
        self.reaped = true;
        if rc == self.pid {
            Ok(status)
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Tells rank 1 to stop and reaps it; panics unless it exited with status 0.
    fn stop(mut self) {
        self.send(None);
        let status = self.reap().expect("waitpid");
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "rank 1 ended with wait status {status:#x}");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if !self.reaped {
            // SAFETY: `pid` is our own child and not yet reaped, so the pid cannot have been
            // reused by another process.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
            let _ = self.reap();
        }
    }
}

fn bench(c: &mut Criterion) {
    let dir = std::env::var("FLAGOS_SHM_DIR").unwrap_or_else(|_| "/dev/shm".into());
    let slot = std::env::var("FLAGOS_SHM_SLOT_BYTES").ok().and_then(|s| s.parse().ok()).unwrap_or(DEFAULT_SLOT_BYTES);
    let bind = std::env::var("FLAGOS_SHM_BENCH_BIND").map_or(true, |v| v != "0");
    let cpus = if bind { allowed_cpus() } else { Vec::new() };
    let cpu = |rank: usize| (cpus.len() >= RANKS).then(|| cpus[rank]);
    let path = segment::create(dir.as_ref(), RANKS, slot).expect("create segment");
    let (sock, child_sock) = UnixStream::pair().expect("socketpair");
    // SAFETY: getpid has no preconditions and cannot fail.
    let parent = unsafe { libc::getpid() };
    // Fork first thing in the bench function: criterion has started no thread yet (the
    // child of a multi-threaded process could find a lock, e.g. the allocator's, held by
    // a thread that does not exist in it), and rank 0 has not attached yet.
    // SAFETY: fork has no memory-safety preconditions; see above for why the child may go
    // on running ordinary Rust code (allocating, attaching).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        panic!("fork: {}", std::io::Error::last_os_error());
    }
    if pid == 0 {
        // Rank 1. Drop rank 0's end of the socket so that read sees end-of-file once rank 0
        // is gone; never return into criterion: leave with _exit, also on a panic.
        drop(sock);
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve(&path, child_sock, parent, cpu(1)))).unwrap_or(2);
        // SAFETY: _exit ends this process at once, without running the parent's atexit
        // handlers or flushing its copied stdio buffers.
        unsafe { libc::_exit(code) };
    }
    drop(child_sock);
    let mut peer = Peer { sock, pid, reaped: false };
    if let Some(cpu) = cpu(0) {
        pin_to(cpu);
    }
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
                    peer.send(Some((op, count, iters)));
                    let t = Instant::now();
                    bufs.run(&mut comm, op, count, iters).unwrap_or_else(|e| panic!("{e}"));
                    t.elapsed()
                })
            });
        }
        g.finish();
    }
    peer.stop();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
