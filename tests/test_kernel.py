"""The statistics pass against scipy densities and the paper's eq. 4-5 written out pair by pair."""

import numpy as np
import pytest
import torch
from helpers import random_spd, xd_log_densities, xd_pair_posteriors

from scalable_xd.errors import NotPositiveDefiniteError
from scalable_xd.kernel import batch_statistics, log_densities
from scalable_xd.mixture import Mixture


def _problem(rng, n=40, k=5, d=3, d_obs=None):
    weights = rng.dirichlet(np.ones(k))
    means = rng.normal(scale=3, size=(k, d))
    covs = random_spd(rng, k, d)
    d_obs = d if d_obs is None else d_obs
    S = random_spd(rng, n, d_obs, scale=0.5)
    x = rng.normal(scale=3, size=(n, d_obs))
    return x, S, weights, means, covs


def _mixture(weights, means, covs):
    return Mixture(*(torch.tensor(a) for a in (weights, means, covs)))


def test_log_densities_match_scipy():
    rng = np.random.default_rng(1)
    x, S, weights, means, covs = _problem(rng)
    loglik, log_dens = log_densities(torch.tensor(x), torch.tensor(S), _mixture(weights, means, covs))
    expected = xd_log_densities(x, S, weights, means, covs)
    np.testing.assert_allclose(log_dens.numpy(), expected, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(loglik.numpy(), np.logaddexp.reduce(expected, axis=1), rtol=1e-12)


@pytest.mark.parametrize("projected", [False, True])
def test_statistics_reproduce_eq5_sums(projected):
    """sum r b = q m + V U and sum r [(b - m)(b - m)^T + B] = q V + V (UU - P) V, per component."""
    rng = np.random.default_rng(2)
    d = 3
    x, S, weights, means, covs = _problem(rng, d=d, d_obs=2 if projected else None)
    R = rng.normal(size=(x.shape[0], 2, d)) if projected else None
    stats = batch_statistics(
        torch.tensor(x), torch.tensor(S), _mixture(weights, means, covs), None if R is None else torch.tensor(R),
        max_pairs=37,  # force several chunks
    )
    r, b, B = xd_pair_posteriors(x, S, weights, means, covs, R)
    q = r.sum(0)
    np.testing.assert_allclose(stats.q.numpy(), q, rtol=1e-10)
    sum_rb = np.einsum("nk,nkd->kd", r, b)
    np.testing.assert_allclose(q[:, None] * means + np.einsum("kde,ke->kd", covs, stats.U.numpy()), sum_rb, rtol=1e-9)
    centred = b - means[None]
    scatter = np.einsum("nk,nkd,nke->kde", r, centred, centred) + np.einsum("nk,nkde->kde", r, B)
    from_stats = q[:, None, None] * covs + covs @ (stats.UU.numpy() - stats.P.numpy()) @ covs
    np.testing.assert_allclose(from_stats, scatter, rtol=1e-8, atol=1e-10)


def test_failed_factorisation_names_row_and_component():
    rng = np.random.default_rng(3)
    x, S, weights, means, covs = _problem(rng, n=10, k=3, d=2)
    S[:] = 0.0
    covs[2] = np.array([[1.0, 2.0], [2.0, 1.0]])  # indefinite
    with pytest.raises(NotPositiveDefiniteError) as err:
        log_densities(torch.tensor(x), torch.tensor(S), _mixture(weights, means, covs))
    assert (err.value.row, err.value.component) == (0, 2)
