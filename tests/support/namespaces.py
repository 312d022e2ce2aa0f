"""Linux namespaces for tests that simulate other machines or containers on this one
(root only): a mount namespace with its own tmpfs on ``/dev/shm`` (another node's shared
memory), used through ``nsenter`` as a command prefix for ``spawn.spawn(wrap=...)``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import pytest

__all__ = ["needs_unshare", "private_shm_namespace"]


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return False
    try:
        return subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_unshare = pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare/nsenter (mount namespaces)")


@contextlib.contextmanager
def private_shm_namespace():
    """A mount namespace with its own tmpfs on /dev/shm, held by a sleeping process; yields
    ``(prefix, leftovers)``: the command prefix that runs a rank in it (creating the rank's
    ``FLAGOS_SHM_DIR`` there first), and a function listing the ``flagos_shm-*`` files
    anywhere below its /dev/shm."""
    holder = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         "mount -t tmpfs -o size=256m flagos-test-node /dev/shm && echo ready && exec sleep 600"],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        line = holder.stdout.readline().strip()
        assert line == b"ready", f"could not set up a private /dev/shm: {line!r}"
        pid = str(holder.pid)
        prefix = ["nsenter", "-t", pid, "-m", "--", "sh", "-c", 'mkdir -p "$FLAGOS_SHM_DIR" && exec "$@"', "sh"]

        def leftovers() -> list:
            out = subprocess.run(["nsenter", "-t", pid, "-m", "--", "find", "/dev/shm", "-name", "flagos_shm-*"],
                                 capture_output=True, text=True, timeout=30, check=False)
            return out.stdout.split()
        yield prefix, leftovers
    finally:
        holder.kill()
        holder.wait()
