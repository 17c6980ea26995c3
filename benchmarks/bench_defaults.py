"""Defaults on anyone's data: each method at its default settings against the converged optimum, on data
shapes no single mock covers; writes JSON to results/.

    python benchmarks/bench_defaults.py          # every shape at N = 500, 5,000, 50,000; two at 1,000,000 too
    python benchmarks/bench_defaults.py --sizes 500 5000 --shapes mixed_scales --large
    python benchmarks/bench_defaults.py --warm-up ... --optima results/bench_defaults_cpu.json  # retime only

The shapes (``SHAPES``), each three Gaussian components observed with heteroscedastic Gaussian noise:

* ``order_one``: three features of spread ~1, noise variances 0.05-0.5 (the regime of our mocks);
* ``mixed_scales``: four features of spreads 1e-4, 0.1, 100 and 1e4, noise in proportion;
* ``zero_error_column``: one feature measured without error (noise variance exactly 0);
* ``near_constant``: one component a thousandth as wide as the data in one feature;
* ``noise_decades``: each star's noise variance drawn over six decades (1e-4 to 1e2 of the spread);
* ``outliers``: 3% of the stars replaced by Student-t (1.5 degrees of freedom) draws ten times as wide;
* ``many_features``: twenty features, each component's correlated across them (small N, many features);
  ``ten_features`` the same with ten;
* ``many_features_missing``, ``ten_features_missing``: the same with a fifth of the entries missing (NaN,
  fitted with ``missing="marginalise"`` and scored on each star's observed entries).

The score is the mean log-likelihood of the noisy training data per star (what XD maximises), computed here
in float64 with numpy, independently of the library. A fit's share of the optimum is
(L_fit - L_1) / (L_opt - L_1): L_1 is the best single Gaussian (XD with K = 1), L_opt the converged
optimum: batch EM with SQUAREM run to a tolerance of 1e-9 nats per star, regularisation 1e-9 of each
feature's variance, float64, best of three k-means starts. Each method at its defaults (seed 0) is scored
the same way; a fit that raises is recorded with its error, and a ConvergenceWarning with its text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from sklearn.exceptions import ConvergenceWarning

from scalable_xd import XDGMM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import machine, parse_args, write_result  # noqa: E402

METHODS = ("em", "minibatch_em", "sgd", "stochastic_em", "stochastic_minibatch_em")
K = 3


def _mixture_draws(rng, n: int, means, sds, weights=(0.5, 0.3, 0.2)):
    """True values from three axis-aligned Gaussians (``means``, ``sds``: (3, d)) and their labels."""
    labels = rng.choice(len(weights), size=n, p=weights)
    return means[labels] + sds[labels] * rng.normal(size=(n, means.shape[1])), labels


def _observe(rng, true, variances):
    """Noisy measurements of ``true`` with the given per-star diagonal noise variances (N, d)."""
    return true + np.sqrt(variances) * rng.normal(size=true.shape)


def order_one(n: int, rng):
    means = np.array([[0.0, 0.0, 0.0], [3.0, 1.0, -1.0], [-2.0, 2.5, 1.0]])
    true, _ = _mixture_draws(rng, n, means, np.full((3, 3), 0.6))
    variances = rng.uniform(0.05, 0.5, size=true.shape)
    return _observe(rng, true, variances), variances


def mixed_scales(n: int, rng):
    scale = np.array([1e-4, 0.1, 100.0, 1e4])
    means = np.array([[0.0, 0.0, 0.0, 0.0], [3.0, 1.0, -1.0, 2.0], [-2.0, 2.5, 1.0, -2.0]])
    true, _ = _mixture_draws(rng, n, means, np.full((3, 4), 0.6))
    variances = rng.uniform(0.05, 0.5, size=true.shape)
    noisy = _observe(rng, true, variances)
    return noisy * scale, variances * scale**2


def zero_error_column(n: int, rng):
    X, variances = order_one(n, rng)
    variances[:, 2] = 0.0  # measured exactly: the true values themselves
    return X, variances


def near_constant(n: int, rng):
    means = np.array([[0.0, 0.0, 0.0], [3.0, 1.0, -1.0], [-2.0, 2.5, 1.0]])
    sds = np.full((3, 3), 0.6)
    sds[2, 0] = 0.6e-3  # the third component is a thin sheet in feature 0 (measured with tiny errors)
    true, labels = _mixture_draws(rng, n, means, sds)
    variances = rng.uniform(0.05, 0.5, size=true.shape)
    variances[labels == 2, 0] = rng.uniform(1e-8, 1e-7, size=(labels == 2).sum())
    return _observe(rng, true, variances), variances


def noise_decades(n: int, rng):
    means = np.array([[0.0, 0.0, 0.0], [3.0, 1.0, -1.0], [-2.0, 2.5, 1.0]])
    true, _ = _mixture_draws(rng, n, means, np.full((3, 3), 0.6))
    variances = 10.0 ** rng.uniform(-4, 2, size=true.shape)
    return _observe(rng, true, variances), variances


def outliers(n: int, rng):
    X, variances = order_one(n, rng)
    bad = rng.random(n) < 0.03
    X[bad] = 10.0 * rng.standard_t(1.5, size=(bad.sum(), X.shape[1]))
    return X, variances


def many_features(n: int, rng, d: int = 20):
    """Twenty features, each component correlated across them (a catalogue of many colours and magnitudes)."""
    means = rng.normal(0.0, 2.0, size=(3, d))
    mixing = rng.normal(0.0, 1.0, size=(3, d, d)) / np.sqrt(d)
    labels = rng.choice(3, size=n, p=(0.5, 0.3, 0.2))
    true = means[labels] + np.einsum("nij,nj->ni", mixing[labels], rng.normal(size=(n, d)))
    variances = rng.uniform(0.05, 0.5, size=true.shape)
    return _observe(rng, true, variances), variances


def ten_features(n: int, rng):
    return many_features(n, rng, d=10)


def _with_missing(shape):
    """``shape`` with a fifth of its entries missing (NaN), at random."""

    def missing(n: int, rng):
        X, variances = shape(n, rng)
        X[rng.random(X.shape) < 0.2] = np.nan
        return X, variances

    missing.__name__ = f"{shape.__name__}_missing"
    return missing


SHAPES = {
    f.__name__: f
    for f in (
        order_one,
        mixed_scales,
        zero_error_column,
        near_constant,
        noise_decades,
        outliers,
        many_features,
        ten_features,
        _with_missing(many_features),
        _with_missing(ten_features),
    )
}


def data(shape: str, n: int, seed: int = 0):
    """(X, diagonal noise variances) of ``shape`` with ``n`` stars."""
    return SHAPES[shape](n, np.random.default_rng([seed, n, list(SHAPES).index(shape)]))


def mean_loglik(X, noise, weights, means, covariances, chunk: int = 100_000) -> float:
    """The mean log-likelihood per star of the noisy data under an XD mixture, in float64 with numpy:
    log sum_j alpha_j N(x_i | m_j, V_j + S_i), S_i = diag(noise_i) for noise variances (N, D), else the noise
    covariances themselves (N, D, D); a star with entries missing (NaN) on its observed entries, under the
    mixture's marginal (a star with none observed scores 0)."""
    observed = ~np.isnan(X)
    if not observed.all():
        patterns, which = np.unique(observed, axis=0, return_inverse=True)
        total = 0.0
        for code, seen in enumerate(patterns):
            rows = which.ravel() == code
            if seen.any():
                marginal = covariances[:, seen][:, :, seen]
                kept = noise[rows][:, seen] if noise.ndim == 2 else noise[rows][:, seen][:, :, seen]
                total += mean_loglik(X[rows][:, seen], kept, weights, means[:, seen], marginal) * rows.sum()
        return total / len(X)
    total = 0.0
    for start in range(0, len(X), chunk):
        x, S = X[start : start + chunk], noise[start : start + chunk]
        if S.ndim == 2:
            S = S[:, :, None] * np.eye(X.shape[1])[None]
        terms = []
        for alpha, m, V in zip(weights, means, covariances):
            L = np.linalg.cholesky(V[None] + S)
            z = np.linalg.solve(L, (x - m)[:, :, None])[..., 0]
            log_det = 2 * np.log(np.diagonal(L, axis1=1, axis2=2)).sum(1)
            with np.errstate(divide="ignore"):  # a frozen component's weight is 0: log 0 = -inf, no term
                terms.append(np.log(alpha) - 0.5 * (X.shape[1] * np.log(2 * np.pi) + log_det + (z**2).sum(1)))
        stacked = np.stack(terms, axis=1)
        top = stacked.max(1)
        total += (top + np.log(np.exp(stacked - top[:, None]).sum(1))).sum()
    return total / len(X)


