"""Point-to-point on flagos_shm: send/recv (tags, any source), isend/irecv,
batch_isend_irecv, CPU and emulated flagos tensors, subgroups, and the
failure cases (size mismatch on both ranks, a dead peer, a timeout, back-pressure).

Expected values are built from the (rank, message) numbers alone, never from what another
rank computed.
"""

from __future__ import annotations

import glob
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.flagos import EMU_ENV

from support.spawn import spawn  # noqa: E402
from support.turns import let_go, wait_for_go  # noqa: E402

pytestmark = pytest.mark.timeout(300)

CALL_TIMEOUT_S = 120.0
ROUTES = {"adapter": {}}  # one c10d adapter on every torch


@pytest.fixture(autouse=True)
def _only_flagos_shm(backend):
    if backend != "flagos_shm":
        pytest.skip("flagos_shm's own point-to-point")


def _message(src: int, dst: int, k: int, n: int, dtype) -> torch.Tensor:
    """Message ``k`` from ``src`` to ``dst``: ``n`` elements that depend on all four."""
    base = torch.arange(n, dtype=torch.float64) * 0.5 + 1000 * src + 100 * dst + 10 * k
    if dtype == torch.bool:
        return (torch.arange(n) + src + dst + k) % 3 == 0
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    if not dtype.is_floating_point:
        return (base * 2).to(torch.int64).remainder(120).to(dtype)
    return base.remainder(512).to(dtype)


SIZES = [0, 1, 3, 7, 16368, 16385, (1 << 20) + 3]  # 64 KiB slots hold 16368 float32
DTYPES = [torch.float32, torch.int64, torch.bfloat16, torch.complex64, torch.bool, torch.uint8]


def _device() -> str:
    return "flagos" if os.environ.get("FLAGOS_SHM_EMULATE") == "1" else "cpu"


def rank_send_recv_matrix() -> dict:
    """Every ordered pair exchanges every size and dtype (blocking send/recv, the receive
    target a strided view for odd sizes); returns the mismatches."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = _device()
    bad = []
    for src in range(n):
        for k, (size, dtype) in enumerate((s, d) for s in SIZES for d in DTYPES if s < 100_000 or d == torch.float32):
            if rank == src:
                for dst in range(n):
                    if dst != rank:
                        dist.send(_message(src, dst, k, size, dtype).to(dev), dst)
            else:
                want = _message(src, rank, k, size, dtype)
                if size % 2:  # a strided view (every second element of a bigger tensor)
                    store = torch.zeros(2 * size, dtype=dtype, device=dev)
                    out = store[::2]
                else:
                    out = torch.zeros(size, dtype=dtype, device=dev)
                dist.recv(out, src)
                if not torch.equal(out.cpu(), want):
                    bad.append((src, size, str(dtype)))
                if size % 2 and size and store[1::2].any():
                    bad.append((src, size, str(dtype), "wrote outside the view"))
    return {"bad": bad}


def rank_tags_and_order() -> dict:
    """Rank 0 sends tags 1, 2, 1, 3 to rank 1, which receives tag 3, then 2, then the two
    tag-1 messages: each receive gets its own tag's messages, in send order."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 0:
        for k, tag in enumerate([1, 2, 1, 3]):
            dist.isend(torch.full((5 + k,), float(k)), 1, tag=tag)  # isend: rank 1 takes tag 3 first
        dist.barrier()
        return {}
    if rank == 1:
        got = {}
        for tag, k in [(3, 3), (2, 1), (1, 0), (1, 2)]:
            out = torch.empty(5 + k)
            dist.recv(out, 0, tag=tag)
            got[f"{tag}/{k}"] = out.tolist() == [float(k)] * (5 + k)
        dist.barrier()
        return got
    dist.barrier()
    return {}


