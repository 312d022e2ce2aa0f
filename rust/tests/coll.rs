//! Tests of alltoallv and the coalesced batches with threads as ranks: values against
//! references computed another way (per-element formulas, the single-tensor collectives),
//! mismatches raised on every rank with the group usable afterwards, and the bounds
//! checks on the caller's buffers and lists.

use flagos_shm::algorithms::COALESCE_MAX_BYTES;
use flagos_shm::reduce::{DType, ReduceOp};
use flagos_shm::segment;
use flagos_shm::stream::Mode;
use flagos_shm::Disagreement;
use flagos_shm::Plan;
use flagos_shm::{Buf, Communicator, Error};

mod common;
use common::TestDir;
use std::sync::Arc;
use std::time::Duration;

fn with_group<R: Send + 'static>(n: usize, slot: usize, f: impl Fn(usize, &mut Communicator) -> R + Send + Sync + 'static) -> Vec<R> {
    let dir = TestDir::new("coll");
    let path = segment::create(&dir, n, slot).unwrap();
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (p, f) = (path.clone(), Arc::clone(&f));
            std::thread::spawn(move || f(r, &mut Communicator::attach(&p, r, n, Duration::from_secs(20)).unwrap()))
        })
        .collect();
    let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
    std::fs::remove_dir(&dir).unwrap();
    out
}

const SLOT: usize = 4096; // small slots: modest sizes stream through many steps

/// What rank `src` sends rank `dst` at element `i` (distinct for every triple).
fn sent(src: usize, dst: usize, i: usize) -> i64 {
    (src * 1_000_000 + dst * 10_000 + i) as i64
}

/// Rank p's count to rank q in a skewed pattern with zeros and multi-step pieces.
fn count(p: usize, q: usize) -> usize {
    [0, 1, 7, 300, 1000][(p * 3 + q * 2) % 5]
}

#[test]
fn alltoallv_matches_per_element_reference_for_uneven_counts() {
    for n in 1..=4 {
        let outs = with_group(n, SLOT, move |me, c| {
            let send: Vec<usize> = (0..n).map(|q| count(me, q)).collect();
            let recv: Vec<usize> = (0..n).map(|q| count(q, me)).collect();
            let input: Vec<i64> = (0..n).flat_map(|q| (0..send[q]).map(move |i| sent(me, q, i))).collect();
            let mut out = vec![-1i64; recv.iter().sum::<usize>() + 3]; // 3 guard elements
            let seq = c.seq();
            c.alltoallv(Buf::from_elems(&input), Buf::from_elems_mut(&mut out), &send, &recv, DType::I64).unwrap();
            assert_eq!(c.seq(), seq + 1, "alltoallv is one collective");
            // also as bytes (element size 1) with a count of zero everywhere
            let mut none = [7u8; 4];
            c.alltoallv(Buf::from_slice(&[]), Buf::from_mut_slice(&mut none), &vec![0; n], &vec![0; n], DType::U8).unwrap();
            assert_eq!(none, [7; 4]);
            out
        });
        for (me, out) in outs.iter().enumerate() {
            let want: Vec<i64> = (0..n).flat_map(|q| (0..count(q, me)).map(move |i| sent(q, me, i))).chain([-1; 3]).collect();
            assert_eq!(out, &want, "n={n} rank {me}");
        }
    }
}

#[test]
fn alltoallv_count_mismatch_raises_on_every_rank_naming_the_pair() {
    let outs = with_group(3, SLOT, |me, c| {
        let mut send = vec![2usize; 3];
        if me == 1 {
            send[2] = 5; // rank 2 expects 2
        }
        let input = vec![1.0f32; 9];
        let mut out = vec![0.0f32; 6];
        let e = c.alltoallv(Buf::from_elems(&input), Buf::from_elems_mut(&mut out), &send, &[2; 3], DType::F32);
        let msg = match e {
            Err(Error::Disagree { message, on: Disagreement::Counts { rank: 1, peer: 2, expected: 2, got: 5, pairs: 1 } }) => message,
            other => panic!("rank {me}: expected Disagree on rank 1's count to rank 2, got {other:?}"),
        };
        let mut ok = [me as f32; 4];
        c.allreduce(Buf::from_elems_mut(&mut ok), 4, DType::F32, ReduceOp::Sum, 1.0).unwrap();
        (msg, out, ok)
    });
    for (msg, out, ok) in outs {
        assert!(msg.contains("rank 1 sends 5 elements to rank 2, which expects 2") && msg.contains("no data was exchanged"), "{msg}");
        assert_eq!(out, vec![0.0; 6], "nothing written");
        assert_eq!(ok, [3.0; 4], "the group is still usable");
    }
}

