"""Asynchronous collectives: ``async_op=True`` runs on the group's progress thread.

Checked against values: a call returns before a late peer has arrived and completes with
the right result; queued and inline calls keep issue order; errors and timeouts reach
``wait()`` and the future; an idle progress thread uses no CPU; DDP overlaps its bucket
allreduces with the backward pass on the (emulated) flagos device.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from support.flagos import EMU_ENV
from support.turns import let_go, wait_for_go

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _only_flagos_shm(backend):
    if backend != "flagos_shm":
        pytest.skip("tests flagos_shm's progress thread")


# ---- rank functions -------------------------------------------------------------------------

def finished(work) -> bool:
    """Whether ``work`` has completed, asked both ways a caller can: ``is_completed()`` and its
    future; the two must agree (flagos_shm's works report completion truthfully)."""
    done, fut_done = work.is_completed(), work.get_future().done()
    assert done == fut_done or done, (done, fut_done)  # the future settles right after the work
    return done


def rank_returns_early(delay_s: float) -> dict:
    """Rank 0 issues an async allreduce while the other ranks wait: they join only once it
    has returned and been found incomplete, and ``delay_s`` later. (They used to sleep
    ``delay_s`` and join, which a rank 0 descheduled on a loaded machine could outlast.)"""
    rank, n = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    t = torch.full((1 << 16,), float(rank + 1))
    if rank != 0:
        wait_for_go(f"async/returns_early/{rank}")
        time.sleep(delay_s)
    t0 = time.perf_counter()
    work = dist.all_reduce(t, async_op=True)
    issue_s = time.perf_counter() - t0
    completed_at_issue = finished(work)
    if rank == 0:
        for peer in range(1, n):
            let_go(f"async/returns_early/{peer}")
    fut = work.get_future()
    work.wait()
    value = fut.wait()[0]
    expected = float(sum(range(1, n + 1)))
    return {"issue_s": issue_s, "completed_at_issue": completed_at_issue, "done": finished(work),
            "ok": bool(torch.all(t == expected)) and value is t or torch.equal(value, t)}


def rank_issue_order() -> list:
    """Async calls of several kinds, an inline call in the middle, waited in reverse order."""
    rank, n = dist.get_rank(), dist.get_world_size()
    results = []
    works = []
    a = [torch.arange(7, dtype=torch.float64) * (rank + 1) + i for i in range(5)]
    works += [dist.all_reduce(x, async_op=True) for x in a]
    b = torch.full((5,), float(rank)) if rank == 1 else torch.zeros(5)
    works.append(dist.broadcast(b, src=1, async_op=True))
    inline = torch.full((3,), 2.0 ** rank)
    dist.all_reduce(inline, op=dist.ReduceOp.MAX)  # synchronous: after everything queued before it
    g_in = torch.arange(3, dtype=torch.int32) + 10 * rank
    g_out = torch.empty(3 * n, dtype=torch.int32)
    works.append(dist.all_gather_into_tensor(g_out, g_in, async_op=True))
    rs_in = torch.arange(2 * n, dtype=torch.float32) * (rank + 1)
    rs_out = torch.empty(2)
    works.append(dist.reduce_scatter_tensor(rs_out, rs_in, async_op=True))
    gl = [torch.empty(4, dtype=torch.int64) for _ in range(n)]
    works.append(dist.all_gather(gl, torch.full((4,), rank, dtype=torch.int64), async_op=True))
    for w in reversed(works):
        w.wait()
    results += [x.tolist() for x in a]
    results += [b.tolist(), inline.tolist(), g_out.tolist(), rs_out.tolist(), [x.tolist() for x in gl]]
    return results


def rank_staged_after_in_place() -> dict:
    """An async call that writes its output in place (a contiguous CPU tensor: nothing to
    write back), then a call whose full path stages a copy of that memory (a strided view):
    the copy must see the first call's result. Rank 1 joins each async call 50 ms late, so
    on rank 0 it is still running when the second call stages."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}

    def late():
        if rank == 1:
            time.sleep(0.05)

    t = torch.ones(1000)
    late()
    w = dist.all_reduce(t, async_op=True)  # the fast path
    dist.all_reduce(t[::2])  # strided: staged
    w.wait()
    out["allreduce"] = t[:4].tolist()
    k = 500
    o = torch.zeros(n * k)
    late()
    w = dist.all_gather_into_tensor(o, torch.full((k,), rank + 1.0), async_op=True)
    w2 = dist.all_reduce(o[::2], async_op=True)  # strided, async: staged as well
    w2.wait()
    w.wait()
    out["allgather"] = [o[0].item(), o[1].item(), o[k].item(), o[k + 1].item()]
    return out


def rank_async_mismatch() -> dict:
    """Rank 0 and rank 1 disagree on the element count of an async allreduce."""
    rank = dist.get_rank()
    t = torch.ones(4 + rank)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    out = {}
    try:
        work.wait()
        out["wait"] = "no error"
    except ValueError as exc:
        out["wait"] = f"ValueError: {exc}"
    try:
        fut.wait()
        out["future"] = "no error"
    except Exception as exc:  # noqa: BLE001  the type torch re-raises with is reported
        out["future"] = f"{type(exc).__name__}: {exc}"
    out["untouched"] = bool(torch.all(t == 1))
    after = torch.full((3,), float(rank))
    dist.all_reduce(after, async_op=True).wait()  # the group is still usable
    out["after"] = after.tolist()
    return out


def rank_sync_after_async(rounds: int) -> dict:
    """An async allreduce of a non-contiguous tensor (its result is written back by the
    completion callback), then a synchronous allreduce on the same group: when the
    synchronous call returns, the async work must be complete with its values in place."""
    rank, n = dist.get_rank(), dist.get_world_size()
    incomplete, wrong = 0, 0
    for i in range(rounds):
        base = torch.full((64, 2), float(rank + i))
        t = base[:, 0]  # stride 2: staged through a copy
        work = dist.all_reduce(t, async_op=True)
        dist.all_reduce(torch.ones(1))
        incomplete += not finished(work)
        wrong += not torch.equal(t, torch.full((64,), float(sum(q + i for q in range(n)))))
        work.wait()
    return {"incomplete": incomplete, "wrong": wrong}


def rank_ctrl_c_in_async_wait() -> dict:
    """Rank 0 waits on an async allreduce that rank 1 joins late; SIGINT arrives while the
    job runs on rank 0's waiting thread (Work.wait helps): KeyboardInterrupt, group aborted."""
    import signal
    import threading

    rank = dist.get_rank()
    group = dist.new_group(list(range(dist.get_world_size())))
    out = {}
    try:
        t = torch.ones(8)
        if rank == 0:
            previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # see test_release_waiting
            timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
            try:
                work = dist.all_reduce(t, group=group, async_op=True)
                timer.start()
                try:
                    work.wait()
                    out["wait"] = "no error"
                except KeyboardInterrupt:
                    out["wait"] = "KeyboardInterrupt"
                except Exception as exc:  # noqa: BLE001  reported
                    out["wait"] = f"{type(exc).__name__}: {exc}"
                timer.join()
            finally:
                signal.signal(signal.SIGINT, previous)
            out["untouched"] = torch.equal(t, torch.ones(8))
        out["later"] = _later_call(group, t)
    finally:
        dist.destroy_process_group(group)
    return out


def _later_call(group, t) -> str:
    """Line the ranks up on the default group (rank 1 issues its call only now, on a group
    rank 0 aborted), then all_reduce on ``group``: what it raised."""
    dist.barrier()
    try:
        dist.all_reduce(t, group=group)
        return "no error"
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"



def _timed_wait(work, seconds: float, out: dict) -> None:
    """``work.wait(timeout=seconds)``; record in ``out`` how it ended (``"wait"``) and how
    long it took (``"waited_s"``, seconds)."""
    t0 = time.perf_counter()
    try:
        work.wait(timeout=timedelta(seconds=seconds))
        out["wait"] = "no error"
    except RuntimeError as exc:
        out["wait"] = f"RuntimeError: {exc}"
    out["waited_s"] = time.perf_counter() - t0

def rank_wait_timeout() -> dict:
    """Work.wait(timeout) on a collective a peer joins too late: RuntimeError, group aborted."""
    rank = dist.get_rank()
    group = dist.new_group(list(range(dist.get_world_size())))
    out = {}
    try:
        t = torch.ones(8)
        if rank == 0:
            work = dist.all_reduce(t, group=group, async_op=True)
            _timed_wait(work, 0.3, out)
        out["later"] = _later_call(group, t)
    finally:
        dist.destroy_process_group(group)
    return out


def rank_timed_wait_in_callback() -> dict:
    """A completion callback's Work.wait(timeout) on a collective its peer never issues:
    the callback's thread runs it (no other thread may), for at most the timeout."""
    rank = dist.get_rank()
    group = dist.new_group(list(range(dist.get_world_size())))
    out = {}
    try:
        t = torch.ones(8)
        if rank == 1:
            dist.barrier()  # rank 0 has attached its callback: it runs on the progress thread
        first = dist.all_reduce(t, group=group, async_op=True)
        if rank == 0:
            never = dist.all_reduce(torch.ones(8), group=group, async_op=True)  # rank 1 never issues it

            def waits(fut) -> None:
                _timed_wait(never, 0.5, out)

            done = first.get_future().then(waits)
            dist.barrier()
            done.wait()
            out["never"] = [never.is_completed(), never.is_success()]
        first.wait()
        out["later"] = _later_call(group, t)
    finally:
        dist.destroy_process_group(group)
    return out


def rank_future_taken_in_callback_across_groups() -> dict:
    """A completion callback that takes a later work's future only to chain on it, then
    calls on another group, as NCCL allows (each group's calls in the same order on every
    rank): rank 0 issues A1 and A3 on group A, and A1's callback takes A3's future and
    reduces y on group B; rank 1 reduces y on B before it issues A3. Taking the future must
    not run A3 (it needs rank 1, which waits on B for the callback): a build that did
    deadlocked until the groups' timeout (a review, 2026-12-07)."""
    rank = dist.get_rank()
    ranks = list(range(dist.get_world_size()))
    a, b = dist.new_group(ranks, timeout=timedelta(seconds=20)), dist.new_group(ranks, timeout=timedelta(seconds=20))
    a1, a3, y = torch.full((4,), rank + 1.0), torch.full((4,), 10 * (rank + 1.0)), torch.full((4,), 100 * (rank + 1.0))
    out = {}
    try:
        if rank == 0:
            w1 = dist.all_reduce(a1, group=a, async_op=True)
            w3 = dist.all_reduce(a3, group=a, async_op=True)

            def chains(fut) -> None:
                f3 = w3.get_future()
                out["chained"] = f3.then(lambda f: f.value()[0][0].item())
                dist.all_reduce(y, group=b)

            w1.get_future().then(chains).wait()
            w3.wait()
            out["chained"] = out["chained"].wait()
        else:
            time.sleep(0.3)  # rank 0's callback is attached before A1 can complete
            w1 = dist.all_reduce(a1, group=a, async_op=True)
            dist.all_reduce(y, group=b)
            w3 = dist.all_reduce(a3, group=a, async_op=True)
            w1.wait()
            w3.wait()
        out["values"] = [a1[0].item(), a3[0].item(), y[0].item()]
    finally:
        dist.destroy_process_group(a)
        dist.destroy_process_group(b)
    return out


def rank_idle_thread(idle_s: float) -> dict:
    """After async calls, the group's progress thread parks on its condition variable and
    does not wake while nothing is submitted, nor for synchronous calls (the core counts its wakeups: no CPU-time
    measurement, no thread listing); destroy_process_group joins it."""
    import flagos_shm

    group = dist.new_group(list(range(dist.get_world_size())))
    comm = flagos_shm.backend.shm_part(group)._comm
    try:
        for _ in range(20):
            dist.all_reduce(torch.ones(1000), group=group, async_op=True).wait()
        # The thread may still be on its way back to the wait, or not have run yet since
        # the last submission woke it (it runs SCHED_BATCH: a wake-up does not preempt
        # this thread, and wait() ran the call itself): wait, boundedly, until it has been
        # parked with an unchanged wake-up count for 3 checks 50 ms apart.
        deadline = time.monotonic() + 10.0
        last, stable = None, 0
        while stable < 3 and time.monotonic() < deadline:
            state = comm.progress_thread
            stable = stable + 1 if state[1] and state == last else 0
            last = state
            time.sleep(0.05)
        running, parked, before = comm.progress_thread
        time.sleep(idle_s)
        _, parked_after, after = comm.progress_thread
        # Synchronous calls run on this thread and do not wake the idle one either.
        for _ in range(20):
            dist.all_reduce(torch.ones(1000), group=group)
        time.sleep(0.2)
        _, parked_sync, after_sync = comm.progress_thread
    finally:
        dist.destroy_process_group(group)
    return {"running": running, "parked": parked and parked_after and parked_sync,
            "wakeups_while_idle": after - before, "wakeups_during_sync_calls": after_sync - after,
            "running_after_destroy": comm.progress_thread[0]}


def rank_ddp_overlap(steps: int) -> dict:
    """DDP on flagos tensors with a comm hook that timestamps each bucket's allreduce."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    dev = torch.device("flagos", dist.get_rank())
    layers = [torch.nn.Linear(512, 512) for _ in range(6)]
    model = DDP(torch.nn.Sequential(*layers).to(dev), bucket_cap_mb=1)
    events: list = []

    def hook(state, bucket):
        events.append(("issue", bucket.index(), time.perf_counter()))
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

        def done(f):
            events.append(("done", bucket.index(), time.perf_counter()))
            return f.value()[0]
        return fut.then(done)

    model.register_comm_hook(None, hook)
    x = torch.randn(256, 512).to(dev)
    overlapped = 0
    for _ in range(steps):
        events.clear()
        model(x).square().mean().backward()
        issued = {i: t for kind, i, t in events if kind == "issue"}
        done = {i: t for kind, i, t in events if kind == "done"}
        last_issue = max(issued.values())
        # A bucket whose allreduce finished after a later bucket was issued ran while the
        # backward pass went on computing that later bucket's gradients.
        overlapped += sum(1 for i, t in done.items() if t > min((u for j, u in issued.items() if u > issued[i]),
                                                                default=float("inf")))
        buckets = len(issued)
        assert last_issue <= max(done.values())
    grads_equal = []
    for p in model.parameters():
        g = p.grad.cpu()
        other = g.clone()
        dist.broadcast(other, src=0)
        grads_equal.append(torch.equal(g, other))
    return {"buckets": buckets, "overlapped": overlapped, "grads_equal": all(grads_equal)}


def rank_collectives_from_callbacks(device: str) -> dict:
    """Completion callbacks (``get_future().then``) that issue collectives on the same group:
    one runs a synchronous allreduce while a later asynchronous call is still queued, one
    queues an allreduce and waits for its future (PowerSGD's DDP hook does), one reduces
    the finished work's own result again (on a device, whose copy back the call orders
    after). Each callback is attached after every call this thread issues before it, so the
    group's order is the same on every rank whichever thread runs the callback."""
    rank = dist.get_rank()
    dev = torch.device("flagos", rank) if device == "flagos" else torch.device("cpu")
    a, b, c, d, e, f = (torch.full((3,), float(rank + k), device=dev) for k in (1, 10, 100, 1000, 10000, 5))

    def sync(fut):
        dist.all_reduce(c)
        return c * 2

    def waits(fut):
        return dist.all_reduce(b, async_op=True).get_future().wait()[0] * 2

    def again(fut):
        return dist.all_reduce(fut.value()[0], async_op=True).get_future().wait()[0]

    first = dist.all_reduce(a, async_op=True)
    queued = dist.all_reduce(d, async_op=True)
    res = {"sync": first.get_future().then(sync).wait().tolist()}
    queued.wait()
    res["waits"] = dist.all_reduce(e, async_op=True).get_future().then(waits).wait().tolist()
    res["again"] = dist.all_reduce(f, async_op=True).get_future().then(again).wait().tolist()
    dist.all_reduce(later := torch.ones(2, device=dev))
    res.update({k: v.tolist() for k, v in (("a", a), ("d", d), ("e", e), ("f", f), ("later", later))})
    return res


def rank_callbacks_issue_while_calls_wait(rounds: int) -> dict:
    """Two ways a completion callback that issues a collective met a call holding the
    group's issue lock, which hung both ranks forever before ``_CallGate``:
    - *nested*: two async allreduces, each with a ``.then`` callback that issues another;
      the first callback's call runs the queued second call (and so its callback) on the
      same thread, inside the first call's issue;
    - *beside a synchronous call*: a ``.then`` callback (on the progress thread) issues an
      allreduce while the main thread's synchronous allreduce waits for that callback.
    Every tensor holds ``rank + 1`` (so the result is ``n * (n + 1) / 2`` whichever calls a
    callback's call meets on the other ranks: whether a callback runs at ``.then`` or later
    differs between ranks)."""
    rank = dist.get_rank()
    results = []
    for _ in range(rounds):
        a, b, c, d, x, y, z = (torch.full((1000,), float(rank + 1)) for _ in range(7))
        works = []
        f1 = dist.all_reduce(a, async_op=True).get_future().then(
            lambda fut: works.append(dist.all_reduce(c, async_op=True)))
        f2 = dist.all_reduce(b, async_op=True).get_future().then(
            lambda fut: works.append(dist.all_reduce(d, async_op=True)))
        f1.wait()
        f2.wait()
        f3 = dist.all_reduce(x, async_op=True).get_future().then(
            lambda fut: works.append(dist.all_reduce(z, async_op=True)))
        dist.all_reduce(y)
        f3.wait()
        for w in works:
            w.wait()
        results.append(sorted({float(t[0]) for t in (a, b, c, d, x, y, z)} | {float(t.min()) for t in (c, d, z)}))
    return {"values": results, "issued": len(works)}


def rank_futures_taken_late(rounds: int) -> dict:
    """Futures taken only after later calls were issued, their callbacks issuing collectives.
    Rank 0 issues half a second late, and takes the futures 0.3 s after that: its callbacks
    run at ``.then`` on the main thread, in NCCL's order; the other ranks' run on the
    progress thread, where they must keep that order:
    - *shared anchor*: w1, w2, w3 issued, then w1's and w2's futures given callbacks that
      each reduce one tensor: x1, then x2 (before, w2's callback ran inside x1's wait and
      its call went first: reduced crosswise);
    - *nested*: w1, w2 issued, then w1's callback reduces y1 (async, waited for) and y2, and
      w2's reduces y3: y1, y2, y3 (w2's callback, run inside y1's wait, now waits for w1's
      to return);
    - *two waiters*: w1, w2 issued, both futures given callbacks (sync, then async plus
      ``wait``), then ``w1.wait()``: the main thread and the progress thread each ran one
      job's callback and waited for the other (before: for good);
    - *waits for a later work*: w1, w2, w3 issued, then w1's callback waits for w3 (or
      w2; w3 a list-form reduce-scatter, a coalesced batch, waited for with a timeout, or
      failing) and reduces z1, w2's reduces z2,
      w3's z3: z1, z2, z3 (before, the wait ran w3's callback, and so z3's call, ahead of
      z1's on the ranks that ran it on the progress thread: reduced crosswise); the waited
      work is complete once ``wait`` returned or raised, its future done, and a callback
      attached to it then runs at once (z4 before z1), though the one attached earlier
      has not run yet."""
    rank = dist.get_rank()

    def late() -> None:
        if rank == 0:
            time.sleep(0.3)

    if rank == 0:
        time.sleep(0.5)
    a, b, c = (torch.ones(4) for _ in range(3))
    x1, x2 = torch.full((4,), 1.0 * (rank + 1)), torch.full((4,), 100.0 * (rank + 1))
    works = [dist.all_reduce(t, async_op=True) for t in (a, b, c)]
    late()
    f1 = works[0].get_future().then(lambda f: dist.all_reduce(x1))
    f2 = works[1].get_future().then(lambda f: dist.all_reduce(x2))
    f1.wait()
    f2.wait()
    works[2].wait()
    res = {"shared": [x1[0].item(), x2[0].item(), a[0].item(), b[0].item(), c[0].item()]}

    if rank == 0:
        time.sleep(0.5)
    y1, y2, y3 = (torch.full((4,), k * (rank + 1.0)) for k in (1, 10, 100))

    def first(fut):
        dist.all_reduce(y1, async_op=True).wait()
        dist.all_reduce(y2)

    w1, w2 = dist.all_reduce(torch.ones(4), async_op=True), dist.all_reduce(torch.ones(4), async_op=True)
    late()
    f1 = w1.get_future().then(first)
    f2 = w2.get_future().then(lambda f: dist.all_reduce(y3))
    f1.wait()
    f2.wait()
    res["nested"] = [y1[0].item(), y2[0].item(), y3[0].item()]

    res["waiters"] = []
    for _ in range(rounds):
        a, b, c, d = (torch.full((100,), float(rank + 1)) for _ in range(4))
        w1, w2 = dist.all_reduce(a, async_op=True), dist.all_reduce(b, async_op=True)
        f1 = w1.get_future().then(lambda f: dist.all_reduce(c))
        f2 = w2.get_future().then(lambda f: dist.all_reduce(d, async_op=True).get_future().wait())
        w1.wait()
        f1.wait()
        f2.wait()
        res["waiters"].append(sorted({t[0].item() for t in (a, b, c, d)}))

    n = dist.get_world_size()
    res["waits_later"], res["waited_state"], res["waited_failed"] = [], [], []
    cases = ((2, "allreduce"), (1, "allreduce"), (2, "reduce_scatter"), (2, "coalesced"), (2, "timed"), (2, "fails"))
    for waited, third in cases:
        if rank == 0:
            time.sleep(0.5)
        z = [torch.full((4,), k * (rank + 1.0)) for k in (1, 10, 100, 1000)]
        works = [dist.all_reduce(torch.ones(4), async_op=True) for _ in range(2)]
        if third == "reduce_scatter":  # the list form: its ``done`` is wrapped (_naming)
            works.append(dist.reduce_scatter(torch.zeros(4), [torch.ones(4)] * n, async_op=True))
        elif third == "coalesced":  # a CoalescedWork
            with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
                dist.all_reduce(torch.ones(3))
                dist.all_reduce(torch.ones(5))
            works.append(cm.works[0])
        else:  # "fails": the ranks pass different sizes (ValueError on every rank)
            works.append(dist.all_reduce(torch.ones(4 + rank * (third == "fails")), async_op=True))
        late()

        def waits(fut, later=works[waited], third=third):
            try:
                later.wait(timeout=timedelta(seconds=60)) if third == "timed" else later.wait()
            except ValueError:
                # (Not Work.exception(): torch 2.10's binding cannot return its value.)
                res["waited_failed"].append([later.is_completed(), later.is_success(), later.get_future().done()])
                dist.all_reduce(z[3])
                dist.all_reduce(z[0])
                return
            # Complete, as NCCL's would be: its future too, and a callback attached to it
            # now runs at once (its call before z[0]'s), though the callback attached
            # before (z[2]'s) runs after this one.
            res["waited_state"].append([later.is_completed(), later.get_future().done()])
            later.get_future().then(lambda f: dist.all_reduce(z[3])).wait()
            dist.all_reduce(z[0])

        futures = [works[0].get_future().then(waits)]
        futures += [w.get_future().then(lambda f, t=t: dist.all_reduce(t)) for w, t in zip(works[1:], z[1:3])]
        for f in futures:
            f.wait()
        res["waits_later"].append([t[0].item() for t in z])
    return res


def rank_powersgd(steps: int, layers: int = 1, bucket_cap_mb: float = 25.0) -> dict:
    """DDP with torch's PowerSGD comm hook (its callbacks issue allreduces and wait for their
    futures), trained once over the world group (callbacks on its progress thread) and once
    over a group whose calls all run inline on the calling thread (``FLAGOS_SHM_ASYNC=0``,
    where the callbacks run right away on the thread that issued the call) from the same
    start; the parameters must be bitwise equal. (Not a Gloo group: its worker threads run
    the hook's callbacks and may drop the last reference to the group, whose destructor
    then joins its own thread and aborts the process, torch's own hazard.)"""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    os.environ["FLAGOS_SHM_ASYNC"] = "0"
    try:
        inline = dist.new_group(backend="flagos_shm")
    finally:
        del os.environ["FLAGOS_SHM_ASYNC"]
    params = []
    for group in (None, inline):
        torch.manual_seed(0)
        hidden = [m for _ in range(layers) for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())]
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), *hidden, torch.nn.Linear(64, 3))
        ddp = DDP(model, process_group=group, bucket_cap_mb=bucket_cap_mb)
        state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                       min_compression_rate=0.5)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(steps):
            torch.manual_seed(step * 10 + rank)
            opt.zero_grad()
            ddp(torch.randn(6, 32)).pow(2).mean().backward()
            opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
        buckets = len(ddp.reducer._get_zeros_like_grad_buckets()) if hasattr(ddp, "reducer") else 0
        del ddp, state, opt
    dist.destroy_process_group(inline)
    return {"buckets": buckets, "equal_to_inline": all(torch.equal(x, y) for x, y in zip(*params)),
            "moved": not torch.equal(params[0][0], torch.nn.Linear(32, 64).weight)}


