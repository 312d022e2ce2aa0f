#!/usr/bin/env python3
"""Compare flagos_shm with gloo (and MPI when mpi4py and mpirun are there): allreduce,
allgather, reduce-scatter, broadcast, alltoall.

Thin wrapper around ``python -m flagos_shm.bench`` (same options; ``--help``).
Needs the package installed (``pip install -e ".[bench]"``; matplotlib for ``--plot``).
Examples::

    python benches/compare_backends.py
    python benches/compare_backends.py --nproc 4 --ops allreduce --sizes 4,1M,64M
    python benches/compare_backends.py --bind --out-dir bench-results   # bench.json + bench.png
"""

import sys

try:
    from flagos_shm.bench import main
except ImportError as exc:  # pragma: no cover - environment problem, not a code path
    sys.exit(f"cannot import flagos_shm.bench ({exc}); install the package first: pip install -e .")

if __name__ == "__main__":
    sys.exit(main())