def rank_exchange_large_async(mib: int) -> dict:
    """Each rank isends ``mib`` MiB to every other rank, then irecvs from each (all larger
    than the rings): completes only if sends do not block the receives."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = _device()
    numel = mib * (1 << 18)
    sends = [dist.isend(_message(rank, d, 0, numel, torch.float32).to(dev), d) for d in range(n) if d != rank]
    outs = {s: torch.empty(numel, device=dev) for s in range(n) if s != rank}
    recvs = [dist.irecv(outs[s], s) for s in outs]
    for w in sends + recvs:
        w.wait()
    ok = {s: torch.equal(o.cpu(), _message(s, rank, 0, numel, torch.float32)) for s, o in outs.items()}
    # batch_isend_irecv around the ring.
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    x = _message(rank, nxt, 1, 1000, torch.float32).to(dev)
    y = torch.empty(1000, device=dev)
    ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, y, prv)]
    works = dist.batch_isend_irecv(ops)
    for w in works:
        w.wait()
    ok["ring"] = torch.equal(y.cpu(), _message(prv, rank, 1, 1000, torch.float32))
    return ok


def rank_any_source() -> dict:
    """Rank 0 receives two messages from each other rank with recv(src=None) and
    irecv(src=None); contents (which encode the sender) and reported senders match.

    The c10d adapter's work forwards ``_source_rank()`` (which ``dist.recv`` reads) to
    flagos_shm's receive (the sender is also read from the content to tell)."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        dist.send(torch.full((4,), float(rank)), 0, tag=7)
        dist.send(torch.full((4,), float(rank)), 0, tag=7)
        return {}
    from_content, reported = [], []
    for k in range(2 * (n - 1)):
        out = torch.empty(4)
        if k % 2 == 0:
            work = dist.irecv(out, tag=7)
            work.wait()
        try:
            src = dist.recv(out, tag=7) if k % 2 else work._source_rank()
        except RuntimeError as exc:
            if "sourceRank()" not in str(exc):
                raise
            src = None
        if k % 2 and src is None:  # dist.recv raised after the data arrived
            pass
        reported.append(src)
        from_content.append(int(out[0]))
        assert out.tolist() == [out[0].item()] * 4
    return {"senders": sorted(from_content), "reported": reported == from_content,
            "unreported": all(r is None for r in reported)}


def rank_size_mismatch() -> dict:
    """Rank 0 sends 10 floats, rank 1 receives 8: both raise ValueError naming the sizes;
    a following matching pair still works."""
    import torch.distributed as dist

    rank = dist.get_rank()
    res = {}
    try:
        if rank == 0:
            dist.send(torch.ones(10), 1)
        elif rank == 1:
            dist.recv(torch.empty(8), 0)
        res["raised"] = None
    except ValueError as exc:
        res["raised"] = str(exc)
    if rank == 0:
        dist.send(torch.arange(3.0), 1)
    elif rank == 1:
        out = torch.empty(3)
        dist.recv(out, 0)
        res["after"] = out.tolist()
    return res


def rank_back_pressure() -> dict:
    """Rank 0 isends 4 MiB (16x the ring), looks 0.3 s later whether the send has completed,
    and only then lets rank 1 receive: the send is not complete until the receive has
    started; the data arrives intact."""
    import torch.distributed as dist

    rank = dist.get_rank()
    x = _message(0, 1, 5, 1 << 20, torch.float32)
    dist.barrier()
    if rank == 0:
        t0 = time.monotonic()
        w = dist.isend(x, 1)
        time.sleep(0.3)
        early = w.is_completed()
        let_go("p2p/back_pressure/receive")
        w.wait()
        return {"early": early, "took": time.monotonic() - t0, "completed": w.is_completed()}
    if rank == 1:
        wait_for_go("p2p/back_pressure/receive")
        out = torch.empty(1 << 20)
        dist.recv(out, 0)
        return {"ok": torch.equal(out, x)}
    return {}


def rank_subgroup() -> dict:
    """A subgroup of global ranks [1, 2] (4 ranks: and [0, 3]): each sends to its partner
    with global ranks in dist.* (group ranks underneath); the world group's own channels
    are separate."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([1, 2]), dist.new_group([0, 3]) if n == 4 else None]
    mine = [g for g, ranks in zip(groups, ([1, 2], [0, 3])) if g is not None and rank in ranks]
    res = {}
    for g, ranks in zip(groups, ([1, 2], [0, 3])):
        if g is None or rank not in ranks:
            continue
        peer = ranks[1 - ranks.index(rank)]
        out = torch.empty(6)
        reqs = [dist.isend(torch.full((6,), 100.0 * rank), peer, group=g), dist.irecv(out, peer, group=g)]
        for w in reqs:
            w.wait()
        res[str(ranks)] = out.tolist() == [100.0 * peer] * 6
    # the world group at the same time
    if rank in (0, 1):
        out = torch.empty(2)
        if rank == 0:
            dist.send(torch.tensor([1.0, 2.0]), 1)
        else:
            dist.recv(out, 0)
            res["world"] = out.tolist() == [1.0, 2.0]
    dist.barrier()
    for g in groups:
        if g is not None:
            dist.destroy_process_group(g)
    del mine
    return res


def rank_bad_arguments() -> dict:
    """Errors of this rank's own making: a peer outside the group, itself, two tensors."""
    import torch.distributed as dist

    n = dist.get_world_size()
    out = {}
    for name, call in [("out of range", lambda: dist.send(torch.ones(1), n)),
                       ("self", lambda: dist.send(torch.ones(1), dist.get_rank()))]:
        try:
            call()
            out[name] = None
        except (ValueError, RuntimeError) as exc:
            out[name] = type(exc).__name__
    return out


def _p2p_files() -> list:
    return glob.glob(os.path.join(os.environ["FLAGOS_SHM_DIR"], "flagos_shm-p2p-*"))