#[test]
fn alltoallv_refuses_short_buffers_bad_lists_and_overlap_by_name() {
    let outs = with_group(2, SLOT, |me, c| {
        let input = vec![1u32; 4];
        let mut out = vec![0u32; 4];
        let mut errs = Vec::new();
        // rank 0's input is too short for its counts; rank 1 sees a rejecting peer
        let send = if me == 0 { [3, 3] } else { [2, 2] };
        errs.push(c.alltoallv(Buf::from_elems(&input), Buf::from_elems_mut(&mut out), &send, &[2, 2], DType::I32));
        // rank 1 passes one receive count too few
        let recv: &[usize] = if me == 1 { &[2] } else { &[2, 2] };
        errs.push(c.alltoallv(Buf::from_elems(&input), Buf::from_elems_mut(&mut out), &[2, 2], recv, DType::I32));
        // rank 0's output overlaps its input
        if me == 0 {
            let mut both = [0u32; 6];
            let (a, b) = both.split_at_mut(2);
            // SAFETY: `a` and `b` are live and 4-byte aligned; the overlap is the point.
            let whole = unsafe { Buf::from_raw_parts(a.as_mut_ptr().cast(), 16) };
            errs.push(c.alltoallv(whole, Buf::from_elems_mut(b), &[2, 2], &[2, 2], DType::I32));
        } else {
            errs.push(c.alltoallv(Buf::from_elems(&input), Buf::from_elems_mut(&mut out), &[2, 2], &[2, 2], DType::I32));
        }
        (errs.into_iter().map(|e| e.unwrap_err().to_string()).collect::<Vec<_>>(), out)
    });
    let (e0, e1) = (&outs[0].0, &outs[1].0);
    assert!(e0[0].contains("in_nbytes") && e0[0].contains("too small"), "{}", e0[0]);
    assert!(e1[0].contains("rank 0 rejected its arguments"), "{}", e1[0]);
    assert!(e1[1].contains("recv_counts: expected 2 counts"), "{}", e1[1]);
    assert!(e0[1].contains("rank 1 rejected its arguments"), "{}", e0[1]);
    assert!(e0[2].contains("overlaps its input"), "{}", e0[2]);
    assert!(e1[2].contains("rank 0 rejected"), "{}", e1[2]);
    assert_eq!(outs[1].1, vec![0; 4], "nothing written");
}

/// f32 values for rank `r`, tensor `t`, element `i` that sum exactly.
fn val(r: usize, t: usize, i: usize) -> f32 {
    ((r * 7 + t * 3 + i) % 17) as f32 - 8.0
}

/// Tensor sizes of a batch: empty, tiny, spanning several steps, one above the batch limit.
fn sizes() -> Vec<usize> {
    vec![0, 1, 3000, 17, COALESCE_MAX_BYTES / 4 + 5, 64]
}

