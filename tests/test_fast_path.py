"""The per-call fast paths of ``allreduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``broadcast`` and ``all_to_all_single`` (``_allreduce_fast``,
``_all_gather_single_fast``, ``_reduce_scatter_single_fast``, ``_broadcast_fast``,
``_all_to_all_single_fast``): the common case (contiguous CPU tensors, default options)
skips staging, and every other case still takes the full path with all its checks."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from support.stage_probe import counting_stages

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def staging_counted():
    """Within: ``count(fn)`` runs ``fn`` and returns ``(its result, how many tensors it
    staged)`` (``staging.stage`` calls; the fast paths make none)."""
    with counting_stages() as staged:
        def count(fn):
            staged.clear()
            return fn(), len(staged)
        yield count


def fast_and_full_paths():
    rank, n = dist.get_rank(), dist.get_world_size()
    with counting_stages() as staged:
        out = {}
        t = torch.full((5,), float(rank + 1))
        dist.all_reduce(t.clone())  # the first (op, dtype) pair is checked by the full path
        staged.clear()
        dist.all_reduce(t)
        out["fast"] = (t.tolist() == [n * (n + 1) / 2] * 5, len(staged))
        # a column view (stride 3): the full path stages it, whatever (op, dtype) pairs this
        # rank has already seen (``* (rank + 1)`` after the slice would make it contiguous)
        col = (torch.arange(12, dtype=torch.float64).reshape(4, 3) * (rank + 1))[:, 1]
        assert not col.is_contiguous()
        dist.all_reduce(col, op=dist.ReduceOp.MAX)
        out["strided"] = (col.tolist() == [float(3 * i + 1) * n for i in range(4)], len(staged))
        try:
            dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND)
            out["band"] = None
        except TypeError as exc:
            out["band"] = str(exc)
        # async_op=True: the common case is queued without staging, the rest as before
        staged.clear()
        a = torch.full((7,), float(rank + 1))
        work = dist.all_reduce(a, async_op=True)
        fut = work.get_future()
        work.wait()
        out["async"] = (a.tolist() == [n * (n + 1) / 2] * 7, fut.wait()[0].tolist() == a.tolist(), len(staged))
        col = (torch.arange(12, dtype=torch.float64).reshape(4, 3) * (rank + 1))[:, 1]
        assert not col.is_contiguous()
        dist.all_reduce(col, async_op=True).wait()
        out["async_strided"] = (col.tolist() == [float(3 * i + 1) * n * (n + 1) / 2 for i in range(4)], len(staged))
        i = torch.full((3,), rank + 1, dtype=torch.int32)
        dist.all_reduce(i, op=dist.ReduceOp.PRODUCT)
        out["int"] = i.tolist() == [2, 2, 2]
        return out


def test_common_case_skips_staging_and_other_cases_keep_their_checks(worlds, backend):
    if backend != "flagos_shm":
        pytest.skip("flagos_shm's per-call path")
    for r in worlds(2).run(fast_and_full_paths):
        assert r["fast"] == (True, 0), r
        assert r["strided"][0] and r["strided"][1] >= 1, r
        assert r["band"] and "BAND" in r["band"], r
        assert r["int"]
        assert r["async"] == (True, True, 0), r
        assert r["async_strided"][0] and r["async_strided"][1] >= 1, r


def gather_and_scatter_paths():
    """Each case: (result as expected, number of tensors staged)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    with staging_counted() as case:
        out = {}
        k = 5
        rows = [torch.arange(k, dtype=torch.float64) + 10 * r for r in range(n)]  # rank r's input

        def ag_out_of_place(async_op=False):
            o = torch.full((n * k,), -1.0, dtype=torch.float64)
            w = dist.all_gather_into_tensor(o, rows[rank].clone(), async_op=async_op)
            if async_op:
                w.wait()
            return o.tolist() == torch.cat(rows).tolist()
        out["ag"] = case(ag_out_of_place)
        out["ag_async"] = case(lambda: ag_out_of_place(True))

        def ag_in_place():
            o = torch.full((n * k,), -1.0, dtype=torch.float64)
            o[rank * k:(rank + 1) * k] = rows[rank]
            dist.all_gather_into_tensor(o, o[rank * k:(rank + 1) * k])
            return o.tolist() == torch.cat(rows).tolist()
        out["ag_in_place"] = case(ag_in_place)

        def ag_overlap():  # the input overlaps the output, but is not this rank's piece
            o = torch.full((n * k + 1,), -1.0, dtype=torch.float64)
            inp = o[1:k + 1]
            inp.copy_(rows[rank])
            dist.all_gather_into_tensor(o[:n * k], inp)
            return o[:n * k].tolist() == torch.cat(rows).tolist()
        out["ag_overlap"] = case(ag_overlap)

        def ag_bad_size():
            try:
                dist.all_gather_into_tensor(torch.empty(n * k + 1), torch.ones(k))
            except ValueError as exc:
                return "output" in str(exc)
            return False
        out["ag_bad"] = case(ag_bad_size)

        # reduce-scatter: rank r contributes (r + 1) * [0, 1, ..., n*k); rank q gets its slice times n(n+1)/2
        full = torch.arange(n * k, dtype=torch.float32)
        want = (full[rank * k:(rank + 1) * k] * (n * (n + 1) / 2)).tolist()

        def rs(async_op=False, op=dist.ReduceOp.SUM):
            o = torch.full((k,), -1.0)
            w = dist.reduce_scatter_tensor(o, full * (rank + 1), op=op, async_op=async_op)
            if async_op:
                w.wait()
            return o.tolist()
        dist.reduce_scatter_tensor(torch.empty(k), full.clone())  # the first (op, dtype) pair: full path
        out["rs"] = case(lambda: rs() == want)
        out["rs_async"] = case(lambda: rs(True) == want)
        rs(op=dist.ReduceOp.MAX)  # the first MAX of float32: full path
        out["rs_max"] = case(lambda: rs(op=dist.ReduceOp.MAX) == (full[rank * k:(rank + 1) * k] * n).tolist())

        def rs_overlap():  # the output is inside the input: the full path copies the input
            buf = full * (rank + 1)
            dist.reduce_scatter_tensor(buf[:k], buf)
            return buf[:k].tolist() == want
        out["rs_overlap"] = case(rs_overlap)

        def rs_bad_op():
            try:
                dist.reduce_scatter_tensor(torch.empty(k), full.clone(), op=dist.ReduceOp.BAND)
            except TypeError as exc:
                return "BAND" in str(exc)
            return False
        out["rs_bad_op"] = case(rs_bad_op)
        return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_and_scatter_common_cases_skip_staging(worlds, backend, world_size):
    if backend != "flagos_shm":
        pytest.skip("flagos_shm's per-call path")
    for r in worlds(world_size).run(gather_and_scatter_paths):
        for name in ("ag", "ag_async", "ag_in_place", "rs", "rs_async", "rs_max"):
            assert r[name] == (True, 0), (name, r)
        for name in ("ag_overlap", "rs_overlap"):  # full path: the input is copied (staged again)
            assert r[name][0] and r[name][1] >= 3, (name, r)
        assert r["ag_bad"][0] and r["rs_bad_op"][0], r


