"""Our fit at its defaults against a peer's converged fit, on real Gaia DR2 rows; writes JSON to results/.

    python benchmarks/bench_real_peer.py                      # K = 4 and 8, seeds 0-4
    python benchmarks/bench_real_peer.py --catalogue my.fits --n-components 6 --seeds 0 1 2

The data: the shared sample of real DR2 rows (``../shared/data/gaia_dr2_real_sample/gdr2_sm.fits`` beside
the checkout, or ``--catalogue``), through the workflow's features (``compute_features``: seven features
and their full noise covariances), the rows with every feature measured (the peer takes no missing entries).

The peer: astroML's ``XDGMM`` (VanderPlas et al. 2012; Bovy et al. 2011's EM), where importable (``pip
install astroML``; never a dependency here), from its own start (scikit-learn's ``GaussianMixture`` on the
noisy data) and run to its own convergence (total log-likelihood gain below 1e-5, at most ``--peer-iter``
iterations). Ours: ``XDGMM(K, random_state=seed)``, nothing else set, so with the default's restarts. Both
from the same seeds; each fit scored by the mean log-likelihood of the noisy data per star, computed in
float64 with numpy, independently of both libraries (``bench_defaults.mean_loglik``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, parse_args, write_result  # noqa: E402
from bench_defaults import mean_loglik  # noqa: E402

from scalable_xd import XDGMM  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "gaia_dr2_real_sample" / "gdr2_sm.fits"


def real_rows(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(X, Xcov): the catalogue's features and dense noise covariances, the rows with every feature measured."""
    from astropy.table import Table

    from scalable_xd.pipeline.gaia.features import compute_features

    if not path.exists():
        raise SystemExit(f"{path}: no such catalogue (the shared real DR2 sample, or give --catalogue)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the archive's units astropy does not parse
        features = compute_features(Table.read(path))
    complete = features.n_missing == 0  # a missing entry is a fill value with a huge variance, not a NaN
    return np.asarray(features.X, dtype=float)[complete], features.covariance().dense().numpy()[complete]


def ours(X, Xcov, k: int, seed: int) -> dict:
    tick = time.perf_counter()
    model = XDGMM(k, random_state=seed).fit(X, Xcov=Xcov)
    seconds = time.perf_counter() - tick
    score = mean_loglik(X, Xcov, model.weights_, model.means_, model.covariances_)
    return {"loglik": score, "seconds": seconds, "starts": len(model.start_scores_), "epochs": model.n_iter_}


def peer(X, Xcov, k: int, seed: int, iterations: int) -> dict | None:
    """astroML's fit from its own start, or None where astroML is not installed."""
    if importlib.util.find_spec("astroML") is None:
        return None
    from astroML.density_estimation import XDGMM as AstroMLXDGMM

    tick = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its GaussianMixture start stops at 10 iterations by design
        model = AstroMLXDGMM(k, max_iter=iterations, random_state=seed).fit(X, Xcov)
    seconds = time.perf_counter() - tick
    return {"loglik": mean_loglik(X, Xcov, model.alpha, model.mu, model.V), "seconds": seconds}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--catalogue", type=Path, default=SAMPLE, help="a FITS table of Gaia DR2 rows")
    parser.add_argument("--n-components", type=int, nargs="+", default=[4, 8], help="the K of each fit")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(5)), help="each fit's random_state")
    parser.add_argument("--peer-iter", type=int, default=1000, help="the peer's EM iterations at most")
    args = parse_args(parser, argv, n_components=[2], seeds=[0], peer_iter=3)
    X, Xcov = real_rows(args.catalogue)
    rows = []
    for k in args.n_components:
        for seed in args.seeds:
            row = {"K": k, "seed": seed, "ours": ours(X, Xcov, k, seed), "peer": peer(X, Xcov, k, seed, args.peer_iter)}
            rows.append(row)
            them = "" if row["peer"] is None else f", astroML {row['peer']['loglik']:.4f}"
            print(f"K = {k}, seed {seed}: ours {row['ours']['loglik']:.4f}{them}", flush=True)
    write_result(
        "bench_real_peer_cpu",
        {
            "benchmark": "bench_real_peer",
            **machine(),
            "catalogue": args.catalogue.name,
            "N": len(X),
            "D": X.shape[1],
            "peer": "astroML.density_estimation.XDGMM" if rows and rows[0]["peer"] is not None else None,
            "peer_iter": args.peer_iter,
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
