"""Counting the tensors a call stages (``flagos_shm.staging.stage`` calls), for tests of the
fast paths, which stage nothing. Used inside rank processes (``tests/`` is on their path)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def counting_stages():
    """Within: a list that gets the argument name of every ``staging.stage`` call (clear
    it between cases); ``staging.stage`` is restored on exit."""
    from flagos_shm import staging

    staged = []
    real = staging.stage
    staging.stage = lambda *a, **k: staged.append(a[1]) or real(*a, **k)
    try:
        yield staged
    finally:
        staging.stage = real
