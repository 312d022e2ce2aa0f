//! The group's *plan*: which algorithm each collective uses at which message size.
//!
//! Whether single-copy transfers (`cma`) beat the slots, and from which size the two-step
//! allreduce beats the one-shot one, depends on the machine (on an Intel VM single-copy
//! reads won from 256 KiB; on an AMD EPYC VM, whose cross-core copies are twice as fast,
//! they triple the 16 MiB allreduce). So the thresholds are not constants of the core:
//! the c10d backend measures them once per machine and kernel, caches them, agrees on
//! them across the group (`flagos_shm.backend.plan`) and sets them with
//! [`crate::Communicator::set_plan`]. [`Plan::FALLBACK`] is what a communicator uses until
//! then (the Rust API, `cargo bench`): the values tuned on the VM where the core was
//! written, a reasonable guess, not a measurement of this machine.
//!
//! Every rank of a group must use the same plan. The plan decides each call's transfer
//! path, which every rank publishes in its descriptor ([`crate::desc::Transfer`]), so two
//! ranks with different plans raise `Mismatch` at the first call they would move
//! differently instead of exchanging garbage or hanging.

use crate::desc::Kind;

/// "Never": a threshold no message reaches.
pub const NEVER: usize = usize::MAX;

/// Where a collective takes its single-copy path: messages of `min <= S < max` bytes
/// ([`NEVER`] as `min`: never; as `max`: no upper bound). A band rather than one
/// threshold, because single-copy can win at middle sizes only: on the Intel Xeon 2-vCPU
/// VM a single-copy broadcast took 10 us at 256 KiB against 16 through the slots, and 430
/// against 307 at 4 MiB (`docs/benchmark.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Band {
    pub min: usize,
    pub max: usize,
}

impl Band {
    /// From `min` bytes up.
    pub const fn from(min: usize) -> Band {
        Band { min, max: NEVER }
    }

    /// Whether `bytes` lies in the band.
    pub fn contains(&self, bytes: usize) -> bool {
        self.min != NEVER && bytes >= self.min && (self.max == NEVER || bytes < self.max)
    }
}

/// The collectives with a single-copy path, in [`Plan::single_copy`]'s order.
pub const SINGLE_COPY_KINDS: [Kind; 5] = [Kind::Allreduce, Kind::Allgather, Kind::ReduceScatter, Kind::Broadcast, Kind::Alltoall];

/// Message-size thresholds in bytes (S as the collective's checked face counts it: the
/// allreduce and broadcast buffer, the allgather's whole output, the reduce-scatter's and
/// the all-to-all's whole input).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Allreduce messages up to this many bytes use the one-shot slot algorithm (every
    /// rank reduces every chunk); larger ones the two-step one.
    pub one_shot_max: usize,
    /// Per collective of [`SINGLE_COPY_KINDS`], the sizes at which it uses single-copy
    /// transfers (when the group can: see `cma`). Broadcast: the non-roots read the root's
    /// buffer; all-to-all (equal pieces): each rank reads its piece of every peer's input.
    pub single_copy: [Band; 5],
}

/// The plan's thresholds by name, as the binding, `FLAGOS_SHM_PLAN` and the plan cache
/// (`flagos_shm.backend.plan`, which takes them from `_core.PLAN_KEYS`) spell them, in
/// [`Plan::values`]' order: the one-shot allreduce limit, then per collective of
/// [`SINGLE_COPY_KINDS`] `<name>_single_copy_min_bytes` and `<name>_single_copy_max_bytes`
/// (`Kind::name`).
pub const KEYS: [&str; 11] = [
    "one_shot_max_bytes",
    "allreduce_single_copy_min_bytes",
    "allreduce_single_copy_max_bytes",
    "allgather_single_copy_min_bytes",
    "allgather_single_copy_max_bytes",
    "reduce_scatter_single_copy_min_bytes",
    "reduce_scatter_single_copy_max_bytes",
    "broadcast_single_copy_min_bytes",
    "broadcast_single_copy_max_bytes",
    "alltoall_single_copy_min_bytes",
    "alltoall_single_copy_max_bytes",
];