# ---- tests ----------------------------------------------------------------------------------

def test_async_call_returns_before_a_late_peer_arrives(worlds):
    delay = 0.5
    r0, r1 = worlds(2).run(rank_returns_early, delay)
    # Rank 1 joins only after rank 0's call returned (a call that waited for it would hang
    # until the harness's deadline); the bound is generous for a loaded machine.
    assert r0["issue_s"] < 2.0, r0
    assert not r0["completed_at_issue"], r0
    assert r0["done"] and r0["ok"] and r1["ok"], (r0, r1)


@pytest.mark.parametrize("world_size", [2, 3])
def test_async_and_inline_calls_keep_issue_order(worlds, world_size):
    n = world_size
    got = worlds(n).run(rank_issue_order)
    for rank, res in enumerate(got):
        for i in range(5):
            assert res[i] == [float(sum((q + 1) * k + i for q in range(n))) for k in range(7)], (rank, i)
        assert res[5] == [1.0] * 5
        assert res[6] == [2.0 ** (n - 1)] * 3
        assert res[7] == [10 * q + k for q in range(n) for k in range(3)]
        full = [sum((q + 1) * k for q in range(n)) for k in range(2 * n)]
        assert res[8] == [float(v) for v in full[2 * rank:2 * rank + 2]]
        assert res[9] == [[q] * 4 for q in range(n)]