def broadcast_paths():
    """Each case: (result as expected, number of tensors staged)."""
    rank, n = dist.get_rank(), dist.get_world_size()

    def bcast(root, async_op=False, dtype=torch.int64):
        t = (torch.arange(9, dtype=dtype) * (root + 3)) if rank == root else torch.full((9,), -1, dtype=dtype)
        w = dist.broadcast(t, src=root, async_op=async_op)
        if async_op:
            w.wait()
        return t.tolist() == (torch.arange(9, dtype=dtype) * (root + 3)).tolist()

    with staging_counted() as case:
        out = {f"root{r}": case(lambda r=r: bcast(r)) for r in range(n)}
        out["async"] = case(lambda: bcast(n - 1, True))
        out["half"] = case(lambda: bcast(0, dtype=torch.bfloat16))

        def strided():  # not contiguous: the full path
            t = torch.zeros(4, 3)
            if rank == 0:
                t[:, 1] = torch.arange(4.0)
            col = t[:, 1]
            dist.broadcast(col, src=0)
            return col.tolist() == [0.0, 1.0, 2.0, 3.0]
        out["strided"] = case(strided)
        return out


def test_broadcast_common_case_skips_staging(worlds, backend):
    if backend != "flagos_shm":
        pytest.skip("flagos_shm's per-call path")
    for r in worlds(3).run(broadcast_paths):
        for name in ("root0", "root1", "root2", "async", "half"):
            assert r[name] == (True, 0), (name, r)
        assert r["strided"][0] and r["strided"][1] >= 1, r


