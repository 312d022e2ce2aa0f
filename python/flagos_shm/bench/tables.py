"""The benchmark's report: the text tables on stdout, the ratios, the JSON file."""

from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence

from . import limit
from .common import REFERENCE, human
from .plotting import plot


def _fmt_bw(v: float) -> str:
    """A bandwidth in at most 7 characters: 3 significant digits, exponent below 0.01."""
    return f"{v:.3g}" if v >= 0.01 or v == 0 else f"{v:.1e}"


def _fmt_ratio(v: float) -> str:
    """A time ratio: 2 decimals, 2 significant digits below 0.1 (0.0042, not 0.00)."""
    return f"{v:.2f}" if v >= 0.1 else f"{v:.2g}"


def format_tables(doc: dict) -> str:
    """The per-(op, dtype) tables, the copy baseline and the overhead breakdown, as text."""
    n = doc["config"]["world_size"]
    backends = [b for b in doc["config"]["backends"]
                if any(r["backend"] == b for r in doc["results"])]
    others = [b for b in backends if b != REFERENCE] if REFERENCE in backends else []
    by = {(r["backend"], r["op"], r["dtype"], r["size_bytes"]): r for r in doc["results"]}
    lines: List[str] = []
    for op in doc["config"]["ops"]:
        for dtype in doc["config"]["dtypes"]:
            sizes = sorted({r["size_bytes"] for r in doc["results"]
                            if r["op"] == op and r["dtype"] == dtype})
            if not sizes:
                continue
            cols = [b for b in backends if any((b, op, dtype, s) in by for s in sizes)]
            devices = ", ".join(f"{b} on {next(by[k]['device'] for k in by if k[0] == b)}" for b in cols)
            lines.append(f"\n{op}  {dtype}  world size {n}  ({devices}; time in us: median and min "
                         f"of the slowest rank per iteration; algbw, busbw in GB/s)")
            head = f"{'size S':>10} {'iters':>5}"
            sub = f"{'':>10} {'':>5}"
            for b in cols:
                head += f" | {b:^35}"
                sub += f" | {'median':>9} {'min':>9} {'algbw':>7} {'busbw':>7}"
            ratio_cols = [b for b in others if b in cols]
            for b in ratio_cols:
                label = f"{b}/{REFERENCE}"
                head += f" | {label:>{max(10, len(label))}}"
                sub += f" | {'time ratio':>{max(10, len(label))}}"
            lines += [head, sub]
            for s in sizes:
                first = next(by[(b, op, dtype, s)] for b in cols if (b, op, dtype, s) in by)
                line = f"{human(s):>10} {first['iters']:>5}"
                for b in cols:
                    r = by.get((b, op, dtype, s))
                    line += (f" | {r['time_us_median']:>9.1f} {r['time_us_min']:>9.1f} "
                             f"{_fmt_bw(r['algbw_GBps']):>7} {_fmt_bw(r['busbw_GBps']):>7}"
                             if r else f" | {'-':>9} {'-':>9} {'-':>7} {'-':>7}")
                for b in ratio_cols:
                    r, ref = by.get((b, op, dtype, s)), by.get((REFERENCE, op, dtype, s))
                    width = max(10, len(f"{b}/{REFERENCE}"))
                    line += (f" | {_fmt_ratio(r['time_us_median'] / ref['time_us_median']):>{width}}"
                             if r and ref else f" | {'-':>{width}}")
                lines.append(line)
    copy = doc.get("copy_baseline") or []
    if copy:
        dtype0 = doc["config"]["dtypes"][0]
        ar = {r["size_bytes"]: r for r in doc["results"] if r["backend"] == REFERENCE
              and r["op"] == "allreduce" and r["dtype"] == dtype0}
        lines.append("\nsingle-thread copy on rank 0 (torch.Tensor.copy_ of S bytes, CPU, 1 thread; "
                     "median)" + (f" and flagos_shm allreduce ({dtype0}) time / copy time; the "
                                  "target for large S is at most 3" if ar else ""))
        lines.append(f"{'size S':>10} {'copy us':>10} {'GB/s':>7}" + (f" | {'allreduce/copy':>14}" if ar else ""))
        for c in copy:
            line = f"{human(c['size_bytes']):>10} {c['time_us_median']:>10.1f} {_fmt_bw(c['GBps']):>7}"
            r = ar.get(c["size_bytes"])
            if r:
                line += f" | {r['time_us_median'] / c['time_us_median']:>14.2f}"
            elif ar:
                continue  # a size only other ops use (e.g. allgather's n x element)
            lines.append(line)
    staging = doc.get("staging") or []
    if staging:
        lines.append(f"\nstaging: flagos_shm on {staging[0]['device']} tensors against the same call on CPU "
                     f"tensors and the device copies of S alone ({doc.get('device_copy_definition', '')}); "
                     "median us; excess = staged - cpu - copies")
        lines.append(f"{'op':<15} {'dtype':<9} {'size S':>10} {'staged':>10} {'cpu':>10} {'copies':>10} "
                     f"{'excess':>10}")
        for r in staging:
            lines.append(f"{r['op']:<15} {r['dtype']:<9} {human(r['size_bytes']):>10} {r['staged_us']:>10.1f} "
                         f"{r['cpu_us']:>10.1f} {r['copies_us']:>10.1f} {r['excess_us']:>10.1f}")
    lines += limit.format_limit(doc)
    ov = doc.get("overhead")
    if ov and "calls" in ov:
        lines.append(f"\nflagos_shm per-call overhead: allreduce of 4 B (one float32), "
                     f"{ov['iters']} calls each, time in us (median of the slowest rank)")
        for c in ov["calls"]:
            value = f"{c['time_us_median']:>8.2f}" if "time_us_median" in c else f"{'-':>8}"
            why = f"skipped: {c['skipped']}" if "skipped" in c else c["layers"]
            lines.append(f"  {c['call']:<40} {value}   ({why})")
        if "breakdown_us_median" in ov:
            parts = ", ".join(f"{k} {v:.2f} us" for k, v in ov["breakdown_us_median"].items())
            lines.append(f"  => per call: {parts}")
        if "torch_floor_us_median" in ov:
            lines.append(f"  => torch's floor (dist.all_reduce on a Python backend that does nothing): "
                         f"{ov['torch_floor_us_median']:.2f} us")
    elif ov:
        lines.append(f"\nflagos_shm per-call overhead: skipped ({ov.get('skipped')})")
    for s in doc.get("skipped", []):
        where = f" S={human(s['size_bytes'])}" if s.get("size_bytes") else ""
        lines.append(f"skipped: {s['backend']} {s['op']} {s['dtype']}{where}: {s['reason']}")
    for note in doc.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