def test_staged_call_waits_for_an_earlier_in_place_async_call(worlds):
    n = 2
    for r in worlds(n).run(rank_staged_after_in_place):
        assert r["allreduce"] == [n * n, n, n * n, n], r  # both sums, the second over the first
        # rank q's piece of the gather is q + 1; the strided allreduce doubles every other one
        assert r["allgather"] == [n * 1.0, 1.0, n * 2.0, 2.0], r


def test_async_mismatch_reaches_wait_and_future(worlds):
    for rank, res in enumerate(worlds(2).run(rank_async_mismatch)):
        assert res["wait"].startswith("ValueError") and "4" in res["wait"] and "5" in res["wait"], res
        assert res["future"] != "no error", res
        assert res["untouched"], res
        assert res["after"] == [1.0] * 3, res


@pytest.mark.parametrize("world_size", [2, 3])
def test_sync_call_completes_earlier_async_works(worlds, world_size):
    for rank, res in enumerate(worlds(world_size).run(rank_sync_after_async, 40)):
        assert res == {"incomplete": 0, "wrong": 0}, (rank, res)


def test_ctrl_c_in_async_wait_raises_keyboard_interrupt(worlds):
    r0, r1 = worlds(2).run(rank_ctrl_c_in_async_wait)
    assert r0["wait"] == "KeyboardInterrupt" and r0["untouched"], r0
    for res in (r0, r1):
        assert res["later"].startswith("RuntimeError") and "aborted" in res["later"], res


