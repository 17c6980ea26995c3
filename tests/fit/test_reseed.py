"""Dead components re-seeded (``fit.families.reseed``): the split keeps the donor's weight, mean and covariance (the
two halves' mixture has its first two moments), minibatch EM re-seeds a component that dies and counts it,
and a fit that ends with a dead component says so."""

import warnings

import numpy as np
import pytest
import torch

from scalable_xd import XDGMM
from scalable_xd.fit.families.reseed import dead_components, reseeded
from scalable_xd.mixture import Mixture

RNG = np.random.default_rng(2)


def test_the_two_halves_keep_the_donors_weight_and_first_two_moments():
    A = RNG.normal(size=(3, 3, 3))
    cov = torch.tensor(A @ A.transpose(0, 2, 1) + np.eye(3))
    mixture = Mixture(torch.tensor([1e-120, 0.7, 0.3]), torch.tensor(RNG.normal(size=(3, 3))), cov)
    dead = dead_components(mixture.weights, 1e-4)
    assert dead.tolist() == [0]
    new = reseeded(mixture, dead)
    w, m, C = (t.numpy() for t in (new.weights, new.means, new.covariances))
    assert w[0] == w[1] == pytest.approx(0.35) and w[2] == pytest.approx(0.3) and w.sum() == pytest.approx(1.0)
    mean = (w[0] * m[0] + w[1] * m[1]) / (w[0] + w[1])
    second = sum(w[j] * (C[j] + np.outer(m[j] - mean, m[j] - mean)) for j in (0, 1)) / (w[0] + w[1])
    np.testing.assert_allclose(mean, mixture.means[1].numpy(), atol=1e-12)  # the donor's moments, kept
    np.testing.assert_allclose(second, mixture.covariances[1].numpy(), atol=1e-12)
    assert (np.linalg.eigvalsh(C[:2]) > 0).all()


def test_held_components_neither_die_nor_give():
    mixture = Mixture(torch.tensor([1e-9, 0.9, 0.1 - 1e-9]), torch.zeros(3, 2), torch.eye(2).expand(3, 2, 2).clone())
    held = torch.tensor([False, True, False])
    assert dead_components(mixture.weights, 1e-3, held=torch.tensor([True, False, False])).tolist() == []
    new = reseeded(mixture, dead_components(mixture.weights, 1e-3, held), held)
    assert float(new.weights[1]) == pytest.approx(0.9) and float(new.weights[0]) == float(new.weights[2])


def _stranded():
    """Two clusters, and a third component started far from every star: its weight dies in minibatch EM."""
    X = np.concatenate([RNG.normal(size=(1500, 2)), RNG.normal(size=(1500, 2)) + [8, 0]])
    means = np.array([[0.0, 0.0], [8.0, 0.0], [200.0, 200.0]])
    return X, np.full(X.shape, 0.05), means


def test_minibatch_em_reseeds_a_component_that_dies_and_counts_it():
    X, variances, means = _stranded()
    settings = dict(epochs=6, batch_size=200, step_size=0.3, tol=None, random_state=0, means_init=means)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no dead component at the end: no warning
        model = XDGMM(3, "minibatch_em", **settings).fit(X, Xcov=variances)  # the default: re-seeded
    assert (model.weights_ * len(X) >= 1).all()
    assert model.history_[-1]["reseeded"] >= 1 and model.history_[0]["reseeded"] == 0
    with pytest.warns(UserWarning, match=r"1 of 3 components ended with less than one star's worth of weight"):
        paper = XDGMM(3, "minibatch_em", reseed_dead=False, **settings).fit(X, Xcov=variances)  # the paper's
    assert (paper.weights_ * len(X) < 1).sum() == 1 and "reseeded" not in paper.history_[-1]
