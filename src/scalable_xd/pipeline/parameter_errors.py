"""The parameter errors of one model of the grid (``XDGMM.parameter_errors`` on its training split): every
component's weight, means and covariances with their jackknife standard errors as JSON, and the heaviest
components as a Markdown table."""

from __future__ import annotations

import numpy as np

from .features_file import read_features


def parameter_errors(model_path, train_path, n_folds: int, seed: int, max_iter: int, tol: float) -> dict:
    """The jackknife of the model at ``model_path`` over the training split it was fitted to."""
    from ..estimator import XDGMM

    model = XDGMM.load(model_path)
    train = read_features(train_path)
    errors = model.parameter_errors(
        train.X, Xcov=train.covariance(), n_folds=n_folds, max_iter=max_iter, tol=tol, random_state=seed
    )
    centre = errors.centre
    order = np.argsort(-centre.weights_, kind="stable")
    return {
        "model": str(model_path),
        "features": list(train.spec.names),
        "n_stars": len(train),
        "n_folds": n_folds,
        "seed": seed,
        "max_iter": max_iter,
        "tol": tol,
        "replicates_converged": int(errors.converged.sum()),
        "centre_iterations": int(centre.n_iter_),
        "components": [
            {
                "component": int(j),
                "weight": float(centre.weights_[j]),
                "weight_se": float(errors.weights[j]),
                "mean": centre.means_[j].tolist(),
                "mean_se": errors.means[j].tolist(),
                "covariance": centre.covariances_[j].tolist(),
                "covariance_se": errors.covariances[j].tolist(),
            }
            for j in order
        ],
    }


def parameter_errors_markdown(result: dict, rows: int = 10) -> str:
    """The ``rows`` heaviest components: weight and each feature's mean and standard deviation (the square
    root of the covariance's diagonal, its error propagated), each as value ± standard error."""
    names = result["features"]
    header = ["component", "weight"] + [f"mean {n}" for n in names] + [f"sd {n}" for n in names]
    lines = [
        f"Jackknife standard errors ({result['n_folds']} groups, seed {result['seed']}) of `{result['model']}` on "
        f"{result['n_stars']:,} training stars; {result['replicates_converged']} of {result['n_folds']} replicates "
        f"converged. The {min(rows, len(result['components']))} heaviest components:",
        "",
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
    ]
    for c in result["components"][:rows]:
        variances, variance_se = np.diagonal(c["covariance"]), np.diagonal(c["covariance_se"])
        sd = np.sqrt(variances)
        cells = [str(c["component"]), _pm(c["weight"], c["weight_se"])]
        cells += [_pm(m, s) for m, s in zip(c["mean"], c["mean_se"])]
        cells += [_pm(d, s / (2 * d)) for d, s in zip(sd, variance_se)]  # d sqrt(v) = dv / (2 sqrt(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pm(value: float, error: float) -> str:
    return f"{value:.4g} ± {error:.2g}"
