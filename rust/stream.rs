//! Copies into the slots: plain or streaming (non-temporal) stores, chosen per rank by
//! timing the calls ([`Streamer`]).
//!
//! A rank's slot is read by every peer at each step and written again by its owner two
//! steps later. A plain store to a line a peer still holds is a read-for-ownership: the
//! line is fetched from the peer's cache and the peer's copy invalidated, one line at a
//! time. Where that is cheap depends on where the hypervisor has put the ranks' vCPUs,
//! and that changes while a job runs. On the AMD EPYC 2-vCPU VM (2026-12-02,
//! `benches/placement_probe.c`: one process writes 512 KiB into a shared buffer the other
//! has just read, the other reads it; medians of 41 rounds, samples 2 s apart) a plain
//! `memcpy` of 512 KiB into such lines took 51-71 us in the ordinary placement (15-17 us
//! into lines nobody else holds) and 150-300 us in a slow one that came and went every few
//! seconds, 15-55 % of the samples in four runs that night. Streaming stores write whole
//! lines without fetching them: 19-40 us in both placements, while the reader's copy, from memory
//! instead of the writer's cache, took 34-55 us instead of 11-36. Through the slot
//! algorithms (`benches/stream_ab.py`, 1 MiB, two ranks): allgather 38-48 us plain and
//! 75-100 us streaming in the ordinary placement, 300-370 us plain and 60-95 us streaming
//! in the slow one. Neither kind wins everywhere, hence [`Mode::Auto`].
//!
//! Streaming stores are weakly ordered: they may become visible after later ordinary
//! stores, including the Release store of the rank's arrival counter. [`copy_to_slot`]
//! therefore ends with `sfence`, which orders every streaming store before any later
//! store (see "Memory ordering" in [`crate::sync`]).
//!
//! Only x86-64 has them here (SSE2, part of the x86-64 baseline, so no feature detection
//! is needed); elsewhere [`copy_to_slot`] is a plain copy. The reductions still write
//! their results with plain stores (the two-step allreduce's reduced slice, which peers
//! read from its slot).

/// How a communicator copies into its slot (`crate::group::Settings::stream`, given at
/// attach; the Python side reads it from `FLAGOS_SHM_STREAM`: `auto`, the default;
/// `1`/`on`/`always`; `0`/`off`/`never`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Plain stores always.
    Plain,
    /// Streaming stores for every copy of at least [`MIN_BYTES`].
    Stream,
    /// Whichever is faster now ([`Streamer`]).
    Auto,
}

