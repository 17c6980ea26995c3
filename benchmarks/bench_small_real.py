"""Each method at its defaults on small real catalogues, against batch EM's fit of the same rows; writes JSON.

    python benchmarks/bench_small_real.py                     # K = 2, 4, 8; seeds 0-4; every catalogue

The catalogues, none designed here: the shared real Gaia DR2 rows (seven features with their full noise
covariances, the rows with every feature measured: ``bench_real_peer.real_rows``; left out where the sample
is not beside the checkout), and two tables that scikit-learn ships, taken as measured without noise (XD with
S = 0 is a Gaussian mixture): wine (178 rows, 13 chemical measurements) and breast cancer (569 rows, its first
20 features: the cell nuclei's means and standard errors, of scales from 1e-3 to 1e3).

For each catalogue, K and seed: ``XDGMM(K, method, random_state=seed)`` with nothing else set (so with the
default's restarts), for batch EM, minibatch EM and SGD, fitted to two thirds of the rows (a fixed random
split) and scored by the mean log-likelihood per row of those rows and of the third held out (noisy data,
float64, numpy: ``bench_defaults.mean_loglik``, independent of the library). Each minibatch method's gap to
batch EM's fit of the same seed, in both; the summary gives each method's mean and worst gap per catalogue
and K. The target (issue: defaults on small real catalogues): every minibatch method within 0.25 nats a row
of batch EM. Where a mixture has about as many parameters as the rows (``parameters`` per fitted row), the
training figure rewards components that narrow onto a few rows, and the held-out one says which fit
generalises.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, parse_args, write_result  # noqa: E402
from bench_defaults import mean_loglik  # noqa: E402
from bench_real_peer import SAMPLE, real_rows  # noqa: E402

from scalable_xd import XDGMM  # noqa: E402

METHODS = ("em", "minibatch_em", "sgd")


def catalogues(sample: Path, rows: int | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each catalogue's (X, Xcov), its first ``rows`` rows where given (the quick mode)."""
    from sklearn.datasets import load_breast_cancer, load_wine

    tables = {"wine": load_wine().data, "breast_cancer_20": load_breast_cancer().data[:, :20]}
    out = {name: (X, np.zeros((len(X), X.shape[1], X.shape[1]))) for name, X in tables.items()}
    if sample.exists():
        out = {"gaia_dr2_real": real_rows(sample), **out}
    return {name: (X[:rows], S[:rows]) for name, (X, S) in out.items()}


SPLIT_SEED = 2019  # the rows held out: the same third for every fit of a catalogue


def fit(X, S, held_out: np.ndarray, k: int, method: str, seed: int) -> dict:
    """One fit to the rows not ``held_out``, scored on them (``loglik``) and on the held-out rows."""
    tick = time.perf_counter()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")  # the minibatch methods' "not converged" at their budgets: not kept
        model = XDGMM(k, method, random_state=seed).fit(X[~held_out], Xcov=S[~held_out])
    seconds = time.perf_counter() - tick
    params = model.weights_, model.means_, model.covariances_
    return {
        "loglik": mean_loglik(X[~held_out], S[~held_out], *params),
        "held_out_loglik": mean_loglik(X[held_out], S[held_out], *params),
        "refitted_in_float64": any("fitted again in float64" in str(w.message) for w in said),
        "seconds": seconds,
    }


def summary(rows: list[dict]) -> list[dict]:
    """Per catalogue, K and minibatch method: the mean and the worst (lowest) gap to batch EM's fit."""
    out = []
    for name in dict.fromkeys(row["catalogue"] for row in rows):
        for k in dict.fromkeys(row["K"] for row in rows if row["catalogue"] == name):
            cell = [row for row in rows if row["catalogue"] == name and row["K"] == k]
            for method in METHODS[1:]:
                entry = {"catalogue": name, "K": k, "method": method}
                for score, prefix in (("loglik", ""), ("held_out_loglik", "held_out_")):
                    gaps = [row[method][score] - row["em"][score] for row in cell]
                    entry.update({f"{prefix}mean_gap": float(np.mean(gaps)), f"{prefix}worst_gap": float(min(gaps))})
                out.append(entry)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--catalogue", type=Path, default=SAMPLE, help="the real DR2 rows (a FITS table)")
    parser.add_argument("--n-components", type=int, nargs="+", default=[2, 4, 8], help="the K of each fit")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(5)), help="each fit's random_state")
    parser.add_argument("--rows", type=int, default=None, help="the first rows of each catalogue only")
    args = parse_args(parser, argv, n_components=[2], seeds=[0], rows=120)
    rows = []
    for name, (X, S) in catalogues(args.catalogue, args.rows).items():
        held_out = np.zeros(len(X), bool)
        held_out[np.random.default_rng(SPLIT_SEED).permutation(len(X))[: len(X) // 3]] = True
        d = X.shape[1]
        for k in args.n_components:
            parameters = k * (1 + d + d * (d + 1) // 2) - 1
            for seed in args.seeds:
                row = {"catalogue": name, "N": len(X), "D": d, "K": k, "seed": seed}
                row.update({"held_out": int(held_out.sum()), "parameters_per_row": parameters / (~held_out).sum()})
                row.update({method: fit(X, S, held_out, k, method, seed) for method in METHODS})
                rows.append(row)
                scores = ", ".join(f"{m} {row[m]['loglik']:.3f} / {row[m]['held_out_loglik']:.3f}" for m in METHODS)
                print(f"{name} K = {k}, seed {seed}: {scores}", flush=True)
    write_result(
        "bench_small_real_cpu",
        {"benchmark": "bench_small_real", **machine(), "results": rows, "summary": summary(rows)},
    )


if __name__ == "__main__":
    main()
