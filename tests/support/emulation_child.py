"""Running code in a fresh interpreter for the tests of the emulated flagos device
(``test_emulation*.py``): enabling the device renames PrivateUse1 for the whole process and
cannot be undone, so every test that enables it runs a child whose one line
``RESULT:<json>`` :func:`run_child` returns. The assertions run in the test, against
references computed on CPU in the same child (or constants). The C++ part is compiled once
per module by the ``built`` fixture (conftest.py; cached in the user cache, see
``flagos_shm.emulation.build``); children then only load it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CHILD_TIMEOUT = 240  # seconds; a child imports torch (~3 s) and runs small models

PRELUDE = """
import json, os, sys
import torch

def emit(value):
    print("RESULT:" + json.dumps(value), flush=True)
"""


def child_env(extra: dict | None = None) -> dict:
    """This environment without the emulator's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLAGOS_SHM_EMULATE", "FLAGOS_SHM_EMULATE_DEVICES")}
    env.update(extra or {})
    return env


def run_child(code: str, env: dict | None = None, timeout: float = CHILD_TIMEOUT):
    """Run ``code`` in a new interpreter; return the value it emitted."""
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, env=child_env(env),
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
    assert len(lines) == 1, f"expected one RESULT line:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[0][len("RESULT:"):])

