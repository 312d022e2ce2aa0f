"""Helpers of the test suite (not tests): the pool of long-lived rank processes
(:mod:`.harness`), fresh rank processes (:mod:`.spawn`), the failure-test toolkit
(:mod:`.faults`), reference results (:mod:`.reference`), private /dev/shm namespaces
(:mod:`.namespaces`), the staging-copy probe (:mod:`.stage_probe`) and the soak run
(:mod:`.soak`, ``python tests/support/soak.py``). ``tests/conftest.py`` puts ``tests/`` on
``sys.path``, so test files import them as ``from support.spawn import spawn``.
"""