def test_wait_timeout_aborts_the_group(worlds):
    r0, r1 = worlds(2).run(rank_wait_timeout)
    assert r0["wait"].startswith("RuntimeError") and "did not complete within 0.300 s" in r0["wait"], r0
    assert 0.25 < r0["waited_s"] < 5, r0
    for res in (r0, r1):
        assert res["later"].startswith("RuntimeError") and "abort" in res["later"], res


def test_wait_timeout_in_a_callback_gives_up_after_the_timeout(worlds):
    # Before: the callback's wait ran nothing (no other thread may run the call there) and
    # gave up at its timeout; then, running the call itself, only at the group's (45 s).
    r0, r1 = worlds(2).run(rank_timed_wait_in_callback)
    assert r0["wait"].startswith("RuntimeError") and r0["waited_s"] < 20, r0
    assert r0["never"] == [True, False], r0
    for res in (r0, r1):
        assert res["later"].startswith("RuntimeError") and "abort" in res["later"], res


def test_taking_a_later_future_in_a_callback_does_not_run_the_call(worlds):
    r0, r1 = worlds(2).run(rank_future_taken_in_callback_across_groups)
    assert r0["values"] == r1["values"] == [3.0, 30.0, 300.0], (r0, r1)
    assert r0["chained"] == 30.0, r0