def _score(model, X, variances) -> float:
    return mean_loglik(X, variances, model.weights_, model.means_, model.covariances_)


def _missing(X) -> str:
    """The library's missing-data setting for ``X``: its default where every entry is observed."""
    return "marginalise" if np.isnan(X).any() else "variance"


def optimum(X, variances, k: int, starts: int = 3) -> float:
    """The converged optimum's mean log-likelihood: SQUAREM batch EM to 1e-9, negligible regularisation,
    float64, best of ``starts`` k-means starts."""
    best = -np.inf
    for seed in range(starts):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            model = XDGMM(
                k, "em", epochs=5000, tol=1e-9, w=1e-9, dtype="float64", random_state=seed, missing=_missing(X)
            )
            best = max(best, _score(model.fit(X, Xcov=variances), X, variances))
    return best


def at_defaults(method: str, X, variances, k: int, warm_up: bool = False, n_init: int | None = None) -> dict:
    """One fit at the method's default settings (seed 0): its score, seconds, epochs and any warning or error.
    ``warm_up``: first an untimed one-epoch fit of the same kind, so that the seconds leave out the kernels'
    first compiles (a user's process pays those once, not at every fit). ``n_init``: the default's (None) or
    as given (1: seed 0's start alone, as the tests ask whether the defaults converge)."""
    settings = dict(random_state=0, missing=_missing(X), n_init=n_init)
    if warm_up:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                XDGMM(k, method, epochs=1, **settings).fit(X, Xcov=variances)
            except Exception:  # the timed fit below records what went wrong
                pass
    tick = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        try:
            model = XDGMM(k, method, **settings).fit(X, Xcov=variances)
        except Exception as err:  # a failure is a result here: recorded, not raised
            return {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - tick}
    seconds = time.perf_counter() - tick
    warned = [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)]
    return {
        "loglik": _score(model, X, variances),
        "seconds": seconds,
        "epochs": model.n_iter_,
        "warning": warned[0] if warned else None,
    }


