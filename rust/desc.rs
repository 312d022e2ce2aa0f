//! Collective descriptors: what one rank says it is doing at one position of the group's
//! sequence, exchanged in the first step of every collective with peers (see `algorithms`;
//! a group of one rank builds it, for the abort check and the sequence, and keeps it), and the
//! check of a peer's descriptor against our own. Everything here is pure: the words come
//! from, and go to, the control blocks through `sync`.

use crate::error::{Disagreement, Error, Result};
use crate::reduce::{DType, ReduceOp};
use crate::segment::DESC_WORDS;

/// Collective kinds, as exchanged in descriptors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Barrier = 1,
    Allreduce = 2,
    Broadcast = 3,
    Reduce = 4,
    Allgather = 5,
    ReduceScatter = 6,
    Gather = 7,
    Scatter = 8,
    Alltoall = 9,
    /// All-to-all with per-peer counts (`algorithms::alltoallv`).
    Alltoallv = 10,
    /// Coalesced batches (`algorithms::coalesced`): one descriptor, then a table of the
    /// batch's tensors (dtype, count), then the tensors back to back through the slots.
    AllreduceCoalesced = 11,
    AllgatherCoalesced = 12,
    ReduceScatterCoalesced = 13,
}

impl Kind {
    /// Every kind, in code order.
    pub const ALL: [Kind; 13] = [
        Kind::Barrier,
        Kind::Allreduce,
        Kind::Broadcast,
        Kind::Reduce,
        Kind::Allgather,
        Kind::ReduceScatter,
        Kind::Gather,
        Kind::Scatter,
        Kind::Alltoall,
        Kind::Alltoallv,
        Kind::AllreduceCoalesced,
        Kind::AllgatherCoalesced,
        Kind::ReduceScatterCoalesced,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Kind::Barrier => "barrier",
            Kind::Allreduce => "allreduce",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::Allgather => "allgather",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::Gather => "gather",
            Kind::Scatter => "scatter",
            Kind::Alltoall => "alltoall",
            Kind::Alltoallv => "alltoallv",
            Kind::AllreduceCoalesced => "allreduce_coalesced",
            Kind::AllgatherCoalesced => "allgather_coalesced",
            Kind::ReduceScatterCoalesced => "reduce_scatter_coalesced",
        }
    }
    /// The kind a c10d method name belongs to: `"allreduce_coalesced"`,
    /// `"all_gather_single"`, `"_reduce_scatter_base"`, `"alltoall_base"`, ... (case and
    /// underscores are ignored). `None` for an unknown name.
    pub fn from_name(name: &str) -> Option<Kind> {
        let n: String = name.chars().filter(|c| *c != '_').collect::<String>().to_ascii_lowercase();
        let order = [
            ("reducescatter", Kind::ReduceScatter),
            ("allreduce", Kind::Allreduce),
            ("allgather", Kind::Allgather),
            ("alltoall", Kind::Alltoall),
            ("broadcast", Kind::Broadcast),
            ("barrier", Kind::Barrier),
            ("reduce", Kind::Reduce),
            ("gather", Kind::Gather),
            ("scatter", Kind::Scatter),
        ];
        order.into_iter().find(|(k, _)| n.contains(k)).map(|(_, kind)| kind)
    }
    pub(crate) fn from_code(c: u8) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| *k as u8 == c)
    }
    /// Whether the call's `count` is the number of tensors of a batch (its per-tensor
    /// counts travel in the first step's table) or, for alltoallv, unused.
    fn batched(self) -> bool {
        matches!(self, Kind::Alltoallv | Kind::AllreduceCoalesced | Kind::AllgatherCoalesced | Kind::ReduceScatterCoalesced)
    }
}

/// How a call moves its data, decided by each rank from the call's size and the group's
/// settings, and carried in the descriptor so that ranks that would take different paths
/// (say, different single-copy thresholds) raise `Mismatch` instead of exchanging
/// garbage. Wire codes are the discriminants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Transfer {
    /// No data (barrier, a rejected call).
    NoData = 0,
    /// Through the chunk slots, one step per chunk.
    Slots = 1,
    /// Through the slots, two steps per chunk (the large allreduce).
    SlotsTwoStep = 2,
    /// Single-copy reads from the peers' processes (`process_vm_readv`).
    SingleCopy = 3,
}

