"""Throughput of the data path: the DR2-like mock and the features; writes JSON to results/.

    OMP_NUM_THREADS=1 python benchmarks/bench_data.py     # one core, as the mock's target is stated

The mock should produce 2 million rows in under a minute on one core.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, parse_args, write_result  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-rows", type=int, default=2_000_000)
    args = parse_args(parser, argv, n_rows=2000)

    from scalable_xd.pipeline.gaia.features import compute_features
    from scalable_xd.pipeline.gaia.mock import make_mock
    from scalable_xd.pipeline.gaia.storage import write_feature_splits

    tick = time.perf_counter()
    frame = make_mock(args.n_rows, seed=0)
    mock_seconds = time.perf_counter() - tick
    tick = time.perf_counter()
    compute_features(frame)
    feature_seconds = time.perf_counter() - tick
    with tempfile.TemporaryDirectory() as folder:
        frame.to_parquet(f"{folder}/raw.parquet", row_group_size=200_000)
        tick = time.perf_counter()
        write_feature_splits(f"{folder}/raw.parquet", f"{folder}/features", progress=False)
        split_seconds = time.perf_counter() - tick
    row = {
        "n_rows": args.n_rows,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "mock_seconds": mock_seconds,
        "features_seconds": feature_seconds,
        "feature_files_seconds": split_seconds,
    }
    print(row)
    write_result("bench_data_cpu", {"benchmark": "bench_data", **machine(), "results": [row]})


if __name__ == "__main__":
    main()
