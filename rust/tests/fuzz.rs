//! Fuzzing of everything a rank reads from shared memory that another process wrote
//! (issue 5, item 6): the segment header, the collective descriptors, and a live group
//! whose control blocks are scribbled over in the middle of collectives. The property in
//! every case: a bad value makes the call fail with an error, never a panic, a crash or a
//! read or write outside the mappings (which would kill this test process).
//!
//! Case counts: proptest's standard `PROPTEST_CASES` sets the number of cases of the pure
//! parser tests (default [`PARSER_CASES`]) and of the file-based header test (default
//! [`FILE_CASES`]); the live test ignores it and takes `FLAGOS_SHM_FUZZ_LIVE_CASES`
//! (default [`LIVE_CASES`]), since each of its cases costs milliseconds (up to a few
//! collective timeouts). The
//! defaults keep this file at a few seconds (well under 30 s) in `cargo test --release`. A long run:
//! `PROPTEST_CASES=200000 FLAGOS_SHM_FUZZ_LIVE_CASES=1000 cargo test --release --test fuzz -- --nocapture`
//! (each test prints its case count and time).

use flagos_shm::algorithms::{check_peer_desc, Desc, Transfer, ATTACH_STEPS};
use flagos_shm::reduce::{DType, ReduceOp};
use flagos_shm::segment::{self, Segment, DESC_WORDS, MAGIC, NAME_PREFIX, VERSION};
use flagos_shm::shm::file::HEADER_BYTES;
use flagos_shm::{Buf, Communicator, Error, Kind};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;
use common::TestDir;

const PARSER_CASES: u32 = 50_000;
const FILE_CASES: u32 = 5_000;
const LIVE_CASES: u32 = 128;

