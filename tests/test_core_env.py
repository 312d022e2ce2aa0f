"""The settings the core reads itself, read the way the README's table says: the off words
of every other flag (``0``, ``false``, ``no``, ``off``) turn ``FLAGOS_SHM_CMA`` off, and the
retired ``FLAGOS_SHM_CMA_MIN_BYTES`` (folded into ``FLAGOS_SHM_PLAN``) changes no group's
plan, whatever its value. Each rank sets the variable between groups, so one spawn covers
every value, and the group created without it is the control.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from support.spawn import spawn

pytestmark = pytest.mark.timeout(180)

CMA_OFF_WORDS = ("off", "False", " no ", "0")
#: FLAGOS_SHM_STREAM words and the mode the core reads from them (rust/stream.rs).
STREAM_WORDS = {"0": "plain", "off": "plain", " Never ": "plain", "1": "stream", "always": "stream", "ON": "stream",
                "auto": "auto", "": "auto", "maybe": "auto"}
#: Element counts for the streaming checks: odd tails, several 1 MiB slot chunks.
STREAM_COUNTS = (8192 + 13, (1 << 18) + 5, 3 * (1 << 18) + 1)
RETIRED_MIN_BYTES = ("1024", "64K", "-1", "99999999999999999999999")


def _single_copy(group) -> bool:
    import flagos_shm

    return bool(flagos_shm.backend.shm_part(group)._comm.single_copy_available)


def env_rank(rank: int, world_size: int, tmp: str) -> dict:
    import flagos_shm

    dist.init_process_group("flagos_shm", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    res = {"control": _single_copy(dist.group.WORLD), "off": {}, "retired": {},
           "plan": flagos_shm.backend.shm_part(dist.group.WORLD)._comm.plan}
    for word in CMA_OFF_WORDS:
        os.environ["FLAGOS_SHM_CMA"] = word
        group = dist.new_group(list(range(world_size)))
        res["off"][word] = _single_copy(group)
        dist.destroy_process_group(group)
    del os.environ["FLAGOS_SHM_CMA"]
    for value in RETIRED_MIN_BYTES:
        os.environ["FLAGOS_SHM_CMA_MIN_BYTES"] = value
        group = dist.new_group(list(range(world_size)))
        res["retired"][value] = flagos_shm.backend.shm_part(group)._comm.plan
        dist.destroy_process_group(group)
    del os.environ["FLAGOS_SHM_CMA_MIN_BYTES"]
    res["stream"] = {}
    for word, _ in STREAM_WORDS.items():
        os.environ["FLAGOS_SHM_STREAM"] = word
        group = dist.new_group(list(range(world_size)))
        got = {"mode": flagos_shm.backend.shm_part(group)._comm.stream_mode, "values": []}
        if word in ("0", "1", "auto"):  # the values, through dist.*, of each mode
            for count in STREAM_COUNTS:
                for _ in range(17):  # past auto's first probes of both kinds (PROBE_EVERY = 8)
                    x = torch.arange(count, dtype=torch.float64) * (rank + 1)
                    dist.all_reduce(x, group=group)
                    out = torch.empty(world_size * count, dtype=torch.int32)
                    dist.all_gather_into_tensor(out, torch.arange(count, dtype=torch.int32) + rank * 7, group=group)
                    want = torch.arange(count, dtype=torch.float64) * (world_size * (world_size + 1) // 2)
                    got["values"].append(bool(torch.equal(x, want))
                                         and all(torch.equal(out[r * count:(r + 1) * count],
                                                             torch.arange(count, dtype=torch.int32) + r * 7)
                                                 for r in range(world_size)))
        res["stream"][word] = got
        dist.destroy_process_group(group)
    del os.environ["FLAGOS_SHM_STREAM"]
    comm = flagos_shm.backend.shm_part(dist.group.WORLD)._comm
    try:
        comm.set_stream_mode("sometimes")
        res["bad_mode"] = None
    except ValueError as exc:
        res["bad_mode"] = str(exc)
    comm.set_stream_mode("plain")
    res["set_modes"] = [comm.stream_mode]
    comm.set_stream_mode("auto")
    res["set_modes"].append(comm.stream_mode)
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)  # the default group is unharmed
    res["sum"] = t.tolist()
    dist.destroy_process_group()
    return res


WORLD_SIZE = 2


@pytest.fixture(scope="module")
def results():
    return spawn(env_rank, WORLD_SIZE)


def test_default_group_unharmed(results):
    want = [float(WORLD_SIZE * (WORLD_SIZE + 1) // 2)] * 4
    assert [res["sum"] for res in results] == [want] * WORLD_SIZE


def test_the_retired_cma_min_bytes_changes_no_plan(results):
    """The control group's plan (the suite's ``FLAGOS_SHM_PLAN=fallback``) is every group's
    plan whatever ``FLAGOS_SHM_CMA_MIN_BYTES`` says; the 1 KiB value used to move every
    single-copy threshold to 1 KiB and allreduce's to 8 KiB."""
    for rank, res in enumerate(results):
        assert res["plan"]["allgather_single_copy_min_bytes"] != 1024, (rank, res["plan"])
        assert res["retired"] == dict.fromkeys(RETIRED_MIN_BYTES, res["plan"]), rank


def test_cma_off_words_turn_single_copy_off(results):
    if not all(res["control"] for res in results):
        pytest.skip("single-copy transfers are not available here (ptrace restrictions): "
                    "the off words cannot be told from the default")
    for rank, res in enumerate(results):
        assert res["off"] == {w: False for w in CMA_OFF_WORDS}, f"rank {rank}: {res['off']}"


def test_stream_words_choose_the_mode_and_every_mode_gives_exact_values(results):
    for rank, res in enumerate(results):
        assert {w: got["mode"] for w, got in res["stream"].items()} == STREAM_WORDS, rank
        for word in ("0", "1", "auto"):
            values = res["stream"][word]["values"]
            assert values and all(values), (rank, word, values)


def test_set_stream_mode_sets_it_and_refuses_other_words_naming_the_argument(results):
    for res in results:
        assert res["set_modes"] == ["plain", "auto"]
        bad = res["bad_mode"]
        assert bad and bad.startswith("mode:") and "sometimes" in bad, bad
