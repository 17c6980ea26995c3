"""Each star's posterior true values: the quantiles of each feature's marginal posterior, a mixture of
Gaussians, against scipy's root of that mixture's CDF written out from the paper's eq. 4, and against
Monte Carlo draws; and the calibration they promise on data drawn from the model."""

import numpy as np
import pytest
import torch
from helpers import draw_xd_data, random_spd, xd_pair_posteriors
from scipy.optimize import brentq
from scipy.stats import norm

from scalable_xd import XDGMM
from scalable_xd.mixture import Mixture
from scalable_xd.posterior import posterior_summary

PROBS = (0.025, 0.16, 0.5, 0.84, 0.975)


def _problem(seed=20, n=40, k=3, d=3):
    rng = np.random.default_rng(seed)
    weights, means, covs = rng.dirichlet(np.ones(k) * 3), rng.normal(scale=2, size=(k, d)), random_spd(rng, k, d)
    x, S, v, _ = draw_xd_data(rng, n, weights, means, covs, 0.3, 1.5)  # noise as wide as the components
    return x, S, v, weights, means, covs


def _cdf_minus(t, weights, means, sds, p):
    return np.sum(weights * norm.cdf(t, means, sds)) - p


def test_quantiles_are_the_roots_of_each_marginal_posterior_cdf():
    x, S, _, weights, means, covs = _problem()
    mixture = Mixture(*(torch.tensor(a) for a in (weights, means, covs)))
    mean, cov, quantiles = posterior_summary(torch.tensor(x), torch.tensor(S), mixture, quantiles=PROBS)
    r, b, B = xd_pair_posteriors(x, S, weights, means, covs)
    for i in range(len(x)):
        for d in range(x.shape[1]):
            args = (r[i], b[i, :, d], np.sqrt(B[i, :, d, d]))
            want = [brentq(_cdf_minus, -100, 100, args=(*args, p), xtol=1e-13) for p in PROBS]
            np.testing.assert_allclose(quantiles[i, d].numpy(), want, rtol=0, atol=1e-9)
        np.testing.assert_allclose(mean[i].numpy(), r[i] @ b[i], rtol=1e-10)


def test_far_tail_quantiles_are_met_to_1e_300():
    """The CDF in float64 underflows beyond ~8 sigma (ndtr(-8.4) loses its digits): the quantiles there come
    from the log-CDF and the log survival function, checked against scipy's inverse of the normal CDF for
    one component and against roots of scipy's log-CDF for a mixture of two."""
    from scalable_xd.posterior import marginal_quantiles

    probs = torch.tensor([1e-300, 1e-100, 1e-30, 1e-20, 1e-9, 0.5, 1 - 1e-9, 1 - 1e-15], dtype=torch.float64)
    one = marginal_quantiles(torch.ones(1, 1), torch.full((1, 1, 1), 2.0), torch.full((1, 1, 1), 3.0), probs)
    want = 2.0 + 3.0 * norm.ppf(probs.numpy())
    np.testing.assert_allclose(one[0, 0].numpy(), want, rtol=1e-9)  # -11.46 sd at 1e-30 (was -8.37)
    weights, means, sds = np.array([0.3, 0.7]), np.array([-1.0, 4.0]), np.array([0.5, 2.0])
    two = marginal_quantiles(
        torch.tensor(weights)[None], torch.tensor(means)[None, :, None], torch.tensor(sds)[None, :, None], probs[:5]
    )

    def log_cdf_minus(t, p):
        return np.logaddexp.reduce(np.log(weights) + norm.logcdf(t, means, sds)) - np.log(p)

    for p, got in zip(probs[:5].numpy(), two[0, 0].numpy()):
        assert got == pytest.approx(brentq(log_cdf_minus, -200, 100, args=(p,), xtol=1e-12), rel=1e-9), p


def test_quantiles_match_monte_carlo_draws_of_the_posterior():
    x, S, _, _, _, _ = _problem(seed=21, n=300)
    model = XDGMM(3, epochs=3, dtype="float64", random_state=0).fit(x, Xcov=S)
    x, S = x[:3], S[:3]
    _, _, quantiles = model.posterior(x, Xcov=S, q=PROBS)
    r, b, B = xd_pair_posteriors(x, S, model.weights_, model.means_, model.covariances_)
    rng = np.random.default_rng(22)
    for i in range(len(x)):
        component = rng.choice(3, size=400_000, p=r[i])
        draws = b[i, component] + np.einsum(
            "nde,ne->nd", np.linalg.cholesky(B[i])[component], rng.normal(size=(400_000, 3))
        )
        np.testing.assert_allclose(quantiles[i], np.quantile(draws, PROBS, axis=0).T, atol=0.02)


def test_posterior_intervals_are_calibrated_on_data_drawn_from_the_model():
    """Where the model is the truth, 68% of the true values lie in their 16-84% interval and 95% in the
    2.5-97.5% one (to three binomial standard errors over 6,000 star-features)."""
    rng = np.random.default_rng(23)
    weights, means, covs = np.array([0.5, 0.3, 0.2]), rng.normal(scale=2, size=(3, 2)), random_spd(rng, 3, 2)
    x, S, v, _ = draw_xd_data(rng, 3000, weights, means, covs, 0.3, 1.5)
    mixture = Mixture(*(torch.tensor(a) for a in (weights, means, covs)))
    _, _, q = posterior_summary(torch.tensor(x), torch.tensor(S), mixture, quantiles=PROBS)
    q = q.numpy()
    for (lo, hi), level in (((1, 3), 0.68), ((0, 4), 0.95)):
        inside = np.mean((v >= q[..., lo]) & (v <= q[..., hi]))
        assert inside == pytest.approx(level, abs=3 * np.sqrt(level * (1 - level) / v.size)), level


def test_quantile_probabilities_outside_zero_one_are_refused():
    x, S, _, weights, means, covs = _problem(n=5)
    model = XDGMM(3, random_state=0, epochs=2).fit(x, Xcov=S)
    with pytest.raises(ValueError, match="q must be probabilities"):
        model.posterior(x, Xcov=S, q=(0.5, 1.0))
