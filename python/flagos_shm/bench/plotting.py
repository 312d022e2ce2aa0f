"""The benchmark's plot: busbw and latency against size (needs matplotlib)."""

from __future__ import annotations

import os
from typing import Optional

from .common import KiB, MiB, human
from .machine import cpu_label


BACKEND_COLORS = {"flagos_shm": "tab:blue", "gloo": "tab:orange", "mpi": "tab:green"}
DTYPE_STYLES = ("-", "--", ":", "-.")


def plot(doc: dict, path: str) -> Optional[str]:
    """Draw busbw (top row) and latency (bottom row) against S, log-log, one column per op,
    one line per (backend, dtype); the single-thread copy time is drawn in the latency
    panels. Returns None when written, else the reason it was not (matplotlib missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, NullLocator
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); pip install 'flagos_shm[bench]'"
    ops = [op for op in doc["config"]["ops"] if any(r["op"] == op for r in doc["results"])]
    if not ops:
        return "no results to plot"
    dtypes = doc["config"]["dtypes"]
    fig, axes = plt.subplots(2, len(ops), figsize=(3.6 * len(ops) + 1.2, 7.2), squeeze=False)
    copy = doc.get("copy_baseline") or []
    all_sizes = sorted({r["size_bytes"] for r in doc["results"]})
    marks = (4, 64, KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 16 * MiB, 64 * MiB, 256 * MiB)
    ticks = [s for s in all_sizes if s in marks] or all_sizes
    for j, op in enumerate(ops):
        ax_bw, ax_t = axes[0][j], axes[1][j]
        for b in doc["config"]["backends"]:
            for k, dtype in enumerate(dtypes):
                rows = sorted((r for r in doc["results"] if r["backend"] == b and r["op"] == op
                               and r["dtype"] == dtype), key=lambda r: r["size_bytes"])
                if not rows:
                    continue
                xs = [r["size_bytes"] for r in rows]
                label = b if len(dtypes) == 1 else f"{b} {dtype}"
                style = dict(color=BACKEND_COLORS.get(b), linestyle=DTYPE_STYLES[k % len(DTYPE_STYLES)],
                             marker="o", markersize=3, label=label)
                ax_bw.plot(xs, [max(r["busbw_GBps"], 1e-9) for r in rows], **style)
                ax_t.plot(xs, [r["time_us_median"] for r in rows], **style)
        if copy:
            ax_t.plot([c["size_bytes"] for c in copy], [c["time_us_median"] for c in copy],
                      color="gray", linestyle="--", linewidth=1, label="1-thread copy of S")
        ax_bw.set_title(op)
        for ax in (ax_bw, ax_t):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="major", alpha=0.3)
            ax.xaxis.set_major_locator(FixedLocator(ticks))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([human(t).replace(" ", "") for t in ticks], rotation=45, fontsize=7)
        ax_t.set_xlabel("size S (bytes)")
        if j == 0:
            ax_bw.set_ylabel("busbw (GB/s, nccl-tests)")
            ax_t.set_ylabel("time per call (us, median)")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8,
               frameon=False)
    m, cfg = doc["machine"], doc["config"]
    fig.suptitle(f"flagos_shm.bench: world size {cfg['world_size']}, {cpu_label(m)}, "
                 f"torch {m['torch']}, {doc['date_utc'][:10]}"
                 + (", ranks pinned" if cfg["bind"] else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
