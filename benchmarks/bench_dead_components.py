"""Minibatch EM's dead components: re-seeded (the default) against left dead, beside SGD and batch EM, on
the workflow's features of a DR2-like mock; writes JSON to results/.

    python benchmarks/bench_dead_components.py                      # K = 64, seeds 0-3
    python benchmarks/bench_dead_components.py --n-components 128 --seeds 0 1 --label K128

The mock (``pipeline.gaia.mock.make_mock``) through ``pipeline.gaia.features.compute_features``, split at
random (the mock's rows are sorted by ``source_id``, so by position on the sky: its last rows are one
region) into ``--held-out`` held-out stars and the rest fitted. Each fit at its defaults, seed by seed;
per fit the held-out and training mean log-likelihoods (nats a star), the components below one star's
worth of weight (1/N) at the end, the re-seeded count and the seconds. docs/user-guide/fitting.md's table.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, parse_args, write_result  # noqa: E402

FITS = {  # name: (method, settings beside the defaults)
    "minibatch_em": ("minibatch_em", {}),
    "minibatch_em_left_dead": ("minibatch_em", {"reseed_dead": False}),
    "sgd": ("sgd", {}),
    "em": ("em", {}),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-rows", type=int, default=60_000)
    parser.add_argument("--held-out", type=int, default=10_000)
    parser.add_argument("--n-components", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--fits", nargs="+", default=list(FITS), choices=list(FITS))
    parser.add_argument("--label", default=None, help="suffix of the output file name (e.g. K128)")
    args = parse_args(parser, argv, n_rows=3000, held_out=500, n_components=8, seeds=[0])

    import numpy as np

    from scalable_xd import XDGMM
    from scalable_xd.pipeline.gaia.features import compute_features
    from scalable_xd.pipeline.gaia.mock import make_mock

    features = compute_features(make_mock(args.n_rows, seed=0))
    X, S = features.X, features.covariance().dense().numpy()
    order = np.random.default_rng(0).permutation(len(X))
    held, fitted = np.sort(order[: args.held_out]), np.sort(order[args.held_out :])
    rows = []
    for seed in args.seeds:
        for name in args.fits:
            method, settings = FITS[name]
            tick = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a fit that ends with dead components warns: counted here
                model = XDGMM(args.n_components, method, random_state=seed, **settings).fit(X[fitted], Xcov=S[fitted])
            seconds = time.perf_counter() - tick
            row = {
                "fit": name,
                "seed": seed,
                "held_out": model.score(X[held], Xcov=S[held]),
                "training": model.score(X[fitted], Xcov=S[fitted]),
                "dead": int((model.weights_ * len(fitted) < 1).sum()),
                "reseeded": model.history_[-1].get("reseeded"),
                "seconds": seconds,
            }
            rows.append(row)
            print(row, flush=True)
    summary = {}
    for name in args.fits:
        mine = [row for row in rows if row["fit"] == name]
        scores = [row["held_out"] for row in mine]
        summary[name] = {
            "held_out_mean": float(np.mean(scores)),
            "held_out_range": [min(scores), max(scores)],
            "dead_range": [min(r["dead"] for r in mine), max(r["dead"] for r in mine)],
        }
    name = "bench_dead_components_cpu" + (f"_{args.label}" if args.label else "")
    write_result(
        name,
        {
            "benchmark": "bench_dead_components",
            **machine(),
            "n_rows": args.n_rows,
            "held_out": args.held_out,
            "n_components": args.n_components,
            "results": rows,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
