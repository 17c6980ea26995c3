"""Each method recovers the intrinsic (deconvolved) density where a plain GMM inflates it; missing data."""

import math

import numpy as np
import pytest
from helpers import draw_xd_data
from scipy.special import logsumexp
from scipy.stats import multivariate_normal
from sklearn.mixture import GaussianMixture

from scalable_xd import XDGMM

TRUE_WEIGHTS = np.array([0.5, 0.3, 0.2])
TRUE_MEANS = np.array([[0.0, 0.0], [8.0, 3.0], [-6.0, 6.0]])
TRUE_COVS = np.array([[[1.0, 0.4], [0.4, 0.6]], [[0.4, 0.0], [0.0, 1.5]], [[0.8, -0.3], [-0.3, 0.5]]])


@pytest.fixture(scope="module")
def noisy_mixture():
    """20,000 points whose noise (sd 0.8-2.0, correlated) is larger than the intrinsic spread."""
    rng = np.random.default_rng(30)
    x, S, _, _ = draw_xd_data(rng, 20_000, TRUE_WEIGHTS, TRUE_MEANS, TRUE_COVS, 0.8, 2.0)
    return x, S


def _matched(weights, means, covs):
    order = [int(np.argmin(np.linalg.norm(means - mu, axis=1))) for mu in TRUE_MEANS]
    assert sorted(order) == [0, 1, 2]
    return weights[order], means[order], covs[order]


@pytest.mark.parametrize(
    "method, settings",
    [
        ("em", dict(epochs=200, tol=1e-7)),
        ("minibatch_em", dict(epochs=20, step_size=0.2, batch_size=1000)),
        ("sgd", dict(epochs=20, lr=0.02)),
    ],
)
def test_each_method_recovers_intrinsic_covariances(noisy_mixture, method, settings):
    x, S = noisy_mixture
    model = XDGMM(3, method, dtype="float32", device="cpu", random_state=0, **settings).fit(x, Xcov=S)
    weights, means, covs = _matched(model.weights_, model.means_, model.covariances_)
    # Tolerances: ~3x the sampling error of 20,000 points with noise variances up to 4.
    np.testing.assert_allclose(covs, TRUE_COVS, atol=0.2)
    np.testing.assert_allclose(means, TRUE_MEANS, atol=0.1)
    np.testing.assert_allclose(weights, TRUE_WEIGHTS, atol=0.02)


def test_plain_gmm_on_noisy_data_inflates_covariances(noisy_mixture):
    x, _ = noisy_mixture
    sk = GaussianMixture(3, random_state=0).fit(x)
    _, _, covs = _matched(sk.weights_, sk.means_, sk.covariances_)
    assert np.all(np.trace(covs, axis1=1, axis2=2) > 2.5 * np.trace(TRUE_COVS, axis1=1, axis2=2))


def test_missing_entries_the_paper_way():
    """x = 0 with variance 1e12 for a missing entry: finite float32 fits, and a log-likelihood equal to the
    exact marginal (that dimension dropped) plus the per-entry constant -log(2 pi 1e12) / 2."""
    rng = np.random.default_rng(31)
    means3 = np.array([[0.0, 0.0, 5.0], [6.0, 2.0, -3.0]])
    covs3 = np.array([np.diag([1.0, 0.5, 2.0]), [[0.6, 0.2, 0.1], [0.2, 1.0, 0.0], [0.1, 0.0, 0.8]]])
    x, S, _, _ = draw_xd_data(rng, 4000, np.array([0.6, 0.4]), means3, covs3, 0.2, 0.5)
    missing = rng.random(len(x)) < 0.3
    x[missing, 2] = 0.0
    S[missing, 2, :] = 0.0
    S[missing, :, 2] = 0.0
    S[missing, 2, 2] = 1e12
    for method in ("em", "minibatch_em", "sgd"):
        model = XDGMM(2, method, dtype="float32", device="cpu", epochs=5, random_state=0).fit(x, Xcov=S)
        for array in (model.weights_, model.means_, model.covariances_):
            assert np.isfinite(array).all(), method
        assert np.isfinite([h["train_loglik"] for h in model.history_]).all()

    scored = model.score_samples(x[missing], Xcov=S[missing])
    w, m, V = (a.astype(np.float64) for a in (model.weights_, model.means_, model.covariances_))
    observed = list(zip(x[missing], S[missing]))
    exact = logsumexp(
        [
            np.log(w[j])
            + np.array([multivariate_normal(m[j, :2], V[j, :2, :2] + s[:2, :2]).logpdf(xi[:2]) for xi, s in observed])
            for j in range(2)
        ],
        axis=0,
    )
    np.testing.assert_allclose(scored - exact, -0.5 * math.log(2 * math.pi * 1e12), atol=2e-3)
