"""Turn run.py's JSON lines into the conformance table (markdown).

    python tests/conformance/table.py OUT_DIR [--write docs/conformance.md]

OUT_DIR holds ``TAG-ROUTE-BACKEND-wsN.jsonl`` files (run_all.sh). Prints, per (torch,
route, world size), pass/fail/skip for each backend side by side, then every test that
fails (or skips) on flagos_shm but passes on gloo in the same configuration. With ``--write``, the
text between the ``<!-- conformance-table -->`` markers of that file is replaced.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re

BEGIN, END = "<!-- conformance-table -->", "<!-- /conformance-table -->"
NAME = re.compile(r"(?P<tag>[^-]+)-(?P<route>[a-z_]+)-(?P<backend>[a-z_]+)-ws(?P<ws>\d+)\.jsonl$")


def load(out_dir):
    """{(tag, route, ws): {backend: {test: outcome}}}"""
    runs = collections.defaultdict(dict)
    for path in sorted(glob.glob(os.path.join(out_dir, "*.jsonl"))):
        m = NAME.search(os.path.basename(path))
        if not m:
            continue
        outcomes = {}
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    outcomes[rec["test"]] = rec["outcome"]
        runs[(m["tag"], m["route"], int(m["ws"]))][m["backend"]] = outcomes
    return runs


def render(runs) -> str:
    backends = sorted({b for r in runs.values() for b in r}, key=lambda b: (b != "flagos_shm", b))
    head = "| torch | route | world size | " + " | ".join(f"{b} pass / fail / skip" for b in backends) + " |"
    lines = [head, "|" + " --- |" * (3 + len(backends))]
    regressions, skipped = [], []
    for (tag, route, ws), by_backend in sorted(runs.items()):
        cells = []
        for b in backends:
            c = collections.Counter(by_backend.get(b, {}).values())
            cells.append(f"{c['pass']} / {c['fail']} / {c['skip']}" if b in by_backend else "not run")
        lines.append(f"| {tag} | {route} | {ws} | " + " | ".join(cells) + " |")
        ours, gloo = by_backend.get("flagos_shm", {}), by_backend.get("gloo", {})
        for test, outcome in sorted(ours.items()):
            if outcome == "fail" and gloo.get(test) == "pass":
                regressions.append(f"- {tag}, {route}, world size {ws}: `{test}`")
            if outcome == "skip" and gloo.get(test) == "pass":
                skipped.append(f"- {tag}, {route}, world size {ws}: `{test}`")
    lines += ["", "Failing on flagos_shm while gloo passes, same configuration:"]
    lines += regressions or ["- none"]
    lines += ["", "Skipped on flagos_shm while gloo passes, same configuration:"]
    lines += skipped or ["- none"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--write", help="markdown file whose marked section is replaced")
    args = p.parse_args(argv)
    text = render(load(args.out_dir))
    print(text)
    if args.write:
        with open(args.write, encoding="utf-8") as f:
            doc = f.read()
        if BEGIN not in doc or END not in doc:
            raise SystemExit(f"{args.write}: no {BEGIN} ... {END} section to replace")
        before, rest = doc.split(BEGIN, 1)
        after = rest.split(END, 1)[1]
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(before + BEGIN + "\n" + text + END + after)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
