"""The /dev/shm budget (issue 5): a segment that does not fit fails at creation with an error
naming the path and the bytes needed, and a tmpfs that fills up after creation never gives
SIGBUS (the pages are reserved when the segment is made).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from support import faults
from support.faults import TIMEOUT_S, error_info, shm_group
from flagos_shm.backend import shm_part

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("flagos_only")]


# ==== 3. the /dev/shm budget ========================================================================

TMPFS_BYTES = 1 << 20


@pytest.fixture
def small_tmpfs():
    """A 1 MiB tmpfs mounted on a fresh directory (needs root / CAP_SYS_ADMIN; skipped
    otherwise), unmounted and removed afterwards whatever happens."""
    import subprocess
    import tempfile

    path = tempfile.mkdtemp(prefix="flagos_shm_tmpfs_")
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", path],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        os.rmdir(path)
        pytest.skip(f"cannot mount a small tmpfs here ({exc}); covered only by "
                    "test_segment_larger_than_the_filesystem_fails_at_creation")
    if proc.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a small tmpfs here (mount: {proc.stderr.strip()}); covered only by "
                    "test_segment_larger_than_the_filesystem_fails_at_creation")
    try:
        yield path
    finally:
        if subprocess.run(["umount", path], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
        os.rmdir(path)


def rank_group_in(tmp: str, shm_dir: str, slot_bytes: int, tag: str) -> dict:
    """Try to create a group of the pool's ranks with its segment in ``shm_dir``; report
    the error, or (if it fits) fill the rest of the file system and run collectives that
    touch every page of the segment."""
    rank, n = dist.get_rank(), dist.get_world_size()
    res: dict = {}
    try:
        pg = shm_group(os.path.join(tmp, "store"), rank, n, f"budget-{tag}", TIMEOUT_S, slot_bytes=slot_bytes,
                       shm_dir=shm_dir)
    except Exception as exc:  # noqa: BLE001
        res["error"] = error_info(exc)
        return res
    res["error"] = None
    try:
        res["segment_bytes"] = shm_part(pg)._comm.segment_bytes
        dist.barrier()
        if rank == 0:  # fill the file system: a page the segment had not reserved would now SIGBUS
            filler = os.path.join(shm_dir, "filler")
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                while True:
                    os.write(fd, b"\1" * 4096)
            except OSError:
                pass
            finally:
                os.close(fd)
            st = os.statvfs(shm_dir)
            res["free_after_fill"] = st.f_bavail * st.f_frsize
        dist.barrier()
        numel = 10 * slot_bytes // 4 + 3  # 10 chunks: both slots of every rank, written and read
        inputs = [faults.rank_input(numel, 7, r) for r in range(n)]
        t = inputs[rank].clone()
        pg.allreduce([t]).wait()
        out = torch.empty(n * numel)
        pg._allgather_base(out, inputs[rank]).wait()
        res["values_ok"] = torch.equal(t, torch.stack(inputs).sum(0)) and torch.equal(out, torch.cat(inputs))
        dist.barrier()
        if rank == 0:
            os.unlink(filler)
    finally:
        pg.shutdown()
    return res


def test_segment_that_does_not_fit_fails_at_creation(worlds, tmp_path, small_tmpfs):
    """A 2-rank group with 512 KiB slots needs 2 MiB + 4 KiB; in a 1 MiB tmpfs its creation
    fails at once: group rank 0 raises OSError naming the path, the bytes needed and the
    bytes free; the other rank RuntimeError quoting it; nothing is left in the directory."""
    from flagos_shm import _core

    world = worlds(2)
    slot = 512 * 1024
    try:
        r0, r1 = world.run(rank_group_in, str(tmp_path), small_tmpfs, slot, "too-big", timeout=60)
    finally:
        world.check_health()
    needed = _core.segment_bytes(2, slot)
    assert r0["error"] and r0["error"]["type"] == "OSError", r0
    assert r1["error"] and r1["error"]["type"] == "RuntimeError", r1
    for res in (r0, r1):
        msg = res["error"]["message"]
        for word in (os.path.join(small_tmpfs, faults.SEGMENT_PREFIX), f"{needed} bytes",
                     f"{TMPFS_BYTES} bytes free in {small_tmpfs}"):
            assert word in msg, (word, msg)
    assert "group rank 0 could not create" in r1["error"]["message"], r1
    assert os.listdir(small_tmpfs) == []


def test_full_tmpfs_after_creation_does_not_sigbus(worlds, tmp_path, small_tmpfs):
    """A group whose segment fits (2 ranks x 2 slots of 128 KiB + 4 KiB) reserves all its
    pages at creation: with the tmpfs then filled to the last byte by another file, 10-chunk
    collectives touching every slot page still give the right values (no SIGBUS)."""
    world = worlds(2)
    try:
        results = world.run(rank_group_in, str(tmp_path), small_tmpfs, 128 * 1024, "fits", timeout=60)
    finally:
        world.check_health()
    for rank, res in enumerate(results):
        assert res["error"] is None and res["values_ok"], (rank, res)
    assert results[0]["free_after_fill"] == 0, results[0]
    assert os.listdir(small_tmpfs) == []


def test_segment_larger_than_the_filesystem_fails_at_creation(tmp_path):
    """Without mounting anything: a group whose segment exceeds the whole of /dev/shm (1 GiB
    slots, enough ranks) fails on group rank 0 as soon as the peers have published their
    identities (here: copies of rank 0's, so that they are on its node), before any peer
    attaches, with OSError naming the path, the bytes needed and the bytes free; no file is
    left."""
    import json

    from flagos_shm import ShmGroup, _core
    from flagos_shm.backend import rendezvous

    shm = "/dev/shm"
    if not os.path.isdir(shm):
        pytest.skip("no /dev/shm")
    st = os.statvfs(shm)
    slot = 1 << 30
    n = st.f_blocks * st.f_frsize // (2 * slot) + 2
    if n > 4096:
        pytest.skip(f"/dev/shm is too large ({st.f_blocks * st.f_frsize} bytes) for one segment to exceed it")
    needed = _core.segment_bytes(n, slot)
    before = faults.segments_in(shm)
    with faults.env_override(FLAGOS_SHM_DIR=shm, FLAGOS_SHM_SLOT_BYTES=slot):
        with pytest.raises(OSError) as info:
            store = dist.HashStore()
            store.add("flagos_shm/rendezvous", n - 1)  # the other ranks have joined incarnation 0
            for r in range(1, n):
                store.set(f"flagos_shm/0/pid/{r}", json.dumps(rendezvous.identity()))
            ShmGroup(store, 0, n, timeout=5)
    msg = str(info.value)
    assert f"{shm}/{faults.SEGMENT_PREFIX}" in msg and f"{needed} bytes" in msg and "bytes free in /dev/shm" in msg, msg
    assert set(faults.segments_in(shm)) <= set(before)
