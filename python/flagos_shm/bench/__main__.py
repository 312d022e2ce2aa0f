"""``python -m flagos_shm.bench``: see :mod:`flagos_shm.bench`."""

import sys

from .run import main

if __name__ == "__main__":
    sys.exit(main())
