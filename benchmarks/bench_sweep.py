"""The pair rate of one epoch against N, for each method and data form; writes JSON to benchmarks/results/.

    python benchmarks/bench_sweep.py                       # N = 2e5, 2e6 (all forms) and 2e7 (streamed), K = 64
    python benchmarks/bench_sweep.py --sizes 200000 2000000 --streamed-only 2000000

A synthetic Gaia-like features catalogue (``bench_stream.write_catalogue``: 7 features, 7 standard deviations
and 10 correlations a star) is fitted for one epoch, float32 and float64, by batch EM (the pass's own rate),
minibatch EM and SGD (batch 500), from each data form a user has:

* ``arrays``: X and the variances as numpy arrays in memory (the correlations dropped);
* ``compact``: X and a ``CompactCovariance`` (sigma and correlations) in memory;
* ``parquet``: the files streamed a window at a time (``features_source``).

Reported per fit: the epoch's training seconds (evaluation excluded) and (star, component) pairs a second;
per N, form and dtype each minibatch method's rate as a fraction of batch EM's (``of_em``: paired, see
below); and per method, form and dtype the largest N's seconds per pair over the smallest's
(``per_pair_growth``): 1 is a cost flat in N. Every fit starts from the same means (no k-means). Each case
(N, form, dtype) runs in its own process, after a fit of each method on 2,000 rows has compiled its kernels:
``--repeats`` rounds fit every method in turn, each fit after a full garbage collection (timeit's practice:
a collection of the ~330,000 objects torch and numba hold takes ~0.15 s, and otherwise lands in whichever
fit's epoch it falls). A fit's seconds are its fastest round's, and ``of_em`` is
batch EM's fastest over the method's fastest: a shared machine only ever slows a fit (by 20-30% for
minutes at a time on this project's VMs, more than the rounds of one case apart), so each method's best
round is the nearest to its cost on a quiet machine. Every round's seconds are recorded (``round_seconds``),
and ``of_em_paired`` is the median over the rounds of batch EM's seconds over the method's in the same
round, for comparison.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, parse_args, write_result  # noqa: E402
from bench_stream import write_catalogue  # noqa: E402

METHODS = ("em", "minibatch_em", "sgd")
DTYPES = ("float32", "float64")

CHILD = r"""
import gc, json, statistics, sys

import numpy as np
from scalable_xd import XDGMM
from scalable_xd.pipeline.features_file import features_source

folder, form, dtype = sys.argv[1:4]
k, repeats, methods = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6].split(",")
source = features_source(folder, validate=False)
n = len(source)
means = source.sample(np.linspace(0, n - 1, k).astype(np.int64), "means").X.numpy()


def in_memory(rows):  # X and the noise of rows in memory, as the form holds them, as fit's arguments
    some = source.sample(rows, "X")
    return {"X": some.X.numpy(), "Xcov": some.noise.sigma.numpy() ** 2 if form == "arrays" else some.noise}


data = {"X": source} if form == "parquet" else in_memory(np.arange(n))
settings = {m: dict(method=m, tol=None, device="cpu", dtype=dtype, random_state=0, means_init=means) for m in methods}
for method in methods:  # compiles the kernels outside the timing
    XDGMM(k, epochs=1, **settings[method]).fit(**in_memory(np.arange(min(n, 2000))))
seconds = {method: [] for method in methods}
for _ in range(repeats):  # the methods in turn, so that each round's ratios see the same machine
    for method in methods:
        gc.collect()  # as timeit would: a full collection (~330,000 objects, ~0.15 s) landed in 1 fit in 9
        seconds[method].append(XDGMM(k, epochs=1, **settings[method]).fit(**data).history_[-1]["seconds"])
for method in methods:
    row = {"N": n, "form": form, "method": method, "dtype": dtype, "K": k, "train_seconds": min(seconds[method]),
           "pairs_per_s": n * k / min(seconds[method]), "round_seconds": seconds[method]}
    if "em" in seconds and method != "em":
        row["of_em"] = min(seconds["em"]) / min(seconds[method])
        row["of_em_paired"] = statistics.median(em / own for em, own in zip(seconds["em"], seconds[method]))
    print(json.dumps(row))
"""


def fit_case(folder: Path, form: str, dtype: str, k: int, repeats: int, methods) -> list[dict]:
    """Every method's fit of one case (N, form, dtype), in one process."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), form, dtype, str(k), str(repeats), ",".join(methods)],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-len(methods) :]]


def summarise(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(each minibatch fit's rate over batch EM's on the same N, form and dtype, best round against best
    round and paired; each method, form and dtype's seconds per pair at its largest N over its smallest)."""
    rate = {(r["N"], r["form"], r["method"], r["dtype"]): r["pairs_per_s"] for r in rows}
    keys = ("N", "form", "method", "dtype", "of_em", "of_em_paired")
    of_em = [{key: r[key] for key in keys} for r in rows if "of_em" in r]
    growth = []
    for form, method, dtype in sorted({key[1:] for key in rate}):
        sizes = sorted(n for n, f, m, d in rate if (f, m, d) == (form, method, dtype))
        if len(sizes) > 1:
            small, large = rate[(sizes[0], form, method, dtype)], rate[(sizes[-1], form, method, dtype)]
            growth.append(
                {"form": form, "method": method, "dtype": dtype, "N": [sizes[0], sizes[-1]], "growth": small / large}
            )
    return of_em, growth


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[200_000, 2_000_000, 20_000_000])
    parser.add_argument(
        "--streamed-only", type=int, nargs="*", default=[20_000_000], help="sizes fitted from Parquet alone"
    )
    parser.add_argument("--n-components", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of fits per case (see above)")
    parser.add_argument("--scratch", default=None, help="where the catalogues are written (default: a temp dir)")
    args = parse_args(
        parser,
        argv,
        sizes=[3000, 6000],
        streamed_only=[3000, 6000],
        n_components=4,
        methods=["em", "minibatch_em"],
        dtypes=["float32"],
        repeats=1,
    )

    rows = []
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        for n in args.sizes:
            folder = Path(scratch) / f"n{n}"
            write_catalogue(folder, n)
            forms = ("parquet",) if n in args.streamed_only else ("arrays", "compact", "parquet")
            for form in forms:
                for dtype in args.dtypes:
                    for row in fit_case(folder, form, dtype, args.n_components, args.repeats, args.methods):
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    of_em, growth = summarise(rows)
    write_result(
        "bench_sweep_cpu",
        {
            "benchmark": "bench_sweep",
            **machine(),
            "rounds": args.repeats,
            "results": rows,
            "of_em": of_em,
            "per_pair_growth": growth,
        },
    )


if __name__ == "__main__":
    main()
