"""Compare two runs of the workflow number for number: every fit's and reference's scores, curves and
truth metrics, and the table, ignoring timings and metadata. For refactors that must not change a result.

    python workflow/scripts/compare_runs.py results/demo /tmp/before/results/demo [--rtol 0]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# Keys that describe how or when a run happened, not what it found.
IGNORED = {
    "seconds",
    "train_seconds",
    "kmeans_seconds",
    "wall_seconds",
    "cpu_seconds",
    "train_cpu_seconds",
    "machine_load",
    "threads",
    "config_hash",
    "versions",
    "backend",
    "settings",
    "device",
    "tag",
}


def differences(a, b, where: str, rtol: float):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key in IGNORED:
                continue
            if key not in a or key not in b:
                yield f"{where}.{key}: only in one run"
            else:
                yield from differences(a[key], b[key], f"{where}.{key}", rtol)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"{where}: {len(a)} entries against {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            yield from differences(x, y, f"{where}[{i}]", rtol)
    elif isinstance(a, float) and isinstance(b, float):
        if not (a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= rtol * abs(b)):
            yield f"{where}: {a!r} against {b!r}"
    elif a != b:
        yield f"{where}: {a!r} against {b!r}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("reference_run", type=Path)
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance on numbers (default: 0, exact)")
    args = parser.parse_args(argv)
    files = sorted(
        p.relative_to(args.reference_run) for p in args.reference_run.glob("**/*.json") if "logs" not in p.parts
    )
    found, compared = [], 0
    for rel in files:
        if not (args.run / rel).exists():
            found.append(f"{rel}: missing")
            continue
        a, b = (json.loads((root / rel).read_text()) for root in (args.run, args.reference_run))
        found += [f"{rel}:{d}" for d in differences(a, b, "", args.rtol)]
        compared += 1
    for table in ("tables/loglik.md",):
        if (args.reference_run / table).exists() and (args.run / table).read_text() != (
            args.reference_run / table
        ).read_text():
            found.append(f"{table}: differs")
    print(f"{compared} JSON files and the table compared; {len(found)} differences")
    print("\n".join(found[:50]))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