#: flagos_shm on CPU tensors, beside flagos_shm on device tensors (run.CPU_TWIN).
_CPU_TWIN = f"{REFERENCE}@cpu"


def staging_rows(results: Sequence[dict], device_copies: Sequence[dict]) -> List[dict]:
    """What staging costs, per (op, dtype, S) measured on both devices: flagos_shm's median
    on device tensors (``staged_us``) and on CPU tensors (``cpu_us``), the device copies of S
    alone (``copies_us``: S out and S back, an upper bound for an allgather's or a
    reduce-scatter's copies, whose input or output is S / world size), and
    ``excess_us = staged - cpu - copies``. Empty without device results."""
    copies = {c["size_bytes"]: c["time_us_median"] for c in device_copies}
    cpu = {(r["op"], r["dtype"], r["size_bytes"]): r for r in results if r["backend"] == _CPU_TWIN}
    rows = []
    for r in results:
        key = (r["op"], r["dtype"], r["size_bytes"])
        if r["backend"] != REFERENCE or key not in cpu or r["size_bytes"] not in copies:
            continue
        staged, base, copy = r["time_us_median"], cpu[key]["time_us_median"], copies[r["size_bytes"]]
        rows.append({"op": r["op"], "dtype": r["dtype"], "size_bytes": r["size_bytes"], "device": r["device"],
                     "staged_us": staged, "cpu_us": base, "copies_us": copy, "excess_us": staged - base - copy})
    return rows


def ratios(results: Sequence[dict]) -> List[dict]:
    ref = {(r["op"], r["dtype"], r["size_bytes"]): r for r in results if r["backend"] == REFERENCE}
    return [{"backend": r["backend"], "op": r["op"], "dtype": r["dtype"],
             "size_bytes": r["size_bytes"],
             f"time_ratio_vs_{REFERENCE}": r["time_us_median"] / ref[key]["time_us_median"]}
            for r in results if r["backend"] != REFERENCE
            for key in [(r["op"], r["dtype"], r["size_bytes"])] if key in ref]


def write_json(path: str, doc: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)


def report(doc: dict, json_path: Optional[str], plot_path: Optional[str]) -> None:
    """Print the tables; write the JSON and the plot when asked."""
    print(format_tables(doc), flush=True)
    if plot_path:
        why = plot(doc, plot_path)
        doc["plot"] = {"path": plot_path, "written": why is None, "reason": why or ""}
        print(f"\nplot: {'written to ' + plot_path if why is None else 'skipped: ' + why}", flush=True)
    if json_path:
        write_json(json_path, doc)
        print(f"results written to {json_path}", flush=True)