/// A single-copy allgather's or all-to-all's copy of its own piece (from its input into its
/// output, in this process) uses streaming stores from this many bytes on, in modes
/// [`Mode::Auto`] and [`Mode::Stream`]
/// (`crate::group::Communicator::streams_local`): the output is far larger than the L2
/// then, so a plain store's read-for-ownership only adds memory traffic. On the Intel Xeon
/// 2-vCPU VM (Sapphire Rapids class, 2 MiB L2 per core, 2026-12-05, two ranks pinned,
/// median of four interleaved rounds) streaming took a 64 MiB `all_gather_into_tensor` from
/// 8826 to 7936 us and a 64 MiB `all_to_all_single` from 10513 to 8898 us (32 MiB pieces).
/// On another VM of that type (260 MiB L3; 2026-12-05 23:05 UTC, alternating runs of five
/// rounds, medians of 40-60 calls) it also took 16 MiB (8 MiB pieces) from 1440 to 1340
/// us, both ops, two runs of two, and 8 MiB (4 MiB pieces) from 700 to 635-645 us in two
/// runs of three (the third within 1 %); at 4 MiB (2 MiB pieces, the L2's size) the two
/// kinds were within 10 % either way and at 1 MiB plain stores were faster (66 against
/// 70-106 us), so the threshold is 4 MiB: twice the L2. Not measured on the AMD EPYC VM.
pub const LOCAL_MIN_BYTES: usize = 4 << 20;
/// In a group of one rank, the copy of an allgather's, gather's, scatter's or all-to-all's
/// whole message (input to output, `crate::algorithms`, "n = 1") uses streaming stores from
/// this many bytes on, in modes [`Mode::Auto`] and [`Mode::Stream`]: from where its source
/// and destination together no longer fit the L2, a plain store's read-for-ownership
/// fetches every destination line from further out. On the Intel Xeon 2-vCPU VM (2 MiB
/// L2 per core, 260 MiB L3; 2026-12-06, one process pinned, a scratch build streaming
/// from 4 KiB, `all_gather_into_tensor` and `all_to_all_single` through `dist.*` in a group
/// of plain stores and one of streaming stores, alternated, median of ten rounds of
/// medians) streaming took 1 MiB from 50-52 to 55-58 us, tied at 1088 KiB (0.97-0.99 of
/// plain), won from 1152 KiB (67-72 against 64-66 us) and by 20-30 % from 1.5 MiB to
/// 64 MiB (2 MiB 162-167 against 118-121 us, 16 MiB 1305 against 1045-1048, 64 MiB
/// 5285-5541 against 4226-4241). Both ops gave the same figures. Not measured on the AMD
/// EPYC VM.
pub const ALONE_MIN_BYTES: usize = 1152 << 10;
/// Copies into a slot smaller than this stay plain in every mode (a few lines).
pub const MIN_BYTES: usize = 4 << 10;
/// In [`Mode::Auto`], calls moving fewer bytes than this (S, as the plan counts them)
/// copy plainly and are not timed.
pub const MIN_CALL_BYTES: usize = 32 << 10;
/// In [`Mode::Auto`], every this-many-th call of a size class is a probe, which every
/// rank makes with the same kind of store, plain and streaming in turn: so each kind is
/// timed every `2 * PROBE_EVERY` calls in a call where all ranks used it. The probe of the
/// kind not chosen costs at most the difference between the two, once in that many calls.
pub const PROBE_EVERY: u32 = 8;
/// In [`Mode::Auto`], a size class changes kind when the other kind's estimate is
/// faster by this factor (the gap keeps noise from flipping the choice).
pub const SWITCH: f64 = 1.15;
/// Size classes: S of 2^15 bytes (the first at [`MIN_CALL_BYTES`]) up to 2^30 and above.
const CLASSES: usize = 16;

impl Mode {
    /// `"plain"`, `"stream"` or `"auto"`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Plain => "plain",
            Mode::Stream => "stream",
            Mode::Auto => "auto",
        }
    }

    /// The mode whose [`Self::name`] is `name`, or None.
    pub fn from_name(name: &str) -> Option<Mode> {
        [Mode::Plain, Mode::Stream, Mode::Auto].into_iter().find(|m| m.name() == name)
    }
}

/// Per-byte time estimates (ns) of one (collective, size class), for each kind of store.
#[derive(Clone, Copy, Debug, Default)]
struct Estimate {
    /// The last probe's time per byte of each kind (0: none yet).
    plain: f64,
    stream: f64,
    /// Calls of this class that succeeded.
    calls: u32,
    streaming: bool,
}