#[test]
fn allreduce_coalesced_equals_one_allreduce_per_tensor_with_mixed_dtypes() {
    for n in [1, 2, 3] {
        let outs = with_group(n, SLOT, |me, c| {
            let sz = sizes();
            // even tensors float32, odd ones int64 (mixed dtypes in one batch)
            let dtype = |t: usize| if t % 2 == 0 { DType::F32 } else { DType::I64 };
            let mut f: Vec<Vec<f32>> = sz.iter().enumerate().map(|(t, &k)| (0..k).map(|i| val(me, t, i)).collect()).collect();
            let mut g: Vec<Vec<i64>> = sz.iter().enumerate().map(|(t, &k)| (0..k).map(|i| val(me, t, i) as i64).collect()).collect();
            let (mut rf, mut rg) = (f.clone(), g.clone());
            let seq = c.seq();
            {
                let bufs: Vec<Buf> = f
                    .iter_mut()
                    .zip(g.iter_mut())
                    .enumerate()
                    .map(|(t, (a, b))| if t % 2 == 0 { Buf::from_elems_mut(a) } else { Buf::from_elems_mut(b) })
                    .collect();
                let dtypes: Vec<DType> = (0..sz.len()).map(dtype).collect();
                c.allreduce_coalesced(&bufs, &sz, &dtypes, ReduceOp::Sum, 1.0).unwrap();
            }
            let batch_seqs = c.seq() - seq;
            for t in 0..sz.len() {
                if t % 2 == 0 {
                    c.allreduce(Buf::from_elems_mut(&mut rf[t]), sz[t], DType::F32, ReduceOp::Sum, 1.0).unwrap();
                } else {
                    c.allreduce(Buf::from_elems_mut(&mut rg[t]), sz[t], DType::I64, ReduceOp::Sum, 1.0).unwrap();
                }
            }
            let same = (0..sz.len()).all(|t| if t % 2 == 0 { f[t] == rf[t] } else { g[t] == rg[t] });
            (same, batch_seqs, f[2].clone())
        });
        for (r, (same, seqs, f2)) in outs.into_iter().enumerate() {
            assert!(same, "n={n} rank {r}: coalesced differs from per-tensor allreduce");
            assert_eq!(seqs, 2, "one batch plus the one tensor above the limit");
            let want: Vec<f32> = (0..3000).map(|i| (0..n).map(|q| val(q, 2, i)).sum()).collect();
            assert_eq!(f2, want);
        }
    }
}

#[test]
fn allgather_and_reduce_scatter_coalesced_match_references() {
    for n in [2, 3] {
        let outs = with_group(n, SLOT, move |me, c| {
            let sz = sizes();
            let ins: Vec<Vec<f32>> = sz.iter().enumerate().map(|(t, &k)| (0..k).map(|i| val(me, t, i)).collect()).collect();
            let mut outs: Vec<Vec<f32>> = sz.iter().map(|&k| vec![f32::NAN; n * k]).collect();
            {
                let i: Vec<Buf> = ins.iter().map(|v| Buf::from_elems(v)).collect();
                let o: Vec<Buf> = outs.iter_mut().map(|v| Buf::from_elems_mut(v)).collect();
                c.allgather_coalesced(&i, &o, &sz, &[DType::F32; 6]).unwrap();
            }
            // reduce-scatter: tensor t's input has n blocks of sz[t]; rank me keeps block me
            let rs_in: Vec<Vec<i32>> = sz.iter().enumerate().map(|(t, &k)| (0..n * k).map(|i| val(me, t, i) as i32).collect()).collect();
            let mut rs_out: Vec<Vec<i32>> = sz.iter().map(|&k| vec![i32::MIN; k]).collect();
            {
                let i: Vec<Buf> = rs_in.iter().map(|v| Buf::from_elems(v)).collect();
                let o: Vec<Buf> = rs_out.iter_mut().map(|v| Buf::from_elems_mut(v)).collect();
                c.reduce_scatter_coalesced(&i, &o, &sz, &[DType::I32; 6], ReduceOp::Max, 1.0).unwrap();
            }
            (outs, rs_out)
        });
        let sz = sizes();
        for (me, (ag, rs)) in outs.into_iter().enumerate() {
            for (t, &k) in sz.iter().enumerate() {
                let want: Vec<f32> = (0..n).flat_map(|r| (0..k).map(move |i| val(r, t, i))).collect();
                assert_eq!(ag[t], want, "allgather n={n} tensor {t}");
                let want: Vec<i32> = (0..k).map(|i| (0..n).map(|r| val(r, t, me * k + i) as i32).max().unwrap()).collect();
                assert_eq!(rs[t], want, "reduce_scatter n={n} rank {me} tensor {t}");
            }
        }
    }
}

