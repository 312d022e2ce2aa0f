#!/usr/bin/env python3
"""Compare flagos_shm with gloo: allreduce, allgather, broadcast, reduce-scatter.

Thin wrapper around ``python -m flagos_shm.bench`` (same options; ``--help``).
Needs the package installed (``pip install -e .``). Examples::

    python benches/compare_backends.py
    python benches/compare_backends.py --nproc 4 --ops allreduce --sizes 4,1M,64M
    python benches/compare_backends.py --json bench-results/compare.json
"""

import sys

try:
    from flagos_shm.bench import main
except ImportError as exc:  # pragma: no cover - environment problem, not a code path
    sys.exit(f"cannot import flagos_shm.bench ({exc}); install the package first: pip install -e .")

if __name__ == "__main__":
    sys.exit(main())
