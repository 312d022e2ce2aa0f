"""Collective benchmark: flagos_shm against gloo (and MPI), in one run.

Run::

    python -m flagos_shm.bench                                  # 2 ranks, all ops, 4 B .. 64 MiB
    python -m flagos_shm.bench --bind --json out/bench.json --plot out/bench.png
    python -m flagos_shm.bench --nproc 4 --ops allreduce --sizes 4,1M,16M --dtypes float32,bfloat16
    python -m flagos_shm.bench --device flagos                  # flagos tensors (emulated device)
    torchrun --nproc-per-node 2 -m flagos_shm.bench             # the same under torchrun
    python benches/compare_backends.py ...                      # the same (thin wrapper)

What it measures, in the same rank processes and the same run:

* For every op (allreduce, allgather = ``all_gather_into_tensor``, reduce_scatter =
  ``reduce_scatter_tensor``, broadcast, alltoall = ``all_to_all_single``), dtype and size,
  each torch backend (flagos_shm, gloo) one after the other on the same buffers. Every rank
  joins a control group (gloo, the default group: it agrees on the plan, lines ranks up
  and collects timings) and one group per measured backend (``dist.new_group``).
* Each measurement is: one correctness check against values computed another way (a wrong
  result stops the benchmark with RuntimeError, so a broken backend cannot post a time), a
  FIXED number of warm-up iterations, a barrier on the control group, then a FIXED number of
  timed iterations, each timed on its own with ``time.perf_counter_ns`` around the
  synchronous call. Counts derive from the arguments only and are checked equal on all
  ranks first (a time-based warm-up lets ranks issue different numbers of collectives and
  hangs the job). A backend that rejects an (op, dtype) on every rank is reported as
  skipped.
* time = statistics over iterations of the slowest rank's time for that iteration (a
  collective is done when its last rank is done): median, min and p90, in microseconds.
* Bandwidths follow nccl-tests (``doc/PERFORMANCE.md`` in NVIDIA/nccl-tests), GB = 1e9
  bytes: algbw = S / median time, with S the tensor size of the op: allreduce and
  broadcast: the buffer; allgather: the whole output (n x per-rank input); reduce_scatter:
  the whole input (n x per-rank output); alltoall: one rank's whole input (= output).
  busbw = algbw x 2(n-1)/n for allreduce, x (n-1)/n for allgather, reduce_scatter and
  alltoall, x 1 for broadcast (n = world size). The requested size is rounded down to
  whole elements (and, for allgather, reduce_scatter and alltoall, to a multiple of n
  elements; at least one element per rank); the tables show the S actually used.
* ratio = other backend's median time / flagos_shm's (> 1: flagos_shm is faster).
* Once per run: the time of one single-threaded ``torch.Tensor.copy_`` of S bytes on CPU
  on rank 0 (the others wait), for every S measured: the physical reference (our target
  is a large allreduce within 3 copies); and flagos_shm's per-call overhead at 4 B:
  ``dist.all_reduce`` against the adapter's own ``allreduce(...)`` against the bare
  core call ``Communicator.allreduce`` on the same process group.
* MPI (``--backends ...,mpi``, in the default list): when ``mpi4py`` is importable and an
  ``mpirun``/``mpiexec`` is on PATH, rank 0 runs ``mpirun -n N python
  .../flagos_shm/bench/mpi_rank.py`` after the torch measurements, with the same plan, on numpy host
  buffers on the kind of pages torch's tensors get (``machine.torch_cpu_hugepages``; so always
  CPU memory; float16/bfloat16 have no standard MPI datatype and are skipped); otherwise one
  line says why MPI was skipped.
* Rounds (``--rounds``, default 2): all of the above but the overhead is measured that many
  times, the torch part and the MPI part alternating, and each figure is its best round's
  (lowest median), see ``rounds.py``.

``--device flagos`` puts flagos_shm's tensors on the flagos device (a real torch_fl device,
or the emulated one, enabled when none is registered); gloo cannot take flagos tensors, so
gloo is measured on CPU tensors then, and the output says so.

Output: a header, a progress bar on stderr (rank 0; a few plain lines when stderr is not a
terminal), then on stdout one table per (op, dtype), the copy baseline and the overhead
breakdown. ``--json PATH`` writes everything (with machine information and the command
line); ``--plot PATH.png`` draws busbw and latency against size (log-log), one column per
op, and needs matplotlib (``pip install 'flagos_shm[bench]'``; skipped with a message
when it is missing).

The package, by file: ``plan.py`` (flags and the plan), ``cases.py`` (buffers, call and check
of one case), ``timing.py`` (the timed loop, the copy baseline), ``overhead.py`` (the per-call
overhead), ``limit.py`` (the memory limit: cross-process copy, plan, multiples), ``mpi.py``
(the MPI run; ``mpi_rank.py`` is one MPI rank, torch-free), ``common.py`` (torch-free rules
shared with the MPI ranks), ``progress.py``, ``tables.py`` (the report), ``plotting.py``,
``machine.py`` (device, machine information, the pages of torch's tensors), ``rounds.py``
(the best of the rounds), ``run.py`` (one rank, and :func:`main`).
"""

from __future__ import annotations

# Every public name the single-file bench.py had (and the table formatters the tests use),
# importable from the package as before.
from .cases import Case, WrongResult, make_case  # noqa: F401
from .common import (ALL_BACKENDS, BANDWIDTH_DEFINITION, DEFAULT_SIZES, DTYPES, ITER_BUDGET_BYTES,  # noqa: F401
                     MAX_ITERS, MIN_ITERS, MPI_DTYPES, OPS, OVERHEAD_ITERS, REFERENCE, SCHEMA, TIME_DEFINITION,
                     TORCH_BACKENDS, KiB, MiB, busbw_factor, case_numel, human, iterations, make_record, parse_size,
                     summarize)
from .machine import command_line, cpu_label, cpu_model, machine_info, setup_device  # noqa: F401
from .mpi import MPI_SCRIPT, mpi_launcher, run_mpi  # noqa: F401
from .overhead import OVERHEAD_LAYERS, measure_overhead, shm_process_group  # noqa: F401
from .plan import Plan, build_parser, output_paths, plan_from_args  # noqa: F401
from .plotting import BACKEND_COLORS, DTYPE_STYLES, plot  # noqa: F401
from .progress import Progress  # noqa: F401
from .run import main, worker  # noqa: F401
from .tables import _fmt_bw, _fmt_ratio, format_tables, ratios, report, write_json  # noqa: F401
from .timing import measure, measure_copy  # noqa: F401

__all__ = ["main", "busbw_factor", "case_numel", "iterations", "summarize", "parse_size",
           "format_tables", "plot", "OPS", "DTYPES"]