#[test]
fn a_batch_that_differs_raises_on_every_rank_and_the_group_stays_usable() {
    let outs = with_group(3, SLOT, |me, c| {
        let mut a = vec![1.0f32; 8];
        let mut b = vec![1.0f64; 8];
        // rank 2's second tensor is float32 where the others have float64
        let (d1, mut b32) = (if me == 2 { DType::F32 } else { DType::F64 }, vec![1.0f32; 8]);
        let e = {
            let second = if me == 2 { Buf::from_elems_mut(&mut b32) } else { Buf::from_elems_mut(&mut b) };
            c.allreduce_coalesced(&[Buf::from_elems_mut(&mut a), second], &[8, 8], &[DType::F32, d1], ReduceOp::Sum, 1.0)
        };
        // a batch of a different length, then one whose tensor is too short on rank 0
        let e2 = c.allreduce_coalesced(&[Buf::from_elems_mut(&mut a)], &[if me == 1 { 7 } else { 8 }], &[DType::F32], ReduceOp::Sum, 1.0);
        let e3 = c.allgather_coalesced(
            &[Buf::from_elems(&[1.0f32; 2])],
            &[Buf::from_elems_mut(&mut a)],
            &[if me == 0 { 3 } else { 2 }],
            &[DType::F32],
        );
        let mut ok = [1i64; 2];
        c.allreduce_coalesced(&[Buf::from_elems_mut(&mut ok)], &[2], &[DType::I64], ReduceOp::Sum, 1.0).unwrap();
        ([e, e2, e3].map(|e| e.unwrap_err().to_string()), a[..2].to_vec(), ok)
    });
    for (me, (errs, a, ok)) in outs.into_iter().enumerate() {
        assert!(errs[0].contains("tensor 1 of the batch: rank 0 has float64 x 8 elements, rank 2 has float32 x 8"), "{}", errs[0]);
        assert!(errs[0].contains("no output was written"), "{}", errs[0]);
        assert!(errs[1].contains("rank 0 has float32 x 8 elements, rank 1 has float32 x 7"), "{}", errs[1]);
        let want = if me == 0 { "in_nbytes[0]" } else { "rank 0 rejected its arguments" };
        assert!(errs[2].contains(want), "rank {me}: {}", errs[2]);
        assert_eq!(a, vec![1.0; 2], "nothing written");
        assert_eq!(ok, [3; 2]);
    }
}

#[test]
fn ops_undefined_on_a_tensor_of_the_batch_are_refused_on_every_rank() {
    let outs = with_group(2, SLOT, |_, c| {
        let (mut a, mut b) = ([1i32; 4], [1.0f32; 4]);
        let bufs = [Buf::from_elems_mut(&mut a), Buf::from_elems_mut(&mut b)];
        c.allreduce_coalesced(&bufs, &[4, 4], &[DType::I32, DType::F32], ReduceOp::Band, 1.0).unwrap_err()
    });
    assert!(matches!(&outs[0], Error::Unsupported(m) if m.contains("BAND")), "{:?}", outs[0]);
    assert!(matches!(&outs[1], Error::Unsupported(_)), "{:?}", outs[1]);
}