/// One rank's choice between plain and streaming stores for its copies into its slot.
///
/// Which is faster depends on where the hypervisor has put the ranks' CPUs, and that
/// changes while a job runs (module docs). The writer alone cannot tell: its own
/// streaming copy is always the faster one (19-40 us against 51-300 us for 512 KiB), and
/// what streaming costs is the readers' fetch from memory. So whole calls are timed.
///
/// In [`Mode::Auto`], the calls of at least [`MIN_CALL_BYTES`] are counted per
/// collective kind and size class (S rounded down to a power of two), and every
/// [`PROBE_EVERY`]-th is a probe: all ranks make it with the same kind of store (plain and
/// streaming in turn) and time it from the start of the collective to its end. Each
/// class starts plain and streams once the last streaming probe was [`SWITCH`] times
/// faster than the last plain one, until the reverse. The probes are what every rank
/// does together, because the two kinds interact: when the peers stream, a rank that
/// stores plainly still reads their slots from memory, so only calls where all ranks
/// made the same choice tell which choice is better. Every rank counts the same calls
/// and times nearly the same calls (a collective ends at about the same time on every
/// rank), so the ranks choose alike; should one differ, nothing breaks: the peers read
/// the same bytes either way, and no protocol step depends on the kind of store.
#[derive(Clone, Debug)]
pub struct Streamer {
    mode: Mode,
    classes: Vec<Estimate>,
    /// The call in progress: its class, whether it streams, whether it is a probe, its S
    /// (bytes), its start.
    current: Option<(usize, bool, bool, usize, std::time::Instant)>,
}

impl Streamer {
    /// A streamer in `mode`.
    pub fn new(mode: Mode) -> Streamer {
        Streamer { mode, classes: vec![Estimate::default(); 16 * CLASSES], current: None }
    }

    fn class(kind: usize, bytes: usize) -> usize {
        let log = (usize::BITS - 1 - bytes.max(1).leading_zeros()) as usize; // floor(log2)
        (kind % 16) * CLASSES + log.clamp(15, 15 + CLASSES - 1) - 15
    }

    /// Starts a collective of kind code `kind` moving `bytes` (S): chooses the kind of
    /// store its copies into the slot use and, in [`Mode::Auto`], starts its clock.
    pub fn begin(&mut self, kind: usize, bytes: usize) {
        self.current = None;
        if self.mode != Mode::Auto || bytes < MIN_CALL_BYTES {
            return;
        }
        let c = Self::class(kind, bytes);
        let e = &self.classes[c];
        // Counted when a call succeeds (in `record`): a call that fails, fails on every
        // rank (a rank's rejected argument is a mismatch for its peers), so every rank
        // skips it alike and the ranks' probes stay in step.
        let call = e.calls.wrapping_add(1);
        let probe = call % PROBE_EVERY == 0;
        let stream = if probe { (call / PROBE_EVERY) % 2 == 1 } else { e.streaming };
        self.current = Some((c, stream, probe, bytes, std::time::Instant::now()));
    }

    /// Ends the collective begun last, which succeeded: its time per byte goes into its
    /// class's estimate. (A failed call is not ended: the next [`Self::begin`] drops it.)
    pub fn end(&mut self) {
        if let Some((c, stream, probe, bytes, t0)) = self.current.take() {
            self.record(c, stream, probe, t0.elapsed().as_nanos() as f64 / bytes.max(1) as f64);
        }
    }

    fn record(&mut self, c: usize, stream: bool, probe: bool, ns_per_byte: f64) {
        let e = &mut self.classes[c];
        e.calls = e.calls.wrapping_add(1);
        if !probe {
            return;
        }
        *(if stream { &mut e.stream } else { &mut e.plain }) = ns_per_byte;
        if e.plain > 0.0 && e.stream > 0.0 {
            let (now, alt) = if e.streaming { (e.stream, e.plain) } else { (e.plain, e.stream) };
            if now > SWITCH * alt {
                e.streaming = !e.streaming;
            }
        }
    }

    /// Ends the call in progress as if it had taken `ns_per_byte` (tests).
    #[cfg(test)]
    fn end_as(&mut self, ns_per_byte: f64) {
        if let Some((c, stream, probe, _, _)) = self.current.take() {
            self.record(c, stream, probe, ns_per_byte);
        }
    }

    /// Whether copies of `n` bytes into the slot in the call in progress use streaming
    /// stores.
    pub fn streams(&self, n: usize) -> bool {
        n >= MIN_BYTES
            && match self.mode {
                Mode::Plain => false,
                Mode::Stream => true,
                Mode::Auto => self.current.is_some_and(|(_, s, _, _, _)| s),
            }
    }