def _a2a_rows(src, dst, rows, dtype=torch.float64):
    """Rank ``src``'s all-to-all input piece for rank ``dst``: ``rows`` rows of 2 values
    that name both ranks and the position (so a piece from the wrong rank, or for the
    wrong rank, or shifted, cannot match)."""
    return (torch.arange(2 * rows, dtype=torch.float64) + 1000 * src + 100 * dst).reshape(rows, 2).to(dtype)


def all_to_all_paths():
    """Each case: (result as expected, number of tensors staged). The expected output is
    built piece by piece from :func:`_a2a_rows` (what every peer sends this rank), not by
    another all-to-all."""
    rank, n = dist.get_rank(), dist.get_world_size()
    k = 3  # rows per piece

    def inp(dtype=torch.float64):
        return torch.cat([_a2a_rows(rank, q, k, dtype) for q in range(n)])

    def want(dtype=torch.float64):
        return torch.cat([_a2a_rows(r, rank, k, dtype) for r in range(n)]).tolist()

    with staging_counted() as case:
        out = {}

        def plain(async_op=False, dtype=torch.float64):
            o = torch.full((n * k, 2), -1.0).to(dtype)
            w = dist.all_to_all_single(o, inp(dtype), async_op=async_op)
            if async_op:
                w.wait()
            return o.tolist() == want(dtype)
        out["fast"] = case(plain)
        out["async"] = case(lambda: plain(True))
        out["int32"] = case(lambda: plain(dtype=torch.int32))
        out["bf16"] = case(lambda: plain(dtype=torch.bfloat16))

        def flat():  # 1-D tensors: dim 0 is the element count
            o = torch.empty(n * k * 2, dtype=torch.float64)
            dist.all_to_all_single(o, inp().reshape(-1))
            return o.reshape(n * k, 2).tolist() == want()
        out["flat"] = case(flat)

        def in_place():  # output is input: the full path copies the input first
            t = inp()
            dist.all_to_all_single(t, t)
            return t.tolist() == want()
        out["in_place"] = case(in_place)

        def strided():  # a non-contiguous input: the full path stages it
            wide = torch.zeros(n * k, 4, dtype=torch.float64)
            wide[:, 1:3] = inp()
            o = torch.empty(n * k, 2, dtype=torch.float64)
            dist.all_to_all_single(o, wide[:, 1:3])
            return o.tolist() == want()
        out["strided"] = case(strided)

        def misaligned():  # address not a multiple of the element size: staged
            src = _misaligned(inp(torch.float32).reshape(-1).tolist(), torch.float32, 2)
            o = _misaligned([-1.0] * (n * k * 2), torch.float32, 2)
            dist.all_to_all_single(o, src)
            return o.reshape(n * k, 2).tolist() == want(torch.float32)
        out["misaligned"] = case(misaligned)

        def splits():  # explicit (even) split sizes: the full path
            o = torch.empty(n * k, 2, dtype=torch.float64)
            dist.all_to_all_single(o, inp(), output_split_sizes=[k] * n, input_split_sizes=[k] * n)
            return o.tolist() == want()
        out["splits"] = case(splits)

        def bad_rows():  # dim 0 not divisible by the world size: ValueError naming it
            try:
                dist.all_to_all_single(torch.empty(n * k + 1), torch.ones(n * k + 1))
            except ValueError as exc:
                return "dim 0" in str(exc)
            return False
        out["bad_rows"] = case(bad_rows)
        out["after"] = case(plain)  # the group still works after the refused call
        return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_common_case_skips_staging(worlds, backend, world_size):
    """all_to_all_single without split sizes on contiguous, aligned CPU tensors of one
    dtype goes straight to the core (nothing staged); in place, strided, misaligned and
    split-size calls keep the full path, with correct results; a call the full path
    refuses is refused on every rank and the group goes on."""
    results = worlds(world_size).run(all_to_all_paths)
    for r in results:
        assert all(ok for ok, _ in r.values()), r
        if backend == "flagos_shm":
            for name in ("fast", "async", "int32", "bf16", "flat", "after"):
                assert r[name][1] == 0, (name, r)
            for name in ("in_place", "strided", "misaligned", "splits"):
                assert r[name][1] >= 1, (name, r)


