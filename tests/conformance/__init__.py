"""PyTorch's own c10d conformance suite (``distributed_test``) run against flagos_shm.

``suite.py`` is the driver (the counterpart of upstream's ``test_distributed_spawn.py``,
which the torch wheel does not ship), ``run.py`` runs a selection of its tests for one
backend / world size / route and writes one JSON line per test, ``run_all.sh`` runs the
whole CPU selection for flagos_shm and gloo on both routes and ``table.py`` turns the
results into the table in ``docs/conformance.md``. ``tests/test_conformance.py`` runs a
representative subset in the normal pytest run.
"""
