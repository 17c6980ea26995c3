"""Conditioning a fitted mixture on some features (``XDGMM.condition``), against the Gaussian formulas written
out with explicit inverses (numpy) and against the joint model's own density."""

import numpy as np
import pytest
from helpers import random_spd, xd_log_densities
from scipy.stats import multivariate_normal

from scalable_xd import XDGMM


def _conditional_by_hand(weights, means, covs, keep, x_b, S_b):
    """Gaussian conditioning written out with explicit inverses (numpy), and scipy for the marginal."""
    a, b = np.flatnonzero(keep), np.flatnonzero(~keep)
    out_w, out_m, out_V = [], [], []
    for alpha, m, V in zip(weights, means, covs):
        T = V[np.ix_(b, b)] + S_b
        gain = V[np.ix_(a, b)] @ np.linalg.inv(T)
        out_m.append(m[a] + gain @ (x_b - m[b]))
        out_V.append(V[np.ix_(a, a)] - gain @ V[np.ix_(b, a)])
        out_w.append(alpha * multivariate_normal(m[b], T).pdf(x_b))
    return np.array(out_w) / np.sum(out_w), np.array(out_m), np.array(out_V)


@pytest.mark.parametrize("n_components", [1, 3])
@pytest.mark.parametrize("noise", ["none", "variances", "matrix"])
def test_conditioning_matches_the_gaussian_formulas(n_components, noise):
    rng = np.random.default_rng(n_components)
    weights = rng.dirichlet(np.ones(n_components))
    means, covs = rng.normal(scale=2, size=(n_components, 4)), random_spd(rng, n_components, 4)
    model = XDGMM(
        n_components, device="cpu", weights_init=weights, means_init=means, covariances_init=covs, epochs=1, tol=None
    )
    model._set_fitted(_mixture(weights, means, covs), [], True, *model._validated())
    given = np.array([np.nan, 0.7, np.nan, -1.2])
    S_b = {"none": None, "variances": np.array([0.3, 0.1]), "matrix": np.array([[0.3, 0.05], [0.05, 0.1]])}[noise]
    S_full = np.zeros((2, 2)) if S_b is None else np.diag(S_b) if S_b.ndim == 1 else S_b
    conditioned = model.condition(given, S_b)
    expected = _conditional_by_hand(weights, means, covs, np.isnan(given), given[[1, 3]], S_full)
    np.testing.assert_allclose(conditioned.weights_, expected[0], rtol=1e-10)
    np.testing.assert_allclose(conditioned.means_, expected[1], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(conditioned.covariances_, expected[2], rtol=1e-10, atol=1e-12)
    assert conditioned.n_features_in_ == 2


def test_exact_conditioning_is_the_joint_over_the_marginal():
    """With no noise, log p(v_a | v_b) = log p(v_a, v_b) - log p(v_b), from the joint model's own density."""
    rng = np.random.default_rng(8)
    weights, means, covs = rng.dirichlet(np.ones(3)), rng.normal(size=(3, 3)), random_spd(rng, 3, 3)
    model = XDGMM(3, device="cpu")
    model._set_fitted(_mixture(weights, means, covs), [], True, *model._validated())
    v_b = 0.4
    conditioned = model.condition([np.nan, np.nan, v_b])
    v_a = rng.normal(size=(5, 2))
    joint = model.score_samples(np.c_[v_a, np.full(5, v_b)], Xcov=None)
    marginal = np.log(sum(w * multivariate_normal(m[2], V[2, 2]).pdf(v_b) for w, m, V in zip(weights, means, covs)))
    np.testing.assert_allclose(conditioned.score_samples(v_a, Xcov=None), joint - marginal, rtol=1e-5)
    noisy = xd_log_densities(
        v_a, np.zeros((5, 2, 2)), conditioned.weights_, conditioned.means_, conditioned.covariances_
    )
    np.testing.assert_allclose(np.logaddexp.reduce(noisy, axis=1), joint - marginal, rtol=1e-5)


@pytest.mark.parametrize(
    "given, noise, message",
    [
        ([0.1, 0.2, 0.3], None, "at least one feature NaN"),
        ([np.nan] * 3, None, "at least one feature NaN"),
        ([np.nan, 0.2], None, r"X_given must have shape \(3,\)"),
        ([np.nan, np.inf, 0.3], None, "feature 1 is infinite"),
        ([np.nan, 0.2, 1e200], None, "feature 2 is beyond 3.87e\\+153, whose squares overflow float64"),
        ([np.nan, 0.2, 0.3], np.ones(3), r"Xcov_given must be variances \(2,\)"),
        ([np.nan, 0.2, 0.3], -np.ones(2), "positive semi-definite"),
    ],
)
def test_bad_conditioning_input_is_named(given, noise, message):
    model = XDGMM(1, device="cpu")
    model._set_fitted(_mixture(np.ones(1), np.zeros((1, 3)), np.eye(3)[None]), [], True, *model._validated())
    with pytest.raises(ValueError, match=message):
        model.condition(given, noise)


def _mixture(weights, means, covs):
    import torch

    from scalable_xd.mixture import Mixture

    return Mixture(*(torch.tensor(a, dtype=torch.float64) for a in (weights, means, covs)))
