"""The core's settings are read by ``flagos_shm.config`` alone and passed to
``_core.Communicator``: the config reads each word as the README's table says, and the core
obeys the value passed, not the environment (``rust/tests/settings.rs`` checks the same in
Rust). One rank, no process group."""

from __future__ import annotations

import pytest

from flagos_shm import _core
from flagos_shm import config

#: FLAGOS_SHM_STREAM words and the mode they choose.
STREAM_WORDS = {"0": "plain", "off": "plain", " Never ": "plain", "FALSE": "plain", "1": "stream", "always": "stream",
                "ON": "stream", "auto": "auto", "": "auto", "maybe": "auto"}


def test_config_reads_the_core_settings_with_one_set_of_words(monkeypatch):
    for word, mode in STREAM_WORDS.items():
        monkeypatch.setenv("FLAGOS_SHM_STREAM", word)
        assert config.stream_mode() == mode, word
    for word, on in {"0": False, "Off": False, " no ": False, "false": False, "1": True, "": True, "yes": True}.items():
        monkeypatch.setenv("FLAGOS_SHM_CMA", word)
        monkeypatch.setenv("FLAGOS_SHM_PROGRESS_BATCH", word)
        assert (config.single_copy(), config.progress_batch()) == (on, on), word
    monkeypatch.setenv("FLAGOS_SHM_CMA_MIN_BYTES", "8192")  # retired: passes nothing
    monkeypatch.setenv("FLAGOS_SHM_STREAM", "never")
    monkeypatch.setenv("FLAGOS_SHM_CMA", "off")
    assert config.core_settings() == {"single_copy": False, "stream": "plain", "progress_batch": True}


def test_a_retired_setting_still_set_is_named_with_its_replacement(monkeypatch):
    """``FLAGOS_SHM_CMA_MIN_BYTES`` was folded into ``FLAGOS_SHM_PLAN`` (its ``single_copy``
    key): a user who still sets it is told so, with the plan text that does what it did,
    and the retired text itself parses to those thresholds."""
    from flagos_shm.backend import plan

    monkeypatch.delenv("FLAGOS_SHM_ROUTE", raising=False)
    monkeypatch.delenv("FLAGOS_SHM_CMA_MIN_BYTES", raising=False)
    assert config.retired() == {}
    monkeypatch.setenv("FLAGOS_SHM_CMA_MIN_BYTES", "4096")
    why = config.retired()["FLAGOS_SHM_CMA_MIN_BYTES"]
    assert "FLAGOS_SHM_PLAN=single_copy=N" in why and "allreduce_single_copy=8N" in why, why
    p = plan.parse("single_copy=4096,allreduce_single_copy=32K")
    assert [p[k] for k in plan.SINGLE_COPY_KEYS] == [8 * 4096] + [4096] * (len(plan.SINGLE_COPY_KEYS) - 1), p
    assert all(p[k] is None for k in plan.SINGLE_COPY_MAX_KEYS), p


@pytest.mark.parametrize("stream", ["plain", "stream", "auto"])
def test_the_core_obeys_the_passed_stream_mode_not_the_environment(monkeypatch, tmp_path, stream):
    opposite = {"plain": "always", "stream": "never", "auto": "never"}[stream]
    monkeypatch.setenv("FLAGOS_SHM_STREAM", opposite)
    comm = _core.Communicator(_core.create_segment(str(tmp_path), 1, 1 << 16), 0, 1, 5.0, stream=stream)
    try:
        assert comm.stream_mode == stream
    finally:
        comm.close()


def test_a_stream_word_the_core_does_not_know_raises_naming_the_argument(tmp_path):
    with pytest.raises(ValueError, match=r"^stream: expected 'plain', 'stream' or 'auto', got \"always\""):
        _core.Communicator(_core.create_segment(str(tmp_path), 1, 1 << 16), 0, 1, 5.0, stream="always")