def rank_no_files_left_after_talk() -> list:
    """Once both ranks of a pair attached, its file is gone."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank < 2:
        t = torch.ones(3)
        (dist.send if rank == 0 else dist.recv)(t, 1 - rank)
    dist.barrier()
    return _p2p_files()


# ==== tests ============================================================================


@pytest.fixture(params=list(ROUTES))
def route_env(request):
    return ROUTES[request.param]


@pytest.mark.parametrize("world_size", [2, 3])
def test_send_recv_every_size_dtype_and_pair(worlds, route_env, world_size):
    for res in worlds(world_size, **route_env).run(rank_send_recv_matrix, timeout=CALL_TIMEOUT_S):
        assert res["bad"] == []


def test_tags_are_matched_and_ordered_per_tag(worlds, route_env):
    res = worlds(2, **route_env).run(rank_tags_and_order, timeout=CALL_TIMEOUT_S)[1]
    assert res == {"3/3": True, "2/1": True, "1/0": True, "1/2": True}


@pytest.mark.parametrize("world_size", [2, 4])
def test_isend_irecv_large_both_ways_and_batch_ring(worlds, route_env, world_size):
    for res in worlds(world_size, **route_env).run(rank_exchange_large_async, 4, timeout=CALL_TIMEOUT_S):
        assert res and all(res.values()), res


def test_recv_any_source_reports_the_sender(worlds, route_env):
    res = worlds(3, **route_env).run(rank_any_source, timeout=CALL_TIMEOUT_S)[0]
    assert res["senders"] == [1, 1, 2, 2]
    assert res["reported"], res


def test_size_mismatch_raises_on_both_ranks_and_pair_stays_usable(worlds, route_env):
    r0, r1 = worlds(2, **route_env).run(rank_size_mismatch, timeout=CALL_TIMEOUT_S)
    assert r0["raised"] and "expects 32 bytes" in r0["raised"] and "group rank 1" in r0["raised"], r0
    assert r1["raised"] and "sent 40 bytes" in r1["raised"] and "group rank 0" in r1["raised"], r1
    assert r1["after"] == [0.0, 1.0, 2.0]


def test_slow_receiver_holds_the_sender_back(worlds):
    r0, r1 = worlds(2).run(rank_back_pressure, timeout=CALL_TIMEOUT_S)
    assert r1["ok"] and r0["early"] is False and r0["took"] >= 0.3 and r0["completed"], (r0, r1)


def test_subgroups_use_group_ranks(worlds, route_env):
    res = worlds(4, **route_env).run(rank_subgroup, timeout=CALL_TIMEOUT_S)
    assert res[0] == {"[0, 3]": True}
    assert res[1] == {"[1, 2]": True, "world": True}
    assert res[2] == {"[1, 2]": True}
    assert res[3] == {"[0, 3]": True}


def test_bad_peer_arguments_raise_locally(worlds):
    for res in worlds(2).run(rank_bad_arguments, timeout=CALL_TIMEOUT_S):
        assert all(res.values()), res


def test_pair_file_unlinked_once_both_attached(worlds):
    for left in worlds(2).run(rank_no_files_left_after_talk, timeout=CALL_TIMEOUT_S):
        assert left == []


def test_flagos_tensors(worlds, emulator_built):  # noqa: F811  (the fixture)
    for res in worlds(2, **EMU_ENV).run(rank_exchange_large_async, 2, timeout=CALL_TIMEOUT_S):
        assert res and all(res.values()), res
    for res in worlds(2, **EMU_ENV).run(rank_send_recv_matrix, timeout=CALL_TIMEOUT_S):
        assert res["bad"] == []


# ==== failures in fresh ranks ============================================================


def spawned_peer_dies(rank: int, world_size: int, tmp: str, _unused: str) -> dict:
    """Rank 1 exits while rank 0 waits in recv (and then in send): RuntimeError naming
    group rank 1 well within the group timeout; then a receive nobody answers times out."""
    import datetime

    import torch.distributed as dist

    import flagos_shm  # noqa: F401

    dist.init_process_group("flagos_shm", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    dist.send(torch.ones(2), 1 - rank) if rank == 0 else dist.recv(torch.empty(2), 0)
    if rank == 1:
        return {}  # exits without destroying the group (as a crashed rank would)
    time.sleep(0.2)  # rank 1 is gone or going
    res = {}
    t0 = time.monotonic()
    try:
        dist.recv(torch.empty(2), 1)
    except RuntimeError as exc:
        res["recv"] = str(exc)
    res["recv_s"] = time.monotonic() - t0
    try:
        dist.send(torch.ones(2), 1)
    except RuntimeError as exc:
        res["send"] = str(exc)
    dist.destroy_process_group()
    return res


def spawned_timeout(rank: int, world_size: int, tmp: str) -> dict:
    """Nobody sends: rank 0's recv raises at the group's timeout (2 s), naming the peer.
    Rank 1 stays in the group until then (it used to sleep 3 s, which a loaded machine
    could outlast, turning the timeout into a departed peer)."""
    import datetime

    import torch.distributed as dist

    import flagos_shm  # noqa: F401

    dist.init_process_group("flagos_shm", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=2))
    res = {}
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.recv(torch.empty(2), 1)
        except RuntimeError as exc:
            res["recv"] = str(exc)
        res["recv_s"] = time.monotonic() - t0
        let_go("p2p/timeout/done")
    else:
        wait_for_go("p2p/timeout/done")  # stay in the group until rank 0's recv has timed out
    dist.destroy_process_group()
    return res


def test_dead_peer_raises_naming_it():
    r0 = spawn(spawned_peer_dies, 2, args=("",), timeout=90)[0]
    assert "group rank 1" in r0["recv"] and ("exited" in r0["recv"] or "aborted" in r0["recv"]), r0
    assert r0["recv_s"] < 10, r0
    assert "group rank 1" in r0["send"], r0


def test_timeout_names_the_peer():
    r0 = spawn(spawned_timeout, 2, timeout=90)[0]
    assert "group rank 1" in r0["recv"] and "timeout" in r0["recv"], r0
    assert 1.5 < r0["recv_s"] < 10, r0


def rank_ctrl_c_in_recv() -> dict:
    """Rank 0 blocks in recv from rank 1, which sends only once rank 0 was interrupted; SIGINT
    after 0.3 s: KeyboardInterrupt on rank 0, the pair's channel aborted, so rank 1's late
    send raises RuntimeError naming group rank 0 instead of waiting for the timeout. (Rank
    1 used to send after a fixed 1.5 s: on a loaded machine the timer could fire later, the
    receive completed and the SIGINT landed in the test's own clean-up.)"""
    import signal
    import threading

    import torch.distributed as dist

    rank = dist.get_rank()
    g = dist.new_group([0, 1])
    out = {}
    try:
        if rank == 0:
            previous = signal.signal(signal.SIGINT, signal.default_int_handler)
            timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
            t0 = time.monotonic()
            try:
                timer.start()
                dist.recv(torch.empty(4), 1, group=g)
                out["recv"] = "no error"
            except KeyboardInterrupt:
                out["recv"] = "KeyboardInterrupt"
            finally:
                timer.join()
                signal.signal(signal.SIGINT, previous)
                let_go("p2p/ctrl_c/send")
            out["took"] = time.monotonic() - t0
        elif rank == 1:
            wait_for_go("p2p/ctrl_c/send")
            t0 = time.monotonic()
            try:
                dist.send(torch.ones(4), 0, group=g)
                out["send"] = "no error"
            except RuntimeError as exc:
                out["send"] = str(exc)
            out["took"] = time.monotonic() - t0
        dist.barrier()
    finally:
        dist.destroy_process_group(g)
    return out


def test_ctrl_c_in_recv_aborts_the_pair(worlds, route_env):
    r0, r1 = worlds(2, **route_env).run(rank_ctrl_c_in_recv, timeout=CALL_TIMEOUT_S)
    assert r0["recv"] == "KeyboardInterrupt" and r0["took"] < 5, r0
    assert "group rank 0" in r1["send"] and "aborted" in r1["send"] and r1["took"] < 5, r1


def test_channel_geometry_from_environment(monkeypatch):
    from flagos_shm import _core
    from flagos_shm.config import ENV_P2P_SLOT_BYTES, ENV_P2P_SLOTS, p2p_geometry

    monkeypatch.delenv(ENV_P2P_SLOTS, raising=False)
    monkeypatch.delenv(ENV_P2P_SLOT_BYTES, raising=False)
    assert p2p_geometry() == (4, 64 << 10)
    assert _core.P2PChannel.segment_bytes(4, 64 << 10) == 4096 + 2 * 4 * (64 << 10)  # docs/p2p.md
    monkeypatch.setenv(ENV_P2P_SLOT_BYTES, "1000")
    with pytest.raises(ValueError, match=f"{ENV_P2P_SLOT_BYTES}=1000: .*multiple of 4096"):
        p2p_geometry()
    monkeypatch.setenv(ENV_P2P_SLOT_BYTES, "lots")
    with pytest.raises(ValueError, match=ENV_P2P_SLOT_BYTES):
        p2p_geometry()
    monkeypatch.setenv(ENV_P2P_SLOT_BYTES, "8192")
    monkeypatch.setenv(ENV_P2P_SLOTS, "0")
    with pytest.raises(ValueError, match=f"{ENV_P2P_SLOTS}=0, .*slots"):
        p2p_geometry()