def study(
    shape: str,
    n: int,
    methods=METHODS,
    starts: int = 3,
    warm_up: bool = False,
    n_init: int | None = None,
    known: dict | None = None,
) -> dict:
    """Every method's share of the optimum (the best of ``starts`` converged fits) on one shape and size
    (``warm_up``, ``n_init``: see ``at_defaults``); ``known``: an earlier row of the same shape and size,
    whose optimum and single Gaussian are taken rather than fitted again (the data are the same draw)."""
    X, variances = data(shape, n)
    if known is not None:
        best, single = known["optimum"], known["single_gaussian"]
    else:
        best, single = optimum(X, variances, K, starts), optimum(X, variances, 1, starts=1)
    row = {"shape": shape, "N": n, "D": X.shape[1], "K": K, "optimum": best, "single_gaussian": single}
    for method in methods:
        fit = at_defaults(method, X, variances, K, warm_up, n_init)
        if "loglik" in fit:
            fit["share"] = (fit["loglik"] - single) / (best - single)
        row[method] = fit
    return row


def _share(row: dict, method: str) -> str:
    fit = row[method]
    return ("raised" if "error" in fit else f"{100 * fit['share']:.0f}%") + (" (warned)" if fit.get("warning") else "")


def _seconds(row: dict, method: str) -> str:
    em = row.get("em", {}).get("seconds")
    seconds = row[method]["seconds"]
    return f"{seconds:.2f}" + (f" ({seconds / em:.1f}x)" if em and method != "em" else "")