#[test]
fn back_to_back_small_collectives_of_changing_sizes_stay_exact() {
    // One-shot chunks smaller than half a slot take a different place in the slots on
    // successive calls (`Communicator::rotation`); sizes that change from call to call make
    // consecutive calls' places overlap in every way. Each call's sum is checked exactly.
    const SLOT64K: usize = 64 * 1024;
    let sizes = [1usize, 1000, 5000, 3, 4096, 8191, 16384, 2];
    for n in [2usize, 3] {
        with_group(n, SLOT64K, move |me, c| {
            for call in 0..200usize {
                let len = sizes[call % sizes.len()];
                let mut v: Vec<i64> = (0..len).map(|i| (me * 1_000_003 + call * 7919 + i) as i64).collect();
                c.allreduce(Buf::from_elems_mut(&mut v), len, DType::I64, ReduceOp::Sum, 1.0).unwrap();
                for (i, x) in v.iter().enumerate() {
                    let want: i64 = (0..n).map(|r| (r * 1_000_003 + call * 7919 + i) as i64).sum();
                    assert_eq!(*x, want, "call {call}, rank {me}, element {i} of {len}");
                }
                // broadcast, reduce and allgather place their chunks the same way
                let root = call % n;
                let mut b: Vec<i64> = (0..len).map(|i| if me == root { (call * 31 + i) as i64 } else { -1 }).collect();
                c.broadcast(Buf::from_elems_mut(&mut b), len, DType::I64, root).unwrap();
                assert!(b.iter().enumerate().all(|(i, x)| *x == (call * 31 + i) as i64), "broadcast, call {call}");
                let mut r: Vec<i64> = (0..len).map(|i| (me + call + i) as i64).collect();
                c.reduce(Buf::from_elems_mut(&mut r), len, DType::I64, ReduceOp::Max, 1.0, root).unwrap();
                if me == root {
                    assert!(r.iter().enumerate().all(|(i, x)| *x == (n - 1 + call + i) as i64), "reduce, call {call}");
                }
                let mine: Vec<i64> = (0..len).map(|i| (me * 100_000 + call + i) as i64).collect();
                let mut all = vec![0i64; n * len];
                c.allgather(Buf::from_elems(&mine), Buf::from_elems_mut(&mut all), len, DType::I64).unwrap();
                for q in 0..n {
                    assert!((0..len).all(|i| all[q * len + i] == (q * 100_000 + call + i) as i64), "allgather, call {call}");
                }
            }
        });
    }
}

