"""The soak run (``tests/support/soak.py``, run for minutes by hand or nightly), briefly.
"""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("flagos_only")]


# ==== 8. the soak run, briefly ============================================================================

def test_soak_runs_briefly(tmp_path):
    """``tests/soak.py`` (run for minutes by hand or nightly) works: a 10 s run with 3
    workers, kills in most rounds and at least one kill whatever the machine's speed, ends
    with operations and kills done, and no wrong result, unexpected error, hang, leaked
    segment or leftover process. (The time used to start before the workers were ready: on
    a loaded machine their start took the whole 10 s, and no round killed anything.)"""
    import json
    import subprocess
    import sys

    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "support", "soak.py"),
                           "--seconds", "10",
                           "--nproc", "3", "--kill-rate", "0.7", "--min-kills", "1", "--seed", "11",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stats = json.loads(out.read_text())["stats"]
    assert stats["operations"] > 0 and stats["kills"] > 0, stats
    for key in ("wrong_results", "unexpected_errors", "hung_workers", "crashes", "segments_leaked",
                "dev_shm_entries_leaked", "leftover_processes"):
        assert stats[key] == 0, (key, stats)
