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

/// "Never": a threshold no message reaches.
pub const NEVER: usize = usize::MAX;

/// Message-size thresholds in bytes (S as the collective's checked face counts it: the
/// allreduce buffer, the allgather's whole output, the reduce-scatter's whole input).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Allreduce messages up to this many bytes use the one-shot slot algorithm (every
    /// rank reduces every chunk); larger ones the two-step one.
    pub one_shot_max: usize,
    /// Allreduce messages of at least this many bytes use single-copy transfers (when the
    /// group can: see `cma`); [`NEVER`] to keep them on the slots.
    pub allreduce_single_copy: usize,
    /// The same for allgather (whole output).
    pub allgather_single_copy: usize,
    /// The same for reduce-scatter (whole input).
    pub reduce_scatter_single_copy: usize,
    /// The same for broadcast (the buffer): the non-roots read the root's buffer.
    pub broadcast_single_copy: usize,
    /// The same for all-to-all with equal pieces (the whole input): each rank reads its
    /// piece of every peer's input.
    pub alltoall_single_copy: usize,
}

/// The plan's thresholds by name, as the binding, `FLAGOS_SHM_PLAN` and the plan cache
/// (`flagos_shm.backend.plan`, which takes them from `_core.PLAN_KEYS`) spell them, in
/// [`Plan::values`]' order. The first is the one-shot allreduce limit; every other one is
/// a single-copy threshold, named `<collective>_single_copy_min_bytes`.
pub const KEYS: [&str; 6] = [
    "one_shot_max_bytes",
    "allreduce_single_copy_min_bytes",
    "allgather_single_copy_min_bytes",
    "reduce_scatter_single_copy_min_bytes",
    "broadcast_single_copy_min_bytes",
    "alltoall_single_copy_min_bytes",
];

impl Plan {
    /// The plan before a measured one is set: allreduce one-shot up to 256 KiB, single-copy
    /// allgather and reduce-scatter from 256 KiB and allreduce from 2 MiB (tuned on an
    /// Intel Xeon 2-vCPU VM; `python -m flagos_shm.bench` there, `FLAGOS_SHM_CMA=0` and `1`
    /// alternately: allgather 139 / 81 us at 1 MiB, allreduce 2761 / 2192 us at 16 MiB).
    pub const FALLBACK: Plan = Plan {
        one_shot_max: 256 * 1024,
        allreduce_single_copy: 2 * 1024 * 1024,
        allgather_single_copy: 256 * 1024,
        reduce_scatter_single_copy: 256 * 1024,
        broadcast_single_copy: 256 * 1024,
        alltoall_single_copy: 256 * 1024,
    };

    /// The thresholds in [`KEYS`]' order.
    pub fn values(&self) -> [usize; 6] {
        [
            self.one_shot_max,
            self.allreduce_single_copy,
            self.allgather_single_copy,
            self.reduce_scatter_single_copy,
            self.broadcast_single_copy,
            self.alltoall_single_copy,
        ]
    }

    /// The plan whose thresholds are `v`, in [`KEYS`]' order.
    pub fn from_values(v: [usize; 6]) -> Plan {
        Plan {
            one_shot_max: v[0],
            allreduce_single_copy: v[1],
            allgather_single_copy: v[2],
            reduce_scatter_single_copy: v[3],
            broadcast_single_copy: v[4],
            alltoall_single_copy: v[5],
        }
    }

    /// The plan with every single-copy threshold at [`NEVER`] (what a group that cannot
    /// read its peers' memory runs).
    pub fn without_single_copy(self) -> Plan {
        self.with_single_copy_min(NEVER)
    }

    /// The plan with the legacy single-copy threshold `min` (`FLAGOS_SHM_CMA_MIN_BYTES`,
    /// `set_single_copy_min_bytes`): every single-copy collective from `min` bytes but
    /// allreduce, from 8 x `min`.
    pub fn with_single_copy_min(self, min: usize) -> Plan {
        Plan {
            allreduce_single_copy: min.saturating_mul(8),
            allgather_single_copy: min,
            reduce_scatter_single_copy: min,
            broadcast_single_copy: min,
            alltoall_single_copy: min,
            ..self
        }
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
        assert_eq!((p.allreduce_single_copy, p.allgather_single_copy, p.reduce_scatter_single_copy), (8192, 1024, 1024));
        assert_eq!(p.one_shot_max, Plan::FALLBACK.one_shot_max);
        assert_eq!(Plan::FALLBACK.with_single_copy_min(NEVER).allreduce_single_copy, NEVER);
        assert_eq!((p.broadcast_single_copy, p.alltoall_single_copy), (1024, 1024));
        assert_eq!(Plan::FALLBACK.with_single_copy_min(4096).without_single_copy().values()[1..], [NEVER; 5]);
    }

    #[test]
    fn values_follow_the_keys_and_round_trip() {
        let p = Plan::from_values([1, 2, 3, 4, 5, 6]);
        assert_eq!(p.values(), [1, 2, 3, 4, 5, 6]);
        assert_eq!((p.one_shot_max, p.reduce_scatter_single_copy, p.alltoall_single_copy), (1, 4, 6));
        assert!(KEYS[1..].iter().all(|k| k.ends_with("_single_copy_min_bytes")));
    }
}