#[test]
fn own_pieces_read_in_place_give_exact_results_and_overlaps_are_refused() {
    // Reduce-scatter and alltoall read this rank's own piece from its input, allgather and
    // gather copy it from the input (or leave it, in place): values over several steps and
    // world sizes against per-element formulas; an input that overlaps the output in any
    // other way is refused on every rank, with nothing written.
    const SLOT4K: usize = 4096;
    for n in [1usize, 2, 3] {
        let outs = with_group(n, SLOT4K, move |me, c| {
            let len = 2500; // several 4 KiB steps per piece
            let input: Vec<i64> = (0..n * len).map(|i| (me * 1_000_000 + i) as i64).collect();
            let mut out = vec![-1i64; len];
            c.reduce_scatter(Buf::from_elems(&input), Buf::from_elems_mut(&mut out), len, DType::I64, ReduceOp::Sum, 1.0).unwrap();
            for (i, x) in out.iter().enumerate() {
                let want: i64 = (0..n).map(|r| (r * 1_000_000 + me * len + i) as i64).sum();
                assert_eq!(*x, want, "reduce_scatter, rank {me}, element {i}");
            }
            let mut a2a = vec![-1i64; n * len];
            c.alltoall(Buf::from_elems(&input), Buf::from_elems_mut(&mut a2a), len, DType::I64).unwrap();
            for q in 0..n {
                assert!((0..len).all(|i| a2a[q * len + i] == (q * 1_000_000 + me * len + i) as i64), "alltoall, rank {me}, piece {q}");
            }
            let mine = &input[..len];
            let mut all = vec![-1i64; n * len];
            c.allgather(Buf::from_elems(mine), Buf::from_elems_mut(&mut all), len, DType::I64).unwrap();
            let want_all: Vec<i64> = (0..n * len).map(|j| ((j / len) * 1_000_000 + j % len) as i64).collect();
            assert_eq!(all, want_all, "allgather out of place, rank {me}");
            let mut g = vec![-1i64; n * len];
            c.gather(Buf::from_elems(mine), Buf::from_elems_mut(&mut g), len, DType::I64, n - 1).unwrap();
            if me == n - 1 {
                assert_eq!(g, want_all, "gather");
            }
            // in place: the input is this rank's piece of the output
            let mut inplace = vec![-1i64; n * len];
            inplace[me * len..(me + 1) * len].copy_from_slice(mine);
            let base = inplace.as_mut_ptr();
            // SAFETY: both views lie in `inplace`, which outlives the call; the collective's
            // docs allow exactly this overlap.
            let (inp, outb) =
                unsafe { (Buf::from_raw_parts(base.add(me * len).cast(), len * 8), Buf::from_raw_parts(base.cast(), n * len * 8)) };
            c.allgather(inp, outb, len, DType::I64).unwrap();
            assert_eq!(inplace, want_all, "allgather in place, rank {me}");
            // any other overlap (rank 0 only; the others pass disjoint buffers) is refused
            let mut errs = Vec::new();
            let mut both = vec![7i64; (n + 1) * len];
            let p = both.as_mut_ptr();
            let mut fresh = vec![-1i64; n * len];
            // SAFETY: every view lies in `both` or `fresh`, which outlive the calls; the
            // overlaps are the point, and the calls refuse them before touching memory.
            let (ag_in, ag_out, rs_in, rs_out) = unsafe {
                if me == 0 {
                    (
                        Buf::from_raw_parts(p.add(1).cast(), len * 8),
                        Buf::from_raw_parts(p.cast(), n * len * 8),
                        Buf::from_raw_parts(p.cast(), n * len * 8),
                        Buf::from_raw_parts(p.add(n * len - 1).cast(), len * 8),
                    )
                } else {
                    (
                        Buf::from_raw_parts(p.cast(), len * 8),
                        Buf::from_raw_parts(fresh.as_mut_ptr().cast(), n * len * 8),
                        Buf::from_raw_parts(p.cast(), n * len * 8),
                        Buf::from_raw_parts(fresh.as_mut_ptr().cast(), len * 8),
                    )
                }
            };
            errs.push(c.allgather(ag_in, ag_out, len, DType::I64).err().map(|e| e.to_string()));
            errs.push(c.reduce_scatter(rs_in, rs_out, len, DType::I64, ReduceOp::Sum, 1.0).err().map(|e| e.to_string()));
            // the same overlaps as one item of a coalesced batch
            errs.push(c.allgather_coalesced(&[ag_in], &[ag_out], &[len], &[DType::I64]).err().map(|e| e.to_string()));
            let rs = c.reduce_scatter_coalesced(&[rs_in], &[rs_out], &[len], &[DType::I64], ReduceOp::Sum, 1.0);
            errs.push(rs.err().map(|e| e.to_string()));
            let untouched = both.iter().all(|x| *x == 7) && fresh.iter().all(|x| *x == -1);
            // the group is still usable
            let mut v = vec![me as i64; 3];
            c.allreduce(Buf::from_elems_mut(&mut v), 3, DType::I64, ReduceOp::Sum, 1.0).unwrap();
            (errs, untouched, v)
        });
        for (me, (errs, untouched, v)) in outs.iter().enumerate() {
            for e in errs {
                let e = e.as_deref().unwrap_or_else(|| panic!("rank {me} of {n}: an overlap was accepted"));
                let want = if me == 0 { "overlaps its input" } else { "rank 0 rejected its arguments" };
                assert!(e.contains(want), "rank {me} of {n}: {e}");
            }
            assert!(untouched, "rank {me} of {n}: a refused call wrote memory");
            assert_eq!(*v, vec![(n * (n - 1) / 2) as i64; 3]);
        }
    }
}

#[test]
fn two_step_allreduce_over_many_sub_blocks_and_odd_tails_is_exact() {
    // 256 KiB slots: each rank's slice of a chunk spans several of the 16 KiB blocks the
    // two-step allreduce reduces and copies out at a time, with a partial last block.
    const SLOT256K: usize = 256 * 1024;
    for n in [2usize, 3, 4] {
        with_group(n, SLOT256K, move |me, c| {
            for len in [100_003usize, 32_768 * 3 + 5] {
                let mut v: Vec<i64> = (0..len).map(|i| (me * 7_000_003 + i * 3) as i64).collect();
                c.allreduce(Buf::from_elems_mut(&mut v), len, DType::I64, ReduceOp::Sum, 1.0).unwrap();
                for (i, x) in v.iter().enumerate() {
                    let want: i64 = (0..n).map(|r| (r * 7_000_003 + i * 3) as i64).sum();
                    assert_eq!(*x, want, "n={n} rank {me} len {len} element {i}");
                }
                let mut f: Vec<f32> = (0..len).map(|i| ((me + i) % 1024) as f32).collect();
                c.allreduce(Buf::from_elems_mut(&mut f), len, DType::F32, ReduceOp::Max, 1.0).unwrap();
                for (i, x) in f.iter().enumerate() {
                    let want = (0..n).map(|r| ((r + i) % 1024) as f32).fold(f32::MIN, f32::max);
                    assert_eq!(*x, want, "max: n={n} rank {me} len {len} element {i}");
                }
            }
        });
    }
}