impl Transfer {
    pub const ALL: [Transfer; 4] = [Transfer::NoData, Transfer::Slots, Transfer::SlotsTwoStep, Transfer::SingleCopy];
    pub fn name(self) -> &'static str {
        match self {
            Transfer::NoData => "no data",
            Transfer::Slots => "slots",
            Transfer::SlotsTwoStep => "slots, two-step",
            Transfer::SingleCopy => "single-copy",
        }
    }
    pub fn from_code(c: u8) -> Option<Transfer> {
        Transfer::ALL.into_iter().find(|p| *p as u8 == c)
    }
}

/// Descriptor flag: this rank rejected its own arguments (`Communicator::fail`).
pub(crate) const FLAG_FAIL: u64 = 1;

/// What one rank says it is doing at one sequence position. Public (hidden) only so the
/// fuzz tests can drive [`Desc::decode`] and [`check_peer_desc`].
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    pub kind: u8,
    pub dtype: u32,
    pub op: u32,
    pub flags: u64,
    pub count: u64,
    pub root: u64,
    pub seq: u64,
    /// PREMUL_SUM's factor as f64 bits (0 otherwise): ranks must agree on it.
    pub factor: u64,
    /// The transfer path ([`Transfer`] code) this rank takes for the call.
    pub path: u8,
    /// Bytes this rank moves per step of the call (slot chunk, or single-copy read size).
    pub chunk: u64,
}

impl Desc {
    /// The words published in the control block: kind | dtype << 8 | op << 16 | path <<
    /// 24, flags, count, root, seq, factor, chunk.
    pub fn words(&self) -> [u64; DESC_WORDS] {
        [
            self.kind as u64 | (self.dtype as u64) << 8 | (self.op as u64) << 16 | (self.path as u64) << 24,
            self.flags,
            self.count,
            self.root,
            self.seq,
            self.factor,
            self.chunk,
        ]
    }

