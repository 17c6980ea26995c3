"""Time and peak memory of a streamed fit against N: features in Parquet on disk, read a window at a time;
writes JSON to results/.

    python benchmarks/bench_stream.py                         # N = 2M and 20M, K = 16, one epoch each
    python benchmarks/bench_stream.py --sizes 200000 2000000 --window 262144
    python benchmarks/bench_stream.py --sizes 100000000 --n-components 64 --methods minibatch_em em \
        --scratch /big/disk --name bench_stream_cpu_1e8     # a hundred million stars: 21 GB on disk
    python benchmarks/bench_stream.py --sizes 100000000 --n-components 64 --methods minibatch_em em \
        --processes 2 --scratch /big/disk --name bench_stream_cpu_1e8_p2    # the same over two processes

The data set is a synthetic Gaia-like features catalogue (7 features, 7 standard deviations and 10
correlations a star, the layout ``scalable-xd features`` writes) in files of 1,000,000 rows, row groups
of 65,536, written in parts (one file in memory at a time). Each fit runs in a fresh process: float32, CPU,
one epoch (batch EM: one iteration, plain EM), minibatch EM at batch 500, with the range check on opening and
the evaluation passes before and after the epoch, all streamed (``stream.ParquetSource``). Reported per N
and method: peak resident set (VmHWM), peak anonymous memory (RssAnon, sampled every 10 ms), the whole fit's
seconds and the epoch's (``train_seconds``), and the bytes on disk. Flat memory means the data never sit in
memory.

``--processes P`` runs each fit data-parallel over P processes on this machine (``torch.distributed.run``,
gloo, each process cores / P threads): each process reads every row and computes the statistics of its
share of each global batch, and the processes sum them (an all-reduce a step); the figures are rank 0's
(its memory is one process's, of P).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MEMORY_SAMPLER, machine, parse_args, write_result  # noqa: E402

FILE_ROWS = 1_000_000

CHILD = (
    MEMORY_SAMPLER
    + r"""
import json, os, sys, time

import numpy as np
import torch
import torch.distributed as dist
from scalable_xd import XDGMM
from scalable_xd.pipeline.features_file import features_source
folder, k, window, method = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
processes = int(os.environ.get("WORLD_SIZE", "1"))
if processes > 1:  # under torch.distributed.run: the fit runs data-parallel over the group
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))
baseline = status()
tick = time.perf_counter()
source = features_source(folder, window)
opened = time.perf_counter() - tick
means = source.sample(np.arange(0, len(source), len(source) // k)[:k], "means").X.numpy()
plain = dict(tol=None, acceleration="none") if method == "em" else {}
model = XDGMM(k, method, epochs=1, device="cpu", dtype="float32", random_state=0, means_init=means, n_init=1,
              **plain)
model.fit(source)
seconds = time.perf_counter() - tick
done = True
peak["RssAnon"] = max(peak["RssAnon"], status()["RssAnon"])
if processes > 1 and dist.get_rank() > 0:
    sys.exit(0)
print(json.dumps({"N": len(source), "K": k, "method": method, "window_rows": window, "seconds": seconds,
                  "processes": processes, "threads": torch.get_num_threads(),
                  "open_seconds": opened, "train_seconds": model.history_[-1]["seconds"],
                  "train_loglik": model.history_[-1]["train_loglik"], "baseline_rss_bytes": baseline["VmHWM"],
                  "baseline_anon_bytes": baseline["RssAnon"], "peak_anon_bytes": peak["RssAnon"],
                  "peak_rss_bytes": status()["VmHWM"]}))
"""
)


def write_catalogue(folder: Path, n: int, seed: int = 0) -> int:
    """A synthetic features catalogue of n rows (a mixture of 16 Gaussians, Gaia-like noise) in files of
    ``FILE_ROWS`` rows; returns its size on disk in bytes."""
    import pyarrow.parquet as pq

    from scalable_xd.pipeline.features_file import Features, features_to_arrow, file_metadata
    from scalable_xd.pipeline.gaia.schema import GAIA_DR2 as spec

    rng = np.random.default_rng(seed)
    d = len(spec.names)
    centres = rng.normal(scale=5.0, size=(16, d))
    folder.mkdir(parents=True, exist_ok=True)
    for number, start in enumerate(range(0, n, FILE_ROWS)):
        m = min(FILE_ROWS, n - start)
        sigma = rng.uniform(0.05, 0.5, size=(m, d))
        x = centres[rng.integers(0, 16, m)] + rng.normal(size=(m, d)) + sigma * rng.normal(size=sigma.shape)
        # |rho| <= 0.2: four per row sum below 1, so every correlation matrix is positive definite (Gershgorin)
        corr = rng.uniform(-0.2, 0.2, size=(m, len(spec.correlations)))
        ids = np.arange(start, start + m)
        features = Features(spec, x, sigma, corr, np.zeros(m, np.int8), ids, ids, "corrected")
        table = features_to_arrow(features).replace_schema_metadata(file_metadata(spec, "corrected", 0))
        pq.write_table(table, folder / f"part-{number:05d}.parquet", row_group_size=65_536)
    return sum(p.stat().st_size for p in folder.glob("*.parquet"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2_000_000, 20_000_000])
    parser.add_argument("--n-components", type=int, default=16)
    parser.add_argument("--window", type=int, default=1 << 20, help="rows per shuffle window")
    parser.add_argument("--methods", nargs="+", default=["minibatch_em"], choices=["minibatch_em", "em", "sgd"])
    parser.add_argument("--scratch", default=None, help="where the catalogues are written (default: a temp dir)")
    parser.add_argument("--name", default="bench_stream_cpu", help="the JSON's name in results/")
    parser.add_argument("--processes", type=int, default=1, help="processes each fit runs data-parallel over")
    args = parse_args(parser, argv, sizes=[3000, 6000], n_components=4, window=2048, methods=["minibatch_em", "em"])

    rows = []
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        child = Path(scratch) / "child.py"  # a file: torch.distributed.run starts a script
        child.write_text(CHILD)
        launch = [sys.executable, str(child)]
        if args.processes > 1:
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            launch += [f"--nproc-per-node={args.processes}", str(child)]
        for n in args.sizes:
            folder = Path(scratch) / f"n{n}"
            tick = time.perf_counter()
            on_disk = write_catalogue(folder, n)
            written = time.perf_counter() - tick
            for method in args.methods:
                command = [*launch, str(folder), str(args.n_components), str(args.window), method]
                out = subprocess.run(command, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(out.stderr[-3000:])
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row.update(data_bytes_on_disk=on_disk, write_seconds=written)
                print(json.dumps(row), flush=True)
                rows.append(row)
            shutil.rmtree(folder)  # before the next size's files: a hundred million rows take 21 GB
    peaks = {method: [row["peak_rss_bytes"] for row in rows if row["method"] == method] for method in args.methods}
    result = {
        "benchmark": "bench_stream",
        **machine(),
        "results": rows,
        "largest_over_smallest_peak_rss": {method: max(p[-1], 1) / max(p[0], 1) for method, p in peaks.items()},
    }
    write_result(args.name, result)


if __name__ == "__main__":
    main()