def test_idle_progress_thread_sleeps_without_waking(worlds):
    for res in worlds(2).run(rank_idle_thread, 0.5):
        assert res == {"running": True, "parked": True, "wakeups_while_idle": 0, "wakeups_during_sync_calls": 0,
                       "running_after_destroy": False}, res


def test_ddp_overlaps_allreduce_with_backward_on_flagos(worlds, emulator_built):  # noqa: F811  (the fixture)
    for res in worlds(2, **EMU_ENV).run(rank_ddp_overlap, 4):
        assert res["buckets"] >= 3, res
        assert res["grads_equal"], res
        assert res["overlapped"] >= 1, res


def test_latch_wakes_every_waiter_once_set_and_times_out_before():
    """ShmWork's completion latch (work._Latch, in place of threading.Event): a wait with a
    timeout returns False before ``set``; ``set`` from another thread releases every waiter
    (here 3 threads, each waiting without a timeout); later waits return at once."""
    import threading

    from flagos_shm.work import _Latch

    latch = _Latch()
    assert not latch.is_set() and latch.wait(0.01) is False and latch.wait(0) is False
    woke = []
    waiters = [threading.Thread(target=lambda: woke.append(latch.wait())) for _ in range(3)]
    for t in waiters:
        t.start()
    setter = threading.Timer(0.05, latch.set)
    setter.start()
    for t in waiters:
        t.join(10)
    setter.join(10)
    assert woke == [True, True, True] and latch.is_set()
    assert latch.wait() is True and latch.wait(0) is True