def async_off_calls():
    """With FLAGOS_SHM_ASYNC=0 every call runs inline; one that asked for async_op=True must
    still return a work (None crashed DDP's C++ parameter check, which waits on it)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    want = float(n * (n + 1) // 2)
    out = {}
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t.clone())  # the first (op, dtype) pair: full path
    w = dist.all_reduce(t, async_op=True)  # fast path
    out["fast"] = (w is not None and w.wait() is True, t.tolist() == [want] * 4)
    s = torch.full((8,), float(rank + 1))[::2]
    w = dist.all_reduce(s, async_op=True)  # strided: full path
    out["full"] = (w is not None and w.wait() is True, s.tolist() == [want] * 4)
    o = torch.zeros(2 * n)
    w = dist.all_gather_into_tensor(o, torch.full((2,), float(rank)), async_op=True)
    out["ag"] = (w is not None and w.wait() is True, o.tolist() == [float(r) for r in range(n) for _ in range(2)])
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))  # waits on its broadcasts
    model(torch.ones(5, 3) * (rank + 1)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g, op=dist.ReduceOp.MAX)
    out["ddp"] = all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))  # same on every rank
    return out


def test_async_op_with_async_off_still_returns_a_work(worlds, backend):
    if backend != "flagos_shm":
        pytest.skip("flagos_shm's FLAGOS_SHM_ASYNC")
    for r in worlds(2, FLAGOS_SHM_ASYNC="0").run(async_off_calls):
        assert r == {"fast": (True, True), "full": (True, True), "ag": (True, True), "ddp": True}, r


def _misaligned(values, dtype, shift):
    """A contiguous tensor holding ``values`` at an address ``shift`` bytes past a multiple
    of the element size (a view of a byte buffer at an odd offset, as numpy gives it)."""
    import numpy as np

    es = torch.empty(0, dtype=dtype).element_size()
    raw = np.zeros(len(values) * es + 64, np.uint8)
    start = (-raw.ctypes.data) % 64 + shift  # 64-aligned, then off by `shift`
    t = torch.frombuffer(memoryview(raw[start:start + len(values) * es]), dtype=dtype)
    t.copy_(torch.tensor(values, dtype=dtype))
    assert t.data_ptr() % es == shift, (t.data_ptr(), es, shift)
    return t


def misaligned_calls():
    """Collectives on tensors whose address is not a multiple of their element size: each
    case (dtype, shift) gives (result as expected, tensors staged: the full path)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    with staging_counted() as case:
        for dtype, shift in ((torch.float32, 1), (torch.float64, 4), (torch.int32, 2)):
            key = f"{str(dtype)[6:]}+{shift}"

            def allreduce():
                t = _misaligned([rank + 1.0] * 9, dtype, shift)
                dist.all_reduce(t)
                return t.tolist() == [n * (n + 1) // 2] * 9
            out["ar " + key] = case(allreduce)

            def allgather():
                t = _misaligned([rank * 10.0 + i for i in range(3)], dtype, shift)
                o = _misaligned([-1.0] * (3 * n), dtype, shift)
                dist.all_gather_into_tensor(o, t)
                return o.tolist() == [r * 10 + i for r in range(n) for i in range(3)]
            out["ag " + key] = case(allgather)

            def reduce_scatter():
                t = _misaligned([float(i + rank) for i in range(2 * n)], dtype, shift)
                o = _misaligned([-1.0, -1.0], dtype, shift)
                dist.reduce_scatter_tensor(o, t)
                return o.tolist() == [sum(2 * rank + j + r for r in range(n)) for j in range(2)]
            out["rs " + key] = case(reduce_scatter)

            def broadcast():
                t = _misaligned([7.0 + i if rank == 0 else 0.0 for i in range(5)], dtype, shift)
                dist.broadcast(t, src=0)
                return t.tolist() == [7 + i for i in range(5)]
            out["bc " + key] = case(broadcast)
    return out


def test_misaligned_tensors_are_staged_not_refused(worlds, backend):
    """A tensor at an address that is not a multiple of its element size (which the core
    refuses) works as with Gloo: the fast paths leave it to the full path, which stages it
    through an aligned buffer; it used to fail with the core's 'in_nbytes: address ... is
    not aligned'."""
    for r in worlds(3).run(misaligned_calls):
        assert all(ok for ok, _ in r.values()), r
        if backend == "flagos_shm":
            assert all(staged >= 1 for _, staged in r.values()), r


_ROUTED = ("_broadcast_digested", "broadcast", "_all_gather_single_digested", "all_gather_single",
           "_all_to_all_single_digested", "all_to_all_single", "_reduce_scatter_single_digested",
           "reduce_scatter_single")


def digested_routes():
    """Which of the group's Python methods the C++ adapter calls for broadcast,
    all_gather_into_tensor, all_to_all_single and reduce_scatter_tensor: spies on the class, installed before the
    group's backend is made (the adapter binds the methods when it is built)."""
    from flagos_shm.backend.group import ShmGroup

    rank, n = dist.get_rank(), dist.get_world_size()
    calls: list = []
    own = {name: name in ShmGroup.__dict__ for name in _ROUTED}
    saved = {name: getattr(ShmGroup, name) for name in _ROUTED}

    def spy(name, fn):
        def method(self, *args, **kwargs):
            calls.append(name)
            return fn(self, *args, **kwargs)
        return method

    for name in _ROUTED:
        setattr(ShmGroup, name, spy(name, saved[name]))
    out = {}
    try:
        g = dist.new_group(list(range(n)), backend="flagos_shm")

        def run(key, fn, check):
            calls.clear()
            value = fn()
            out[key] = (check(value), list(calls))

        t = torch.full((5,), float(rank))
        run("broadcast", lambda: dist.broadcast(t, src=n - 1, group=g), lambda _: t.tolist() == [n - 1.0] * 5)
        a = torch.full((6,), float(rank), dtype=torch.float64)
        run("broadcast async", lambda: dist.broadcast(a, src=0, group=g, async_op=True),
            lambda w: w.wait() and w.is_completed() and a.tolist() == [0.0] * 6)
        col = (torch.arange(12.0).reshape(4, 3) + rank)[:, 1]  # strided: the full path stages it
        run("broadcast strided", lambda: dist.broadcast(col, src=0, group=g), lambda _: col.tolist() == [1.0, 4, 7, 10])
        out_t = torch.zeros(3 * n, dtype=torch.int32)
        mine = torch.full((3,), rank, dtype=torch.int32)
        run("all_gather", lambda: dist.all_gather_into_tensor(out_t, mine, group=g),
            lambda _: out_t.tolist() == [r for r in range(n) for _ in range(3)])
        own_piece = torch.zeros(2 * n)
        own_piece[2 * rank:2 * rank + 2] = rank + 0.5  # in place: the input is this rank's piece
        run("all_gather in place",
            lambda: dist.all_gather_into_tensor(own_piece, own_piece[2 * rank:2 * rank + 2], group=g),
            lambda _: own_piece.tolist() == [r + 0.5 for r in range(n) for _ in range(2)])
        src = torch.arange(2 * n, dtype=torch.int64) + 100 * rank
        dst = torch.zeros(2 * n, dtype=torch.int64)
        want = [100 * q + 2 * rank + i for q in range(n) for i in range(2)]
        run("all_to_all", lambda: dist.all_to_all_single(dst, src, group=g), lambda _: dst.tolist() == want)
        same = torch.arange(2 * n, dtype=torch.int64) + 100 * rank  # input and output one tensor
        run("all_to_all overlapping", lambda: dist.all_to_all_single(same, same, group=g),
            lambda _: same.tolist() == want)
        # reduce_scatter_tensor: rank q's input element j is 10 * q + j (exact in float64 and
        # int32), so rank r's output element i is sum_q (10 * q + 2 * r + i)
        rs_in = torch.arange(2 * n, dtype=torch.float64) + 10 * rank
        rs_out = torch.zeros(2, dtype=torch.float64)
        rs_want = [sum(10 * q + 2 * rank + i for q in range(n)) for i in range(2)]
        run("reduce_scatter", lambda: dist.reduce_scatter_tensor(rs_out, rs_in, group=g),
            lambda _: rs_out.tolist() == rs_want)
        rs_max = torch.zeros(2, dtype=torch.int32)
        run("reduce_scatter max async",
            lambda: dist.reduce_scatter_tensor(rs_max, rs_in.to(torch.int32), op=dist.ReduceOp.MAX, group=g,
                                               async_op=True),
            lambda w: w.wait() and w.is_completed()
            and rs_max.tolist() == [10 * (n - 1) + 2 * rank + i for i in range(2)])
        whole = torch.arange(2 * n, dtype=torch.float64) + 10 * rank  # output inside the input
        run("reduce_scatter overlapping", lambda: dist.reduce_scatter_tensor(whole[:2], whole, group=g),
            lambda _: whole[:2].tolist() == rs_want)
        premul = torch.zeros(2, dtype=torch.float64)  # PREMUL_SUM: not in the adapter's table
        run("reduce_scatter premul",
            lambda: dist.reduce_scatter_tensor(premul, rs_in, op=dist._make_nccl_premul_sum(0.5), group=g),
            lambda _: premul.tolist() == [v * 0.5 for v in rs_want])
        dist.destroy_process_group(g)
    finally:
        for name in _ROUTED:
            if own[name]:
                setattr(ShmGroup, name, saved[name])
            else:
                delattr(ShmGroup, name)
    return out


def test_the_adapter_digests_the_common_cases_and_hands_the_rest_to_python(worlds, backend):
    """The C++ adapter takes the common broadcast, all_gather_into_tensor,
    all_to_all_single and reduce_scatter_tensor apart itself and calls the group's ``_*_digested`` method with
    numbers; a strided tensor goes to the Python method at once, and a call the digested
    method declines (input and output overlapping) goes on to it, whose fast path ends in the
    same digested method. Values against formulas."""
    if backend != "flagos_shm":
        pytest.skip("flagos_shm's adapter")
    for rank, r in enumerate(worlds(3).run(digested_routes)):
        assert all(ok for ok, _ in r.values()), (rank, r)
        assert r["broadcast"][1] == ["_broadcast_digested"], r
        assert r["broadcast async"][1] == ["_broadcast_digested"], r
        assert r["broadcast strided"][1] == ["broadcast"], r
        assert r["all_gather"][1] == r["all_gather in place"][1] == ["_all_gather_single_digested"], r
        assert r["all_to_all"][1] == ["_all_to_all_single_digested"], r
        # declined by the adapter's digested call, then by the Python fast path's (which ends
        # in the same method), then the full path
        assert r["all_to_all overlapping"][1] == ["_all_to_all_single_digested", "all_to_all_single",
                                                  "_all_to_all_single_digested"], r
        assert r["reduce_scatter"][1] == r["reduce_scatter max async"][1] == ["_reduce_scatter_single_digested"], r
        assert r["reduce_scatter overlapping"][1] == ["_reduce_scatter_single_digested", "reduce_scatter_single",
                                                      "_reduce_scatter_single_digested"], r
        assert r["reduce_scatter premul"][1] == ["reduce_scatter_single"], r
