"""Summarise a finished workflow run's fits into one JSON in benchmarks/results/: per method (or variant)
and K, the mean and standard deviation over seeds of the validation and true-value log-likelihoods, the
gap closed, split-and-merge moves, and the training and wall seconds, beside the machine it ran on.

    python benchmarks/summarise_run.py results/methods       # -> benchmarks/results/run_methods_cpu.json

The workflow's outputs are not committed (they are regenerated); this keeps the numbers the documentation and the
notes quote.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, parse_args, write_result  # noqa: E402

COLUMNS = (
    "val_observed",
    "test_observed",
    "true_test",
    "gap_closed",
    "moves_accepted",
    "train_seconds",
    "wall_seconds",
)


def summarise(run: Path) -> dict:
    from scalable_xd.pipeline.report.metrics import metrics_frame

    frame = metrics_frame(sorted(run.glob("fits/*/*/metrics.json")))
    rows = []
    for (method, k), group in frame.groupby(["method", "K"], sort=False):
        row = {
            "method": method,
            "K": int(k),
            "fitted_with": group.fitted_with.iloc[0],
            "split_merge": bool(group.split_merge.iloc[0]),
            "seeds": sorted(int(s) for s in group.seed),
        }
        for column in COLUMNS:
            row[column] = {"mean": float(group[column].mean()), "sd": float(group[column].std(ddof=0))}
        rows.append(row)
    return {"run": run.name, "device": sorted(frame.device.unique()), "rows": rows}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a workflow run's folder, results/<name>")
    args = parse_args(parser, argv)
    summary = summarise(args.run)
    device = "cuda" if any("cuda" in d for d in summary["device"]) else "cpu"
    write_result(f"run_{args.run.name}_{device}", {"machine": machine(), **summary})


if __name__ == "__main__":
    main()