def table(rows: list[dict], cell=_share) -> str:
    """The docs' table: each method's share of the optimum per shape and size ("raised" where it raised), or
    with ``cell=_seconds`` its seconds and their ratio to batch EM's."""
    methods = [m for m in METHODS if m in rows[0]]
    lines = ["| shape | N | " + " | ".join(methods) + " |", "|---|---:|" + "---:|" * len(methods)]
    for row in rows:
        lines.append(f"| {row['shape']} | {row['N']:,} | " + " | ".join(cell(row, m) for m in methods) + " |")
    return "\n".join(lines)


def _done_rows(name: str, warm_up: bool, methods: list[str]) -> list[dict]:
    """The rows of an earlier run of the same kind in ``name``'s JSON (``--resume``), to be kept, not rerun."""
    path = _common.destination / f"{name}.json"
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())
    if earlier.get("warm_up") != warm_up or earlier.get("methods") != methods:
        raise SystemExit(
            f"{path}: made with warm_up={earlier.get('warm_up')}, methods={earlier.get('methods')}; "
            f"this run asks warm_up={warm_up}, methods={methods}: not resumed (give another --label)"
        )
    return earlier["results"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 5_000, 50_000])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--large", type=int, nargs="*", default=[1_000_000], help="sizes for --large-shapes only")
    parser.add_argument("--large-shapes", nargs="*", default=["mixed_scales", "outliers"], choices=list(SHAPES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--label", default=None, help="suffix of the output file name (e.g. before)")
    parser.add_argument(
        "--warm-up",
        action="store_true",
        help="an untimed one-epoch fit before each timed one, so that its seconds leave out first compiles "
        "(a JSON's warm_up key says which; those without the key ran without it: their seconds include compiles)",
    )
    parser.add_argument(
        "--optima",
        type=Path,
        nargs="+",
        default=[],
        help="earlier JSONs of this benchmark: each (shape, N) found in one takes its optimum from there instead "
        "of fitting it again (most of an hour at D = 20, N = 10,000), so that a rerun retimes the methods alone",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows (shape, N) already in the output JSON and run the others (the JSON is rewritten "
        "after every row, so a stopped run loses at most the row in progress)",
    )
    args = parse_args(parser, argv, sizes=[500], shapes=["order_one", "mixed_scales"], methods=["em"], large=[])
    name = "bench_defaults_cpu" + (f"_{args.label}" if args.label else "")
    rows = _done_rows(name, args.warm_up, args.methods) if args.resume else []
    done = {(row["shape"], row["N"]) for row in rows}
    known = {(row["shape"], row["N"]): row for path in args.optima for row in json.loads(path.read_text())["results"]}
    for shape in args.shapes:
        for n in args.sizes + (args.large if shape in args.large_shapes else []):
            if (shape, n) in done:
                continue
            rows.append(study(shape, n, args.methods, warm_up=args.warm_up, known=known.get((shape, n))))
            print(table(rows[-1:]).splitlines()[-1], table(rows[-1:], _seconds).splitlines()[-1], flush=True)
            result = {"benchmark": "bench_defaults", **machine(), "warm_up": args.warm_up, "methods": args.methods}
            result.update(results=rows, table=table(rows), seconds=table(rows, _seconds))
            write_result(name, result)
    print(table(rows))
    print(table(rows, _seconds))


if __name__ == "__main__":
    main()
