"""Standard errors of a fitted mixture's parameters by the delete-a-group jackknife.

The data are split into G groups at random; each replicate refits the mixture with one group left out, and
the spread of the G replicates gives each parameter's standard error,
se = sqrt((G - 1) / G * sum_g (theta_g - mean theta)^2) (Quenouille 1956, Tukey 1958; Efron & Stein 1981),
as Bovy's IDL add-on ``exd_jackerr.pro`` does for XD. The jackknife rather than the bootstrap because its
replicates are fixed by the seed and each differs from the full data by 1/G of the points: its fit lies a
short distance from the full data's, so each refit starts there (a warm start) and converges in a few
batch-EM iterations instead of a fit from k-means. Leaving a group out is giving its points weight zero,
so every noise form, projection and weighting the fit takes works unchanged.

The errors belong to the maximum-likelihood parameters, so the fit is first converged on all the data
(the ``centre``, from the model's parameters), and the replicates start from the centre. All of these run
batch EM to ``tol`` in float64, since the replicates differ by about se / sqrt(G), which must not drown
in a float32 pass's rounding or a minibatch fit's step noise. Replicate components are matched to the
centre's (the assignment of least Mahalanobis distance between means, scipy's ``linear_sum_assignment``),
which a warm start almost always leaves in place. A mixture whose components are poorly determined by
the data (many components for few points) converges slowly and its errors are large: both are what the
data say, and ``converged`` tells which replicates reached ``tol``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from scipy.optimize import linear_sum_assignment

from .settings import check_count, resolve_seed


class FittedMixture(Protocol):
    """What the jackknife reads of a fitted model (an ``XDGMM``; a protocol, so no import of the estimator)."""

    weights_: np.ndarray
    means_: np.ndarray
    covariances_: np.ndarray
    n_iter_: int
    converged_: bool


@dataclass(frozen=True)
class ParameterErrors:
    """Jackknife standard errors of the weights (K,), means (K, D) and covariances (K, D, D) of ``centre``,
    the fit converged on all the data (an ``XDGMM``), with what they came from: ``fold`` (N,), the group
    each point was left out with; the matched replicates
    ``replicate_weights`` (G, K), ``replicate_means`` (G, K, D), ``replicate_covariances`` (G, K, D, D); and
    ``converged`` (G,), whether each replicate converged by ``tol`` within its iterations."""

    weights: np.ndarray
    means: np.ndarray
    covariances: np.ndarray
    centre: FittedMixture
    fold: np.ndarray
    replicate_weights: np.ndarray
    replicate_means: np.ndarray
    replicate_covariances: np.ndarray
    converged: np.ndarray

    @property
    def n_folds(self) -> int:
        return len(self.converged)


def jackknife_errors(
    model, X, Xcov, R, sample_weight, *, n_folds: int, max_iter: int, tol: float, random_state
) -> ParameterErrors:
    """The jackknife of ``model`` (a fitted ``XDGMM``) over the data it was fitted to, given as arrays (or
    tensors): ``XDGMM.parameter_errors`` has checked them."""
    check_count("n_folds", n_folds, minimum=2)
    check_count("max_iter", max_iter)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0:
        raise ValueError(f"tol must be a positive number, got {tol!r}")
    n = len(X)
    if n_folds > n:
        raise ValueError(f"n_folds={n_folds} is more than the {n} rows of X: each group needs a row")
    rng = np.random.default_rng(resolve_seed(random_state))
    fold = np.empty(n, dtype=np.int64)
    fold[rng.permutation(n)] = np.arange(n) % n_folds
    weights = np.ones(n) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
    if weights.shape != (n,):
        raise ValueError(f"sample_weight must have shape ({n},) like X's rows, got {weights.shape}")
    settings = {
        **model.get_params(),
        "method": "em",
        # SQUAREM (Varadhan & Roland 2008) converges the refits in a fraction of plain EM's iterations; a
        # background's weight is fitted by plain EM only
        "acceleration": "none" if model.get_params().get("background") else "squarem",
        "epochs": max_iter,
        "tol": tol,
        "dtype": "float64",
        "split_merge": False,
        "averaging": "none",
        "truncation": False,
        "warm_start": False,
        "verbose": 0,
        "weights_init": model.weights_,
        "means_init": model.means_,
        "covariances_init": model.covariances_,
    }
    centre = type(model)(**settings).fit(X, Xcov=Xcov, R=R, sample_weight=weights)
    settings.update(weights_init=centre.weights_, means_init=centre.means_, covariances_init=centre.covariances_)
    replicates = []
    for group in range(n_folds):
        refit = type(model)(**settings).fit(X, Xcov=Xcov, R=R, sample_weight=weights * (fold != group))
        order = _matching(centre.means_, centre.covariances_, refit.means_)
        replicates.append(
            (refit.weights_[order], refit.means_[order], refit.covariances_[order], bool(refit.converged_))
        )
    w, m, c, converged = (np.array(values) for values in zip(*replicates))
    return ParameterErrors(_spread(w), _spread(m), _spread(c), centre, fold, w, m, c, converged)


def _matching(means: np.ndarray, covariances: np.ndarray, replicate_means: np.ndarray) -> np.ndarray:
    """For each of the full fit's components, the replicate's component that matches it: the assignment of
    least total squared Mahalanobis distance between means, in the full fit's covariances."""
    offsets = replicate_means[None, :, :] - means[:, None, :]  # (full j, replicate k, D)
    cost = np.einsum("jkd,jde,jke->jk", offsets, np.linalg.inv(covariances), offsets)
    return linear_sum_assignment(cost)[1]


def _spread(replicates: np.ndarray) -> np.ndarray:
    """The jackknife standard error over the first axis, sqrt((G - 1) / G * sum (theta_g - mean)^2)."""
    g = len(replicates)
    return np.sqrt((g - 1) / g * np.sum((replicates - replicates.mean(axis=0)) ** 2, axis=0))