fn env_cases(var: &str, default: u32) -> u32 {
    std::env::var(var).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

/// Config for `default` cases unless `PROPTEST_CASES` says otherwise. No failure file:
/// proptest prints the shrunk failing input.
fn config(default: u32) -> Config {
    Config { cases: env_cases("PROPTEST_CASES", default), failure_persistence: None, ..Config::default() }
}

/// Counts cases of one test and prints the count and time when dropped.
struct Tally {
    name: &'static str,
    n: AtomicU64,
    /// Cases whose input was accepted (the rest were rejected with an error).
    ok: AtomicU64,
    start: Instant,
}
impl Tally {
    fn new(name: &'static str) -> Tally {
        Tally { name, n: AtomicU64::new(0), ok: AtomicU64::new(0), start: Instant::now() }
    }
    fn tick(&self, ok: bool) {
        self.n.fetch_add(1, Ordering::Relaxed);
        self.ok.fetch_add(ok as u64, Ordering::Relaxed);
    }
}
impl Drop for Tally {
    fn drop(&mut self) {
        let (n, ok) = (self.n.load(Ordering::Relaxed), self.ok.load(Ordering::Relaxed));
        eprintln!("fuzz {}: {n} cases ({ok} accepted, {} rejected) in {:.2} s", self.name, n - ok, self.start.elapsed().as_secs_f64());
    }
}

fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

fn tmpdir(tag: &str) -> TestDir {
    TestDir::new(&format!("fuzz_{tag}"))
}

// ----- (a) segment headers ------------------------------------------------------------

/// The segment size for `w` ranks and `slot` bytes per slot, derived from the layout in
/// the module docs of segment.rs (header line, group line, one 256-byte control block
/// per rank, rounded up to a page; then two slots per rank), in u128 so nothing wraps.
fn layout_total(w: u128, slot: u128) -> u128 {
    let ctrl_end = 128 + 128 + 256 * w;
    ctrl_end.div_ceil(4096) * 4096 + 2 * w * slot
}

/// The header fields, as a forger would set them.
#[derive(Clone, Debug)]
struct Fields {
    magic: u64,
    version: u32,
    world: u32,
    slot: u64,
    total: u64,
    uid: u32,
    pid: u32,
}

impl Fields {
    fn bytes(&self) -> [u8; HEADER_BYTES] {
        let mut b = segment::encode_header(self.world, self.slot, self.total, self.uid, self.pid);
        b[0..8].copy_from_slice(&self.magic.to_ne_bytes());
        b[8..12].copy_from_slice(&self.version.to_ne_bytes());
        b
    }
    fn from_bytes(b: &[u8; HEADER_BYTES]) -> Fields {
        let u32_at = |o: usize| u32::from_ne_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_ne_bytes(b[o..o + 8].try_into().unwrap());
        Fields {
            magic: u64_at(0),
            version: u32_at(8),
            world: u32_at(12),
            slot: u64_at(16),
            total: u64_at(24),
            uid: u32_at(32),
            pid: u32_at(36),
        }
    }
}

/// Whether an attaching rank of a `world`-rank group must accept this header in a file of
/// `file_len` bytes (the rules of the issue, written out independently of segment.rs).
fn oracle(f: &Fields, world: usize, file_len: u64) -> bool {
    let slot = f.slot as u128;
    file_len >= HEADER_BYTES as u64
        && (1..=4096).contains(&world)
        && f.magic == u64::from_le_bytes(*b"FLGOSSHM")
        && f.version == VERSION
        && f.world as usize == world
        && f.uid == uid()
        && slot % 4096 == 0
        && (4096..=1 << 30).contains(&slot)
        && slot >= 64 * world as u128
        && f.total as u128 == layout_total(world as u128, slot)
        && file_len as u128 == layout_total(world as u128, slot)
}

/// A valid header for 1..=4 ranks, then zero or more mutations: bit flips, one field set
/// to a random value, or every byte random.
fn header_strategy() -> impl Strategy<Value = Fields> {
    let valid = (1u32..=4, 1u64..=4, any::<u32>()).prop_map(|(w, k, pid)| {
        let slot = k * 4096;
        Fields { magic: MAGIC, version: VERSION, world: w, slot, total: layout_total(w as u128, slot as u128) as u64, uid: uid(), pid }
    });
    let mutation = prop_oneof![
        3 => Just(None),
        3 => prop::collection::vec((0usize..HEADER_BYTES, 0u8..8), 1..4).prop_map(Some),
    ];
    let field = prop_oneof![
        4 => Just(None),
        1 => (0usize..7, any::<u64>(), prop_oneof![Just(0u64), Just(1), Just(u64::MAX), Just(4096), Just(1 << 30), Just((1 << 30) + 4096), any::<u64>()])
            .prop_map(|(i, r, special)| Some((i, if r % 2 == 0 { r } else { special }))),
    ];
    let random = prop::array::uniform32(any::<u8>()).prop_flat_map(|a| prop::array::uniform8(any::<u8>()).prop_map(move |b| (a, b)));
    (valid, mutation, field, any::<bool>(), random).prop_map(|(mut f, flips, field, all_random, (a, b))| {
        if let Some((i, v)) = field {
            match i {
                0 => f.magic = v,
                1 => f.version = v as u32,
                2 => f.world = v as u32,
                3 => f.slot = v,
                4 => f.total = v,
                5 => f.uid = v as u32,
                _ => f.pid = v as u32,
            }
        }
        let mut bytes = f.bytes();
        for (i, bit) in flips.into_iter().flatten() {
            bytes[i] ^= 1 << bit;
        }
        if all_random && a[0] < 16 {
            bytes[..32].copy_from_slice(&a);
            bytes[32..].copy_from_slice(&b);
        }
        Fields::from_bytes(&bytes)
    })
}

/// The file length to pair with a header: mostly what the header says, else near it,
/// truncated (shorter than the header itself), or random.
fn file_len_strategy(total: u64) -> impl Strategy<Value = u64> {
    let t = total.min(1 << 32);
    prop_oneof![
        6 => Just(t),
        2 => (-8192i64..8192).prop_map(move |d| t.saturating_add_signed(d)),
        1 => 0u64..=HEADER_BYTES as u64 + 8,
        1 => 0u64..(1 << 20),
    ]
}

fn expected_world() -> impl Strategy<Value = usize> {
    prop_oneof![8 => 1usize..=4, 1 => Just(0usize), 1 => 5usize..=5000, 1 => Just(usize::MAX)]
}

#[test]
fn random_headers_validate_only_when_valid() {
    let tally = Tally::new("validate_header (pure)");
    let strat = (header_strategy(), prop_oneof![Just(None), any::<u64>().prop_map(Some)]).prop_flat_map(|(f, weird_len)| {
        // Mostly the group size the header names, so that the later checks get exercised.
        let w = prop_oneof![2 => Just(f.world as usize), 1 => expected_world()];
        (Just(f.clone()), w, file_len_strategy(f.total), Just(weird_len))
    });
    proptest!(config(PARSER_CASES), |((f, w, len, weird_len) in strat)| {
        let file_len = weird_len.filter(|v| v % 8 == 0).unwrap_or(len);
        let bytes = f.bytes();
        // The header as far as the file holds it.
        let raw = &bytes[..(file_len.min(HEADER_BYTES as u64) as usize)];
        let r = segment::validate_header(raw, w, uid(), file_len);
        let want = oracle(&f, w, file_len);
        tally.tick(want);
        prop_assert_eq!(r.is_ok(), want, "{:?} world {} len {}: {:?}", f, w, file_len, r);
        match r {
            Ok(g) => {
                prop_assert_eq!((g.count, g.slot_bytes, g.total_bytes as u64), (w, f.slot as usize, file_len));
            }
            Err(Error::InvalidArgument(m)) => prop_assert!(!m.is_empty()),
            Err(e) => prop_assert!(false, "unexpected error kind {:?}", e),
        }
    });
}

/// Writes `bytes` (cut to `len` if shorter) into a fresh file of `len` bytes with `mode`.
fn write_segment_file(path: &Path, bytes: &[u8], len: u64, mode: u32) {
    let _ = std::fs::remove_file(path);
    let f = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(path).unwrap();
    use std::io::Write;
    (&f).write_all(&bytes[..bytes.len().min(len as usize)]).unwrap();
    f.set_len(len).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn random_header_files_open_only_when_valid() {
    let tally = Tally::new("Segment::open on header files");
    let dir = tmpdir("files");
    let path = dir.join(format!("{NAME_PREFIX}fuzz"));
    let modes = prop_oneof![6 => Just(0o600u32), 1 => Just(0o700), 1 => Just(0o640), 1 => Just(0o606), 1 => Just(0o660)];
    let strat = (header_strategy(), modes).prop_flat_map(|(f, mode)| {
        let w = prop_oneof![2 => Just((f.world as usize).clamp(1, 4)), 1 => 1usize..=4];
        (Just(f.clone()), w, file_len_strategy(f.total), Just(mode))
    });
    proptest!(config(FILE_CASES), |((f, w, len, mode) in strat)| {
        write_segment_file(&path, &f.bytes(), len, mode);
        let r = Segment::open(&path, w);
        let want = oracle(&f, w, len) && mode & 0o077 == 0;
        tally.tick(want);
        prop_assert_eq!(r.is_ok(), want, "{:?} world {} len {} mode {:o}: {:?}", f, w, len, mode, r.as_ref().err());
        if let Ok(seg) = &r {
            // The mapping is exactly the file: nothing past its end can be addressed.
            prop_assert_eq!(seg.len() as u64, len);
            prop_assert_eq!((seg.world_size(), seg.slot_bytes()), (w, f.slot as usize));
            // Every slot lies inside the mapping.
            let base = seg.slot(0, 0) as usize - segment::data_offset(w);
            let last = seg.slot(w - 1, 1) as usize + seg.slot_bytes();
            prop_assert!(last - base <= seg.len());
        } else if let Err(e) = &r {
            prop_assert!(e.to_string().contains(path.to_str().unwrap()), "error does not name the file: {}", e);
        }
    });
    let _ = std::fs::remove_file(&path);
    std::fs::remove_dir(&dir).unwrap();
}

// ----- (b) descriptors ----------------------------------------------------------------

/// A descriptor a well-behaved rank of a `world`-rank group could publish.
fn local_desc(world: usize) -> impl Strategy<Value = Desc> {
    (
        (0..Kind::ALL.len(), 0..DType::ALL.len(), 0..ReduceOp::ALL.len(), any::<u64>(), 0..world as u64, any::<u64>(), any::<u64>()),
        (0..Transfer::ALL.len(), any::<u64>()),
    )
        .prop_map(|((k, d, o, count, root, seq, factor), (path, chunk))| Desc {
            kind: Kind::ALL[k] as u8,
            dtype: DType::ALL[d] as u32,
            op: ReduceOp::ALL[o] as u32,
            flags: 0,
            count: count >> (count % 64),
            root,
            seq: seq % 1000,
            factor,
            path: Transfer::ALL[path] as u8,
            chunk,
        })
}

/// What a peer's control block holds: our own words, our words with a few bits flipped
/// or a word replaced, or random words.
fn peer_words(mine: [u64; DESC_WORDS]) -> impl Strategy<Value = [u64; DESC_WORDS]> {
    prop_oneof![
        2 => Just(mine),
        4 => prop::collection::vec((0..DESC_WORDS, 0u32..64), 1..3).prop_map(move |flips| {
            let mut w = mine;
            for (i, b) in flips {
                w[i] ^= 1 << b;
            }
            w
        }),
        2 => (0..DESC_WORDS, any::<u64>()).prop_map(move |(i, v)| {
            let mut w = mine;
            w[i] = v;
            w
        }),
        2 => prop::array::uniform7(any::<u64>()),
    ]
}

#[test]
fn random_descriptors_match_only_when_equal() {
    let tally = Tally::new("Desc::decode + check_peer_desc");
    let strat =
        (1usize..=4).prop_flat_map(|n| (Just(n), local_desc(n))).prop_flat_map(|(n, mine)| (Just(n), Just(mine), peer_words(mine.words())));
    proptest!(config(PARSER_CASES), |((n, mine, words) in strat)| {
        tally.tick(words == mine.words());
        // A local descriptor decodes to itself.
        prop_assert_eq!(Desc::decode(mine.words(), n).ok(), Some(mine));
        // Decoding is exact: whatever decodes re-encodes to the same words.
        match Desc::decode(words, n) {
            Ok(d) => {
                prop_assert_eq!(d.words(), words);
                prop_assert!((d.root as usize) < n);
            }
            Err(Error::Mismatch(m)) => prop_assert!(m.starts_with("malformed descriptor")),
            Err(e) => prop_assert!(false, "unexpected error kind {:?}", e),
        }
        let r = check_peer_desc(&mine, 0, n - 1, words, n);
        prop_assert_eq!(r.is_ok(), words == mine.words(), "{:x?} vs {:x?}: {:?}", words, mine.words(), r);
        if let Err(e) = r {
            prop_assert!(matches!(&e, Error::Mismatch(_) | Error::Disagree { .. }) && e.to_string().contains(&format!("rank {}", n - 1)), "{}", e);
        }
        // A failing rank (flags = FAIL) accepts anything: its caller raises its own error.
        let failing = Desc { flags: 1, ..mine };
        prop_assert!(check_peer_desc(&failing, 0, n - 1, words, n).is_ok());
    });
}

// ----- (c) a live group under attack --------------------------------------------------

/// Which word the attacker scribbles over.
#[derive(Clone, Copy, Debug)]
enum Target {
    None,
    Arrived(usize),
    Pid(usize),
    Cpu(usize),
    Desc(usize, usize, usize),
    Attached,
    Aborted,
    Wake,
    Sleepers,
}

fn target_strategy() -> impl Strategy<Value = Target> {
    prop_oneof![
        1 => Just(Target::None),
        3 => (0usize..2).prop_map(Target::Arrived),
        2 => (0usize..2).prop_map(Target::Pid),
        1 => (0usize..2).prop_map(Target::Cpu),
        4 => (0usize..2, 0usize..2, 0..DESC_WORDS).prop_map(|(r, p, i)| Target::Desc(r, p, i)),
        1 => Just(Target::Attached),
        1 => Just(Target::Aborted),
        1 => Just(Target::Wake),
        1 => Just(Target::Sleepers),
    ]
}

/// Runs collective `op` (0..8) with `count` elements on `comm`; returns the result and,
/// for allreduce, the output.
fn run_op(comm: &mut Communicator, op: u8, count: usize, root: usize) -> (Result<(), Error>, Vec<f32>) {
    let n = comm.world_size();
    let me = comm.rank();
    let input: Vec<f32> = (0..n * count).map(|i| (me * 1000 + i) as f32).collect();
    let mut out = vec![0f32; n * count];
    if op == 1 {
        out[..count].copy_from_slice(&input[..count]);
    }
    let (i, o) = (Buf::from_elems(&input), Buf::from_elems_mut(&mut out));
    let r = match op {
        0 => comm.barrier(),
        1 => comm.allreduce(o, count, DType::F32, ReduceOp::Sum, 1.0),
        2 => comm.broadcast(o, count, DType::F32, root),
        3 => comm.allgather(i, o, count, DType::F32),
        4 => comm.reduce_scatter(i, o, count, DType::F32, ReduceOp::Max, 1.0),
        5 => comm.alltoall(i, o, count, DType::F32),
        6 => comm.scatter(i, o, count, DType::F32, root),
        _ => comm.gather(i, o, count, DType::F32, root),
    };
    (r, out)
}

const LIVE_TIMEOUT: Duration = Duration::from_millis(100);
/// Times each rank runs its script of collectives in one case.
const ROUNDS: usize = 40;

#[test]
fn a_scribbling_peer_makes_collectives_fail_not_crash() {
    let tally = Tally::new("live group with a scribbled control block");
    // First error of each case by (error kind, target): printed, to show what the attack did.
    let first_errors = std::sync::Mutex::new(std::collections::BTreeMap::<String, u64>::new());
    let dir = tmpdir("live");
    let ops = prop::collection::vec((0u8..8, prop_oneof![Just(1usize), 1usize..2000], 0usize..2), 1..6);
    let garbage = prop_oneof![any::<u64>(), (0u64..8), Just(u64::MAX), Just(i32::MAX as u64 + 1)];
    let strat = (target_strategy(), garbage, 0u64..500, ops);
    // Shrinking re-runs whole cases, each up to seconds: keep it short.
    let cfg = Config { cases: env_cases("FLAGOS_SHM_FUZZ_LIVE_CASES", LIVE_CASES), max_shrink_iters: 16, ..config(0) };
    // TestRunner::new, unlike the proptest! macro, leaves PROPTEST_CASES out: a long run
    // of the parsers need not make this test run for hours.
    let mut runner = TestRunner::new(cfg);
    let outcome = runner.run(&strat, |(target, value, delay_us, ops)| {
        let start = Instant::now();
        let path = segment::create(&dir, 2, 4096).unwrap();
        // The attacker maps the segment before it is unlinked, like a third process would.
        let evil = Segment::open(&path, 2).unwrap();
        let gate = Arc::new(std::sync::Barrier::new(3)); // 2 ranks + the attacker
        let done = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(ops);
        let ranks: Vec<_> = (0..2)
            .map(|r| {
                let (p, gate, ops) = (path.clone(), Arc::clone(&gate), Arc::clone(&ops));
                std::thread::spawn(move || {
                    let mut c = Communicator::attach(&p, r, 2, Duration::from_secs(10)).unwrap();
                    c.set_timeout(LIVE_TIMEOUT);
                    gate.wait();
                    // Repeat the script so the attack lands in the middle of collectives.
                    (0..ROUNDS).flat_map(|_| ops.iter()).map(|&(op, count, root)| run_op(&mut c, op, count, root)).collect::<Vec<_>>()
                })
            })
            .collect();
        // Keep writing the garbage until the ranks are done: a peer that keeps lying.
        let attacker = {
            let (done, gate) = (Arc::clone(&done), Arc::clone(&gate));
            std::thread::spawn(move || {
                gate.wait();
                std::thread::sleep(Duration::from_micros(delay_us));
                while !done.load(Ordering::Relaxed) {
                    match target {
                        Target::None => {}
                        Target::Arrived(r) => evil.ctrl(r).arrived.store(value, Ordering::Release),
                        Target::Pid(r) => evil.ctrl(r).pid.store(value as u32, Ordering::Release),
                        Target::Cpu(r) => evil.ctrl(r).cpu.store(value as u32, Ordering::Release),
                        Target::Desc(r, p, i) => evil.ctrl(r).desc[p][i].store(value, Ordering::Release),
                        Target::Attached => evil.group().attached.store(value as u32, Ordering::Release),
                        Target::Aborted => evil.group().aborted.store(value as u32, Ordering::Release),
                        Target::Wake => evil.group().wake.store(value as u32, Ordering::Release),
                        Target::Sleepers => evil.group().sleepers.store(value as u32, Ordering::Release),
                    }
                    std::thread::yield_now();
                }
            })
        };
        let results: Vec<_> = ranks.into_iter().map(|h| h.join()).collect();
        done.store(true, Ordering::Relaxed);
        attacker.join().unwrap();
        prop_assert!(!path.exists());
        // A rank thread that panicked would be a failure (across FFI, a crash).
        let results: Vec<_> = results.into_iter().map(|r| r.expect("a rank panicked")).collect();
        // Each call ends within its timeout (plus slack for 2 busy cores), so a garbage
        // word never makes a rank hang.
        // Each wait ends at its timeout, and after the first timeout or abort the group is
        // broken and later calls fail at once; other errors (mismatch) leave it usable.
        let bound = LIVE_TIMEOUT * 4 * (ROUNDS * ops.len()) as u32 + Duration::from_secs(2);
        prop_assert!(start.elapsed() < bound, "took {:?}", start.elapsed());
        if start.elapsed() > Duration::from_secs(1) {
            eprintln!(
                "fuzz live: slow case ({:.1} s): {target:?} = {value:#x} after {delay_us} us, script {ops:?}",
                start.elapsed().as_secs_f64()
            );
        }
        tally.tick(results.iter().flatten().all(|(r, _)| r.is_ok()));
        if let Some(Err(e)) = results.iter().flatten().map(|(r, _)| r).find(|r| r.is_err()) {
            let name = |d: String| d.split('(').next().unwrap_or("?").to_string();
            *first_errors
                .lock()
                .unwrap()
                .entry(format!("{} (garbage in {})", name(format!("{e:?}")), name(format!("{target:?}"))))
                .or_insert(0) += 1;
        }
        for (r, res) in results.iter().enumerate() {
            for (k, (res, out)) in res.iter().enumerate() {
                match res {
                    Ok(()) => {}
                    Err(e) => prop_assert!(!e.to_string().is_empty()),
                }
                // Untouched, every call succeeds with the right numbers.
                if matches!(target, Target::None) {
                    prop_assert!(res.is_ok(), "rank {} call {}: {:?}", r, k, res);
                    let (op, count, _) = ops[k % ops.len()];
                    if op == 1 {
                        let want: Vec<f32> = (0..count).map(|i| (i + 1000 + i) as f32).collect();
                        prop_assert_eq!(&out[..count], &want[..]);
                    }
                }
            }
        }
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "segment files left behind");
    std::fs::remove_dir(&dir).unwrap();
    for (k, v) in first_errors.lock().unwrap().iter() {
        eprintln!("fuzz live: {v:5} cases failed first with {k}");
    }
}

/// A counter far outside the protocol's range stops the wait with an error naming the
/// rank, instead of letting the rank read a peer's slot before it was written.
#[test]
fn a_forged_arrival_counter_is_reported() {
    let dir = tmpdir("forged");
    let path = segment::create(&dir, 2, 4096).unwrap();
    let evil = Segment::open(&path, 2).unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (attached_tx, attached_rx) = std::sync::mpsc::channel::<()>();
    let p1 = path.clone();
    let t = std::thread::spawn(move || {
        let mut c = Communicator::attach(&p1, 1, 2, Duration::from_secs(10)).unwrap();
        attached_tx.send(()).unwrap();
        rx.recv().unwrap(); // rank 0 has seen the forged counter
        c.barrier()
    });
    let mut c = Communicator::attach(&path, 0, 2, Duration::from_secs(10)).unwrap();
    // Forge only once rank 1 is through attach (whose probe steps check counters too).
    attached_rx.recv().unwrap();
    c.set_timeout(Duration::from_secs(5));
    // Rank 1 "arrives" at step 1000 before anyone called anything.
    evil.ctrl(1).arrived.store(1000, Ordering::Release);
    let e = c.barrier().unwrap_err();
    tx.send(()).unwrap();
    let (lo, hi) = (ATTACH_STEPS, ATTACH_STEPS + 2); // the barrier is step ATTACH_STEPS + 1
    let want = format!("rank 1's control block is corrupt: arrival counter 1000, expected {lo}..={hi}");
    assert!(matches!(&e, Error::Aborted(m) if m.contains(&want)), "{e}");
    // Rank 0 aborted the group, so rank 1's next call fails too.
    let e1 = t.join().unwrap().unwrap_err();
    assert!(matches!(e1, Error::Aborted(_)), "{e1}");
    std::fs::remove_dir(&dir).unwrap();
}

/// A malformed descriptor is a `Mismatch` naming the rank, raised before any data moves.
#[test]
fn a_forged_descriptor_is_reported() {
    let dir = tmpdir("forged_desc");
    let path = segment::create(&dir, 2, 4096).unwrap();
    let evil = Segment::open(&path, 2).unwrap();
    let p1 = path.clone();
    // Rank 1 attaches but never calls anything; the test plays its part in the segment.
    let t = std::thread::spawn(move || Communicator::attach(&p1, 1, 2, Duration::from_secs(10)).unwrap());
    let mut c = Communicator::attach(&path, 0, 2, Duration::from_secs(10)).unwrap();
    let _c1 = t.join().unwrap();
    c.set_timeout(Duration::from_secs(5));
    // The barrier's step (ATTACH_STEPS + 1) uses descriptor parity 1: an unknown kind
    // (0xff), then the arrival.
    let step = ATTACH_STEPS + 1;
    let parity = (step % 2) as usize;
    let honest = Desc {
        kind: Kind::Barrier as u8,
        dtype: DType::U8 as u32,
        op: 0,
        flags: 0,
        count: 0,
        root: 0,
        seq: 0,
        factor: 0,
        path: 0,
        chunk: 0,
    };
    let mut lie = honest.words();
    lie[0] |= 0xff;
    for (w, v) in evil.ctrl(1).desc[parity].iter().zip(lie) {
        w.store(v, Ordering::Relaxed);
    }
    evil.ctrl(1).arrived.store(step, Ordering::Release);
    let e = c.barrier().unwrap_err();
    assert!(matches!(&e, Error::Mismatch(m) if m.contains("rank 1 published a malformed descriptor: unknown collective kind 255")), "{e}");
    // With the honest words the same step matches.
    for (w, v) in evil.ctrl(1).desc[1 - parity].iter().zip(Desc { seq: 1, ..honest }.words()) {
        w.store(v, Ordering::Relaxed);
    }
    evil.ctrl(1).arrived.store(step + 1, Ordering::Release);
    c.barrier().unwrap();
    std::fs::remove_dir(&dir).unwrap();
}

// ----- (4) names, permissions, identity -----------------------------------------------

#[test]
fn segment_names_are_random_and_files_private() {
    let dir = tmpdir("names");
    let mut names = std::collections::HashSet::new();
    for _ in 0..32 {
        let p = segment::create(&dir, 2, 4096).unwrap();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        let hex = name.strip_prefix(NAME_PREFIX).unwrap();
        // 32 hex digits = 128 bits from getrandom.
        assert!(hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()), "{name}");
        let meta = std::fs::symlink_metadata(&p).unwrap();
        assert!(meta.file_type().is_file());
        assert_eq!(meta.mode() & 0o7777, 0o600);
        assert_eq!(meta.uid(), uid());
        assert!(names.insert(hex.to_string()), "name repeated");
        std::fs::remove_file(&p).unwrap();
    }
    std::fs::remove_dir(&dir).unwrap();
}

/// Each way of attaching to the wrong file fails with an error that says why.
#[test]
fn attaching_to_a_wrong_segment_fails_with_a_clear_error() {
    let dir = tmpdir("wrong");
    let slot = 4096u64;
    let total = segment::segment_bytes(2, slot as usize) as u64;
    let path = dir.join(format!("{NAME_PREFIX}wrong"));
    let good = segment::encode_header(2, slot, total, uid(), std::process::id());
    let attach = |bytes: &[u8], len: u64, world: usize| {
        write_segment_file(&path, bytes, len, 0o600);
        Communicator::attach(&path, 0, world, Duration::from_millis(50)).err().expect("attach must fail").to_string()
    };
    let mut b = good;
    b[0] ^= 1;
    assert!(attach(&b, total, 2).contains("bad magic"));
    let mut b = good;
    b[8..12].copy_from_slice(&(VERSION + 1).to_ne_bytes());
    assert!(attach(&b, total, 2).contains(&format!("protocol version {} but this build speaks {VERSION}", VERSION + 1)));
    assert!(attach(&good, total, 3).contains("created for 2 ranks but this group has 3"));
    let other = segment::encode_header(2, slot, total, uid().wrapping_add(1), 1);
    assert!(attach(&other, total, 2).contains(&format!("created by uid {}", uid().wrapping_add(1))));
    assert!(attach(&good, total - 4096, 2).contains("does not match its header"));
    assert!(attach(&good, 20, 2).contains("too small"));
    let huge = segment::encode_header(2, 1 << 40, total, uid(), 1);
    assert!(attach(&huge, total, 2).contains("slot_bytes"));
    // Owned by another uid: only root can make such a file here.
    if uid() == 0 {
        write_segment_file(&path, &good, total, 0o600);
        std::os::unix::fs::chown(&path, Some(12345), None).unwrap();
        let e = Communicator::attach(&path, 0, 2, Duration::from_millis(50)).err().unwrap().to_string();
        assert!(e.contains("owned by uid 0") && e.contains("found uid 12345"), "{e}");
    }
    // A link to a segment is not followed.
    let real = segment::create(&dir, 2, 4096).unwrap();
    let link = dir.join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let e = Communicator::attach(&link, 0, 2, Duration::from_millis(50)).err().unwrap().to_string();
    assert!(e.contains("cannot open"), "{e}");
    assert!(real.exists(), "a failed attach through a link removed its target");
    std::fs::remove_file(&link).unwrap();
    std::fs::remove_file(&real).unwrap();
    let _ = std::fs::remove_file(&path);
    std::fs::remove_dir(&dir).unwrap();
}

/// The path comes from the c10d store: a failed attach must not delete a file that is not
/// a segment.
#[test]
fn a_failed_attach_removes_only_segment_files() {
    let dir = tmpdir("keep");
    let precious = dir.join("precious.txt");
    std::fs::write(&precious, b"not a segment").unwrap();
    std::fs::set_permissions(&precious, std::fs::Permissions::from_mode(0o600)).unwrap();
    let e = Communicator::attach(&precious, 0, 2, Duration::from_millis(50)).err().unwrap();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("too small")), "{e}");
    assert!(precious.exists(), "attach deleted a file that is not a segment");
    let e = Communicator::attach(&precious, 5, 2, Duration::from_millis(50)).err().unwrap();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.starts_with("rank")), "{e}");
    assert!(precious.exists());
    std::fs::remove_file(&precious).unwrap();
    // A segment that fails validation is still removed, so it does not leak.
    let seg = segment::create(&dir, 2, 4096).unwrap();
    assert!(Communicator::attach(&seg, 0, 3, Duration::from_millis(50)).is_err());
    assert!(!seg.exists());
    std::fs::remove_dir(&dir).unwrap();
}