def test_accepts_early_tells_which_dones_can_run_in_two_parts():
    """``_core.accepts_early`` (the binding's check, used by the core and the multi-node
    worker before calling ``done(error, early=True)``): True for the dones that take the
    ``early`` keyword or any keyword, False for others and where no signature is known;
    the expected values are written out, not asked of ``inspect``."""
    import functools

    from flagos_shm import _core

    class Done:
        def __call__(self, error, early=False):
            pass

    cases = [
        (lambda error, early=False: None, True),
        (lambda error, *, early: None, True),
        (lambda error, **kw: None, True),
        (Done(), True),
        (functools.partial(lambda tag, error, early=False: None, "t"), True),
        (lambda error: None, False),
        (lambda error, *args: None, False),
        (lambda error, late=False: None, False),
        (len, False),          # a builtin: a signature without ``early``
        (dict.fromkeys, False),
        (max, False),          # inspect.signature raises ValueError: no signature known
    ]
    got = [(_core.accepts_early(done), want) for done, want in cases]
    assert [g for g, _ in got] == [w for _, w in got], got


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_issued_from_completion_callbacks_complete(worlds, world_size):
    check_collectives_from_callbacks(worlds(world_size).run(rank_collectives_from_callbacks, "cpu"), world_size)


def test_collectives_issued_from_completion_callbacks_complete_on_flagos(worlds, emulator_built):  # noqa: F811
    check_collectives_from_callbacks(worlds(2, **EMU_ENV).run(rank_collectives_from_callbacks, "flagos"), 2)


