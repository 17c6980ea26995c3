"""XD under a known selection function against truth, and against pygmmis; writes JSON to results/.

    python benchmarks/bench_selection.py            # N = 6,000 and 60,000; every method; the limit sweep

The mock (Melchior & Goulding 2018's kind): a 2-D mixture of 3 components observed with per-point noise
(standard deviations uniform in [0.2, 0.6]), then selected by a limit on the first feature, observed or
true. Three fits are scored on 20,000 held-out, noise-free draws of the whole population (mean
log-likelihood a point): the oracle (XD on every point, before the selection), the naive fit (XD on the
kept points) and the selection-aware fit (``fit(..., selection=...)``), each at the method's defaults (its
own epoch budget; batch EM under a selection resolves ``tol`` and ``acceleration`` itself). ``closed`` is the
share of the naive fit's gap to the oracle that the aware fit closes. Reported per method and per limit
(keeping from ~87% to ~30% of the points), over three draws of the mock, with each aware fit's seconds and
epochs; at the headline limit (1.0, keeping 58%) batch EM also under a selection on the true values.
pygmmis (``pip install pygmmis``; never a dependency of ours), when importable, fits the same kept points at
the headline limit with the same selection, its imputation noise drawn as ours is (the covariance of a
random kept point) and its own defaults otherwise (its k-means start, tol 1e-3, oversampling 10).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from sklearn.exceptions import ConvergenceWarning

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, parse_args, write_result  # noqa: E402

from scalable_xd import XDGMM  # noqa: E402
from scalable_xd.fit.selection import Selection  # noqa: E402

WEIGHTS = np.array([0.3, 0.5, 0.2])
MEANS = np.array([[0.0, 0.0], [1.5, 1.5], [-1.5, 2.5]])
COVS = np.array([[[1, 0.3], [0.3, 0.5]], [[0.4, -0.2], [-0.2, 0.8]], [[0.6, 0], [0, 0.3]]])
METHODS = ("em", "minibatch_em", "sgd")


def draw(rng, n):
    labels = rng.choice(len(WEIGHTS), n, p=WEIGHTS)
    chol = np.linalg.cholesky(COVS)
    return MEANS[labels] + np.einsum("nij,nj->ni", chol[labels], rng.normal(size=(n, 2)))


def mock(seed: int, n: int):
    rng = np.random.default_rng(seed)
    true = draw(rng, n)
    sigma = rng.uniform(0.2, 0.6, size=true.shape)
    return true, true + sigma * rng.normal(size=true.shape), sigma**2, draw(rng, 20_000)


def settings(method: str, epochs: int | None) -> dict:
    """The method's defaults (``epochs`` None), or a few epochs in the quick mode."""
    return dict(n_components=3, method=method, epochs=epochs, random_state=0)


def case(seed: int, n: int, method: str, on: str, limit: float, epochs: int | None, with_pygmmis: bool) -> dict:
    true, x, V, held_out = mock(seed, n)
    kept = (x if on == "observed" else true)[:, 0] < limit
    score = lambda model: float(model.score(held_out, Xcov=np.zeros_like(held_out)))  # noqa: E731
    oracle = score(XDGMM(**settings(method, epochs)).fit(x, Xcov=V))
    naive = score(XDGMM(**settings(method, epochs)).fit(x[kept], Xcov=V[kept]))
    selection = Selection(lambda v: (v[:, 0] < limit).astype(float), on=on)
    tick = time.perf_counter()
    model = XDGMM(**settings(method, epochs)).fit(x[kept], Xcov=V[kept], selection=selection)
    seconds = time.perf_counter() - tick
    aware = score(model)
    row = dict(seed=seed, N=n, method=method, on=on, limit=limit, kept=float(kept.mean()), epochs=model.n_iter_)
    row.update(oracle=oracle, naive=naive, aware=aware, closed=(aware - naive) / (oracle - naive), seconds=seconds)
    if with_pygmmis and on == "observed":
        row["pygmmis"] = pygmmis_fit(x[kept], V[kept], limit, held_out, seed)
        row["pygmmis"]["closed"] = (row["pygmmis"]["score"] - naive) / (oracle - naive)
    return row


def pygmmis_fit(x, V, limit, held_out, seed) -> dict:
    import pygmmis

    rng = np.random.RandomState(seed)
    covs = np.stack([np.diag(v) for v in V])
    gmm = pygmmis.GMM(K=3, D=2)
    tick = time.perf_counter()
    pygmmis.fit(
        gmm,
        x,
        covar=covs,
        init_method="kmeans",
        sel_callback=lambda coords: coords[:, 0] < limit,
        covar_callback=lambda coords: covs[rng.randint(len(covs), size=len(coords))],
        rng=rng,
    )
    seconds = time.perf_counter() - tick
    return {"score": float(np.mean(gmm.logL(held_out))), "seconds": seconds}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[6000, 60_000])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--limits", type=float, nargs="+", default=[2.0, 1.0, 0.3, -0.3], help="the limit sweep")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument(
        "--headline", type=float, default=1.0, help="the limit at which batch EM also runs on true values, and pygmmis"
    )
    args = parse_args(parser, argv, sizes=[1500], seeds=[1], limits=[1.0])
    quick = args.quick
    with_pygmmis = not quick and importlib.util.find_spec("pygmmis") is not None
    warnings.simplefilter("ignore", ConvergenceWarning)  # the methods' own budgets; the table says what they reach
    epochs = 3 if quick else None
    rows = []
    for n in args.sizes:
        for seed in args.seeds:
            for limit in args.limits:
                headline = limit == args.headline
                cases = [(method, "observed") for method in args.methods]
                cases += [("em", "true")] if headline and "em" in args.methods else []
                for method, on in cases:
                    pygmmis = with_pygmmis and headline and method == "em" and on == "observed" and n <= 6000
                    rows.append(case(seed, n, method, on, limit, epochs, pygmmis))
                    print(
                        {k: rows[-1][k] for k in ("N", "seed", "limit", "method", "on", "closed", "seconds")},
                        flush=True,
                    )
    write_result("bench_selection_cpu", {"machine": machine(), "pygmmis": with_pygmmis, "cases": rows})


if __name__ == "__main__":
    main()