    /// Records the path and per-step bytes this rank chose for the call.
    pub(crate) fn route(&mut self, path: Transfer, chunk_bytes: usize) {
        self.path = path as u8;
        self.chunk = chunk_bytes as u64;
    }
    /// Decodes descriptor words read from a peer's control block in a group of `world`
    /// ranks. The words are untrusted, so each field is checked: a known kind, dtype and
    /// reduce-op code, the unused bits of word 0 and of `flags` clear, `root < world`.
    /// `count`, `seq`, `factor` and `chunk` are only ever compared with the local descriptor, never
    /// used as a size or an index. Never panics.
    ///
    /// Errors: `Mismatch` naming the first bad field.
    pub fn decode(w: [u64; DESC_WORDS], world: usize) -> Result<Desc> {
        let d = Desc {
            kind: (w[0] & 0xff) as u8,
            dtype: ((w[0] >> 8) & 0xff) as u32,
            op: ((w[0] >> 16) & 0xff) as u32,
            flags: w[1],
            count: w[2],
            root: w[3],
            seq: w[4],
            factor: w[5],
            path: ((w[0] >> 24) & 0xff) as u8,
            chunk: w[6],
        };
        let bad = |what: String| Err(Error::Mismatch(format!("malformed descriptor: {what}")));
        if w[0] >> 32 != 0 {
            return bad(format!("reserved bits set in word 0 ({:#x})", w[0]));
        }
        if Kind::from_code(d.kind).is_none() {
            return bad(format!("unknown collective kind {}", d.kind));
        }
        if DType::from_code(d.dtype).is_none() {
            return bad(format!("unknown dtype code {}", d.dtype));
        }
        if ReduceOp::from_code(d.op).is_err() {
            return bad(format!("unknown reduce op code {}", d.op));
        }
        if Transfer::from_code(d.path).is_none() {
            return bad(format!("unknown transfer path {}", d.path));
        }
        if d.flags & !FLAG_FAIL != 0 {
            return bad(format!("unknown flags {:#x}", d.flags));
        }
        if d.root >= world as u64 {
            return bad(format!("root {} outside 0..{world}", d.root));
        }
        Ok(d)
    }
    pub(crate) fn same_call(&self, o: &Desc) -> bool {
        (self.kind, self.dtype, self.op, self.count, self.root, self.seq, self.factor, self.path, self.chunk)
            == (o.kind, o.dtype, o.op, o.count, o.root, o.seq, o.factor, o.path, o.chunk)
    }
    /// Human-readable form, robust to garbage read from a misbehaving peer.
    pub(crate) fn describe(&self) -> String {
        let kind = Kind::from_code(self.kind).map_or_else(|| format!("<kind {}>", self.kind), |k| k.name().to_string());
        if self.kind == Kind::Barrier as u8 || self.flags & FLAG_FAIL != 0 {
            return format!("{kind} #{}", self.seq);
        }
        let dtype = DType::from_code(self.dtype).map_or_else(|| format!("<dtype {}>", self.dtype), |d| d.name().to_string());
        let mut s = match Kind::from_code(self.kind) {
            Some(Kind::Alltoallv) => format!("{kind} #{} ({dtype}, per-peer counts", self.seq),
            Some(k) if k.batched() => format!("{kind} #{} ({} tensors, the first {dtype}", self.seq, self.count),
            _ => format!("{kind} #{} ({dtype} x {} elements", self.seq, self.count),
        };
        if matches!(
            Kind::from_code(self.kind),
            Some(Kind::Allreduce | Kind::Reduce | Kind::ReduceScatter | Kind::AllreduceCoalesced | Kind::ReduceScatterCoalesced)
        ) {
            s += &format!(", {}", ReduceOp::from_code(self.op).map_or("<op?>", |o| o.name()));
            if self.op == ReduceOp::PremulSum as u32 {
                s += &format!(" factor {}", f64::from_bits(self.factor));
            }
        }
        if matches!(Kind::from_code(self.kind), Some(Kind::Broadcast | Kind::Reduce | Kind::Gather | Kind::Scatter)) {
            s += &format!(", root {}", self.root);
        }
        let path = Transfer::from_code(self.path).map_or_else(|| format!("<path {}>", self.path), |p| p.name().to_string());
        s + &format!(", via {path} in {}-byte steps)", self.chunk)
    }
}

/// Compares rank `r`'s descriptor `words`, read from its control block, with this rank's
/// (`me`) own descriptor `mine` for the same step, in a group of `world` ranks. `Ok` when
/// `mine` is a failing rank's (its caller raises its own error) or the words are exactly
/// `mine.words()`; `Mismatch` otherwise: malformed words ([`Desc::decode`]), a peer that
/// rejected its arguments, or a different call. Nothing is sized or indexed by the peer's
/// values: the collectives move data by the local descriptor only, after this said `Ok`.
#[doc(hidden)]
pub fn check_peer_desc(mine: &Desc, me: usize, r: usize, words: [u64; DESC_WORDS], world: usize) -> Result<()> {
    if mine.flags & FLAG_FAIL != 0 {
        return Ok(()); // we are the failing rank; our caller raises its own error
    }
    let theirs = Desc::decode(words, world).map_err(|e| {
        Error::Mismatch(format!("{}: rank {r} published a {e} (words {words:#x?}); no data was exchanged", mine.describe()))
    })?;
    if theirs.flags & FLAG_FAIL != 0 {
        return Err(Error::Mismatch(format!(
            "{}: rank {r} rejected its arguments to {} (see the error raised on rank {r}); \
             no data was exchanged and the group is still usable",
            mine.describe(),
            theirs.describe()
        )));
    }
    if !theirs.same_call(mine) {
        let name = |d: &Desc| Kind::from_code(d.kind).map_or("?", |k| k.name());
        return Err(Error::Disagree {
            message: format!(
                "ranks disagree at position {} of the group's sequence: rank {me} called {}, rank {r} called {}; \
                 no output was written and the group is still usable",
                mine.seq,
                mine.describe(),
                theirs.describe()
            ),
            on: Disagreement::Calls { rank: me, peer: r, expected: name(mine), got: name(&theirs) },
        });
    }
    Ok(())
}