def check_collectives_from_callbacks(results: list, n: int) -> None:
    tri = n * (n - 1) / 2  # sum of the ranks
    for res in results:
        assert res["a"] == [tri + n] * 3 and res["d"] == [tri + 1000 * n] * 3, res
        assert res["e"] == [tri + 10000 * n] * 3, res
        assert res["sync"] == [2 * (tri + 100 * n)] * 3, res
        assert res["waits"] == [2 * (tri + 10 * n)] * 3, res
        assert res["again"] == res["f"] == [n * (tri + 5 * n)] * 3, res
        assert res["later"] == [float(n)] * 2, res


def test_callbacks_that_issue_collectives_do_not_hang_calls_under_way(worlds):
    n = 2
    expected = [n * (n + 1) / 2]
    for res in worlds(n).run(rank_callbacks_issue_while_calls_wait, 20, timeout=60):
        assert res["values"] == [expected] * 20 and res["issued"] == 3, res


def test_ddp_powersgd_hook_trains_as_with_inline_calls(worlds):
    # The hook's callbacks wait for futures of calls they issue: this hung before the
    # progress thread ran such calls itself.
    for res in worlds(2).run(rank_powersgd, 4):
        assert res["equal_to_inline"] and res["moved"], res


@pytest.mark.parametrize("world_size", [2, 3])
def test_callbacks_of_futures_taken_late_keep_nccls_order(worlds, world_size):
    n = world_size
    tri = n * (n + 1) / 2
    for res in worlds(n).run(rank_futures_taken_late, 30, timeout=90):
        assert res["shared"] == [tri, 100 * tri, n, n, n], res
        assert res["nested"] == [tri, 10 * tri, 100 * tri], res
        assert res["waiters"] == [[tri]] * 30, res
        assert res["waits_later"] == [[tri, 10 * tri, 100 * tri, 1000 * tri]] * 6, res
        assert res["waited_state"] == [[True, True]] * 5 and res["waited_failed"] == [[True, False, True]], res


def test_ddp_powersgd_hook_on_several_buckets_trains_as_with_inline_calls(worlds):
    # Each bucket's callbacks issue allreduces while the backward pass issues the next
    # bucket's: the callbacks' calls must take the place they take on the inline group (right
    # after their bucket's, whose future the hook took before issuing the next bucket's) on
    # every rank, whichever thread runs them; before, they crossed and ranks disagreed.
    for res in worlds(2).run(rank_powersgd, 6, 6, 0.02, timeout=120):
        assert res["buckets"] >= 4, res
        assert res["equal_to_inline"] and res["moved"], res