    /// The mode this streamer was made with.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Whether class (`kind`, `bytes`) currently streams, outside probes (tests, debugging).
    pub fn class_streams(&self, kind: usize, bytes: usize) -> bool {
        match self.mode {
            Mode::Plain => false,
            Mode::Stream => true,
            Mode::Auto => bytes >= MIN_CALL_BYTES && self.classes[Self::class(kind, bytes)].streaming,
        }
    }
}

/// Copies `n` bytes from `src` to `dst`, with streaming stores when `stream` is true and
/// the target has them, then orders them before any later store.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `n` bytes, and the two ranges
/// must not overlap.
pub unsafe fn copy_to_slot(dst: *mut u8, src: *const u8, n: usize, stream: bool) {
    #[cfg(target_arch = "x86_64")]
    if stream && n >= 128 {
        // SAFETY: forwarded from this function's contract.
        unsafe { stream_x86_64(dst, src, n) };
        return;
    }
    let _ = stream;
    // SAFETY: forwarded from this function's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
}

#[cfg(target_arch = "x86_64")]
unsafe fn stream_x86_64(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    use std::ptr::copy_nonoverlapping;
    // The head up to dst's first 16-byte boundary and the tail after the last 64-byte
    // block are copied plainly; n >= 128 leaves at least one block between them.
    let head = dst.align_offset(16).min(n);
    // SAFETY: head <= n, so both ranges are inside the caller's.
    unsafe { copy_nonoverlapping(src, dst, head) };
    let body = (n - head) / 64 * 64;
    let (d, s) = (dst.wrapping_add(head), src.wrapping_add(head));
    let mut i = 0;
    while i < body {
        // SAFETY: i + 64 <= body <= n - head, so every 16-byte access lies in
        // [head, n) of both ranges; `d + i` is 16-byte aligned (head aligned it, i is a
        // multiple of 64), as `_mm_stream_si128` requires; loads may be unaligned.
        unsafe {
            let a = _mm_loadu_si128(s.add(i).cast::<__m128i>());
            let b = _mm_loadu_si128(s.add(i + 16).cast::<__m128i>());
            let c = _mm_loadu_si128(s.add(i + 32).cast::<__m128i>());
            let e = _mm_loadu_si128(s.add(i + 48).cast::<__m128i>());
            _mm_stream_si128(d.add(i).cast::<__m128i>(), a);
            _mm_stream_si128(d.add(i + 16).cast::<__m128i>(), b);
            _mm_stream_si128(d.add(i + 32).cast::<__m128i>(), c);
            _mm_stream_si128(d.add(i + 48).cast::<__m128i>(), e);
        }
        i += 64;
    }
    let done = head + body;
    // SAFETY: done <= n; the tail [done, n) is inside both ranges.
    unsafe { copy_nonoverlapping(src.add(done), dst.add(done), n - done) };
    // SAFETY: sfence has no preconditions; it orders the streaming stores above before
    // every later store of this thread (the arrival's Release store among them).
    unsafe { _mm_sfence() };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `calls` calls of (`kind`, `bytes`) on `s`, each costing `cost(streams)` per
    /// byte; returns, per call, whether its copies streamed.
    fn drive(s: &mut Streamer, kind: usize, bytes: usize, calls: usize, cost: impl Fn(bool) -> f64) -> Vec<bool> {
        (0..calls)
            .map(|_| {
                s.begin(kind, bytes);
                let streamed = s.streams(MIN_BYTES);
                s.end_as(cost(streamed));
                streamed
            })
            .collect()
    }

    #[test]
    fn auto_follows_the_faster_kind_and_probes_both_in_turn() {
        let p = PROBE_EVERY as usize;
        let mut s = Streamer::new(Mode::Auto);
        // plain faster: only the streaming probes stream (calls p, 3p, 5p, ... counting from 1)
        let used = drive(&mut s, 2, 1 << 20, 8 * p, |st| if st { 2.0 } else { 1.0 });
        let probes: Vec<usize> = (0..used.len()).filter(|&i| used[i]).collect();
        assert_eq!(probes, (0..4).map(|k| (2 * k + 1) * p - 1).collect::<Vec<_>>());
        // the placement changes: plain costs 4x streaming. The next plain probe (within
        // 2 * PROBE_EVERY calls) shows it, and every later call but the plain probes streams.
        let used = drive(&mut s, 2, 1 << 20, 8 * p, |st| if st { 1.0 } else { 4.0 });
        let plain_probe = |i: usize| (8 * p + i + 1) % (2 * p) == 0;
        assert!((2 * p..used.len()).all(|i| used[i] != plain_probe(i)), "{used:?}");
        assert!(s.class_streams(2, 1 << 20) && !s.class_streams(2, 1 << 22), "classes are separate");
        // and back, within two probes
        let used = drive(&mut s, 2, 1 << 20, 8 * p, |st| if st { 2.0 } else { 1.0 });
        assert!(used.iter().skip(2 * p).filter(|&&b| b).count() <= 3, "{used:?}");
        assert!(!s.class_streams(2, 1 << 20));
    }

    #[test]
    fn a_failed_call_does_not_move_the_probes() {
        let mut s = Streamer::new(Mode::Auto);
        let mut t = Streamer::new(Mode::Auto);
        for i in 0..3 * PROBE_EVERY {
            if i == 5 {
                s.begin(9, 1 << 20); // a call that failed: begun, never ended
            }
            s.begin(9, 1 << 20);
            t.begin(9, 1 << 20);
            assert_eq!(s.streams(MIN_BYTES), t.streams(MIN_BYTES), "call {i}");
            s.end_as(1.0);
            t.end_as(1.0);
        }
        assert!(t.classes[Streamer::class(9, 1 << 20)].calls == 3 * PROBE_EVERY);
    }

    #[test]
    fn differences_within_the_margin_change_nothing_and_small_calls_never_stream() {
        let mut s = Streamer::new(Mode::Auto);
        let used = drive(&mut s, 5, 1 << 20, 64, |st| if st { 1.0 } else { 1.1 });
        assert!(!s.class_streams(5, 1 << 20) && used.iter().filter(|&&b| b).count() == 4);
        assert!(drive(&mut s, 5, MIN_CALL_BYTES - 1, 64, |st| if st { 1.0 } else { 9.0 }).iter().all(|&b| !b));
        let mut always = Streamer::new(Mode::Stream);
        assert!(drive(&mut always, 5, 64, 3, |_| 1.0).iter().all(|&b| b) && !always.streams(MIN_BYTES - 1));
        let mut never = Streamer::new(Mode::Plain);
        assert!(drive(&mut never, 5, 1 << 20, 64, |st| if st { 1.0 } else { 9.0 }).iter().all(|&b| !b));
    }

    #[test]
    fn copies_every_byte_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        for n in [0usize, 1, 15, 127, 128, 129, 191, 1000, 4000] {
            for s_off in [0usize, 1, 5, 16] {
                for d_off in [0usize, 3, 8, 16, 33] {
                    let mut dst = vec![0xAAu8; 4200];
                    // SAFETY: both ranges lie inside their vectors (offsets + n <= 4096 + 33).
                    unsafe { copy_to_slot(dst.as_mut_ptr().add(d_off), src.as_ptr().add(s_off), n, true) };
                    assert_eq!(&dst[d_off..d_off + n], &src[s_off..s_off + n], "n={n} s_off={s_off} d_off={d_off}");
                    assert!(dst[..d_off].iter().chain(&dst[d_off + n..]).all(|&b| b == 0xAA), "n={n}: wrote outside");
                }
            }
        }
    }
}
