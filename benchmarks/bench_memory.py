"""Peak memory of a fit against N, with the data memory-mapped from disk; writes JSON to results/.

    python benchmarks/bench_memory.py                  # N = 250k, 500k, 1M, 2M; K = 64; one epoch each

Each fit runs in a fresh process (minibatch EM, float32, CPU, one epoch plus the evaluation passes) on
features stored as .npy files and opened with mmap_mode="r", so the data themselves are file-backed pages.
Reported per N: peak anonymous memory (RssAnon: what the process allocated, sampled every 10 ms), peak
resident set (VmHWM: also counts file pages touched), and the size of the data on disk. Working memory
that does not grow with N means the batches are streamed; what does grow is the shuffle order (8 bytes
a star).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MEMORY_SAMPLER, machine, parse_args, write_result  # noqa: E402

CHILD = (
    MEMORY_SAMPLER
    + r"""
import json, sys, time

import numpy as np
from scalable_xd import XDGMM, CompactCovariance
from scalable_xd.pipeline.gaia.schema import CORRELATION_PAIRS
folder, n, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
X = np.load(f"{folder}/X.npy", mmap_mode="r")[:n]
noise = CompactCovariance(np.load(f"{folder}/sigma.npy", mmap_mode="r")[:n],
                          np.load(f"{folder}/corr.npy", mmap_mode="r")[:n], CORRELATION_PAIRS)
means = np.asarray(X[np.random.default_rng(0).choice(n, k, replace=False)])
baseline = status()["RssAnon"]
tick = time.perf_counter()
XDGMM(k, "minibatch_em", epochs=1, device="cpu", dtype="float32", random_state=0, means_init=means).fit(X, Xcov=noise)
seconds = time.perf_counter() - tick
done = True
peak["RssAnon"] = max(peak["RssAnon"], status()["RssAnon"])
print(json.dumps({"N": n, "K": k, "seconds": seconds, "baseline_anon_bytes": baseline,
                  "peak_anon_bytes": peak["RssAnon"], "peak_rss_bytes": status()["VmHWM"]}))
"""
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[250_000, 500_000, 1_000_000, 2_000_000])
    parser.add_argument("--n-components", type=int, default=64)
    args = parse_args(parser, argv, sizes=[5000, 10000], n_components=4)

    from scalable_xd.pipeline.gaia.features import compute_features
    from scalable_xd.pipeline.gaia.mock import make_mock

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        features = compute_features(make_mock(max(args.sizes), seed=0))
        for name in ("X", "sigma", "corr"):
            np.save(f"{folder}/{name}.npy", getattr(features, name))
        del features
        for n in args.sizes:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, folder, str(n), str(args.n_components)],
                capture_output=True,
                text=True,
                check=True,
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["data_bytes_on_disk"] = n * 8 * (7 + 7 + 10)
            row["working_anon_bytes"] = row["peak_anon_bytes"] - row["baseline_anon_bytes"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_result("bench_memory_cpu", {"benchmark": "bench_memory", **machine(), "results": rows})


if __name__ == "__main__":
    main()