impl Plan {
    /// The plan before a measured one is set: allreduce one-shot up to 256 KiB, single-copy
    /// allgather and reduce-scatter from 256 KiB and allreduce from 2 MiB (tuned on an
    /// Intel Xeon 2-vCPU VM; `python -m flagos_shm.bench` there, `FLAGOS_SHM_CMA=0` and `1`
    /// alternately: allgather 139 / 81 us at 1 MiB, allreduce 2761 / 2192 us at 16 MiB),
    /// broadcast from 128 KiB below 2 MiB and all-to-all from 32 KiB (two calibrations on
    /// an Intel Xeon 2-vCPU VM, Sapphire Rapids class, 2026-12-04: single-copy broadcast
    /// 52.7 against 70.0 us through the slots at 1 MiB and 430 against 307 at 4 MiB;
    /// all-to-all 9.1 against 19.2 at 64 KiB and 1353 against 1778 at 16 MiB).
    pub const FALLBACK: Plan = Plan {
        one_shot_max: 256 * 1024,
        single_copy: [
            Band::from(2 * 1024 * 1024),
            Band::from(256 * 1024),
            Band::from(256 * 1024),
            Band { min: 128 * 1024, max: 2 * 1024 * 1024 },
            Band::from(32 * 1024),
        ],
    };

    /// The single-copy band of collectives of `kind`; None for a kind without a
    /// single-copy path.
    pub fn band(&self, kind: Kind) -> Option<Band> {
        SINGLE_COPY_KINDS.iter().position(|k| *k == kind).map(|i| self.single_copy[i])
    }

    /// The thresholds in [`KEYS`]' order.
    pub fn values(&self) -> [usize; 11] {
        let mut v = [self.one_shot_max; 11];
        for (i, b) in self.single_copy.iter().enumerate() {
            v[1 + 2 * i] = b.min;
            v[2 + 2 * i] = b.max;
        }
        v
    }

    /// The plan whose thresholds are `v`, in [`KEYS`]' order.
    pub fn from_values(v: [usize; 11]) -> Plan {
        Plan { one_shot_max: v[0], single_copy: std::array::from_fn(|i| Band { min: v[1 + 2 * i], max: v[2 + 2 * i] }) }
    }

    /// The plan with every single-copy band empty (what a group that cannot read its
    /// peers' memory runs).
    pub fn without_single_copy(self) -> Plan {
        self.with_single_copy_min(NEVER)
    }

    /// The plan with one single-copy threshold `min`
    /// ([`crate::Communicator::set_single_copy_min_bytes`], for tests and measurements):
    /// every single-copy collective from `min` bytes up but allreduce, from 8 x `min`.
    pub fn with_single_copy_min(self, min: usize) -> Plan {
        let mut single_copy = [Band::from(min); 5];
        single_copy[0] = Band::from(min.saturating_mul(8));
        Plan { single_copy, ..self }
    }
}

impl Default for Plan {
    fn default() -> Plan {
        Plan::FALLBACK
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_threshold_scales_allreduce_and_saturates() {
        let p = Plan::FALLBACK.with_single_copy_min(1024);
        assert_eq!(p.single_copy.map(|b| b.min), [8192, 1024, 1024, 1024, 1024]);
        assert!(p.single_copy.iter().all(|b| b.max == NEVER));
        assert_eq!(p.one_shot_max, Plan::FALLBACK.one_shot_max);
        assert_eq!(Plan::FALLBACK.with_single_copy_min(NEVER).single_copy[0].min, NEVER);
        assert!(Plan::FALLBACK.with_single_copy_min(4096).without_single_copy().single_copy.iter().all(|b| !b.contains(1 << 20)));
    }

    #[test]
    fn values_follow_the_keys_and_round_trip() {
        let v = std::array::from_fn(|i| i + 1);
        let p = Plan::from_values(v);
        assert_eq!(p.values(), v);
        assert_eq!((p.one_shot_max, p.band(Kind::ReduceScatter), p.band(Kind::Gather)), (1, Some(Band { min: 6, max: 7 }), None));
        for (i, op) in SINGLE_COPY_KINDS.map(Kind::name).iter().enumerate() {
            assert_eq!(
                (KEYS[1 + 2 * i], KEYS[2 + 2 * i]),
                (&*format!("{op}_single_copy_min_bytes"), &*format!("{op}_single_copy_max_bytes"))
            );
        }
    }

    #[test]
    fn a_band_holds_min_up_to_but_not_max() {
        let b = Band { min: 64, max: 1024 };
        assert_eq!([0, 63, 64, 1023, 1024].map(|x| b.contains(x)), [false, false, true, true, false]);
        assert!(Band::from(0).contains(usize::MAX - 1) && !Band::from(NEVER).contains(usize::MAX));
        assert!(!Band { min: NEVER, max: NEVER }.contains(NEVER));
    }
}