#[test]
fn streaming_stores_give_the_bytes_plain_ones_do_at_odd_sizes_and_offsets() {
    // Copies into the slots with streaming stores (`stream.rs`: a plain head up to the
    // slot's 16-byte boundary, 64-byte blocks, a plain tail, then sfence before the
    // arrival) against per-element formulas, for every slot collective, with inputs at
    // odd element offsets and counts whose chunks end mid-block; each rank picks its
    // mode, so mixed groups (one rank streaming, one not) are covered too.
    const SLOT64K: usize = 64 * 1024;
    for n in [2usize, 3] {
        for modes in [[Mode::Stream; 3], [Mode::Plain, Mode::Stream, Mode::Auto], [Mode::Auto; 3]] {
            with_group(n, SLOT64K, move |me, c| {
                c.set_stream_mode(modes[me]);
                for (k, len) in [5003usize, 8192 + 13, 40_000 + 7].into_iter().enumerate() {
                    for two_step in [false, true] {
                        c.set_plan(Plan { one_shot_max: if two_step { 0 } else { usize::MAX }, ..Plan::FALLBACK });
                        // one element in, so the source is not 16-byte aligned
                        let mut v: Vec<i64> = (0..=len).map(|i| (me * 1_000_003 + k * 7919 + i) as i64).collect();
                        c.allreduce(Buf::from_elems_mut(&mut v[1..]), len, DType::I64, ReduceOp::Sum, 1.0).unwrap();
                        for i in 0..len {
                            let want: i64 = (0..n).map(|r| (r * 1_000_003 + k * 7919 + i + 1) as i64).sum();
                            assert_eq!(v[i + 1], want, "allreduce two_step={two_step} len {len} element {i}");
                        }
                    }
                    let f = |q: usize, i: usize| (q * 100_000 + k * 31 + i) as i32;
                    let mine: Vec<i32> = (0..=len).map(|i| f(me, i.wrapping_sub(1))).collect();
                    let mut all = vec![0i32; n * len];
                    c.allgather(Buf::from_elems(&mine[1..]), Buf::from_elems_mut(&mut all), len, DType::I32).unwrap();
                    for q in 0..n {
                        assert!((0..len).all(|i| all[q * len + i] == f(q, i)), "allgather len {len} piece {q}");
                    }
                    let root = k % n;
                    let mut b: Vec<i32> = (0..len).map(|i| if me == root { f(root, i) } else { -1 }).collect();
                    c.broadcast(Buf::from_elems_mut(&mut b), len, DType::I32, root).unwrap();
                    assert!((0..len).all(|i| b[i] == f(root, i)), "broadcast len {len}");
                    let g = |src: usize, dst: usize, i: usize| (src * 1_000_000 + dst * 10_000 + i) as i64;
                    let input: Vec<i64> = (0..n).flat_map(|q| (0..len).map(move |i| g(me, q, i))).collect();
                    let mut out = vec![0i64; n * len];
                    c.alltoall(Buf::from_elems(&input), Buf::from_elems_mut(&mut out), len, DType::I64).unwrap();
                    for q in 0..n {
                        assert!((0..len).all(|i| out[q * len + i] == g(q, me, i)), "alltoall len {len} from {q}");
                    }
                    let mut piece = vec![0i64; len];
                    c.reduce_scatter(Buf::from_elems(&input), Buf::from_elems_mut(&mut piece), len, DType::I64, ReduceOp::Sum, 1.0)
                        .unwrap();
                    assert!((0..len).all(|i| piece[i] == (0..n).map(|q| g(q, me, i)).sum::<i64>()), "reduce_scatter len {len}");
                }
            });
        }
    }
}
