"""Regularisation and batching must not bias a fit: w shifts a covariance by about w, whatever the method
or step size, and a fit does not depend on N mod batch_size."""

import numpy as np
import pytest

from scalable_xd import XDGMM
from scalable_xd.data.batching import batch_bounds


@pytest.fixture(scope="module")
def narrow_gaussian():
    """One 2-D Gaussian of variance 0.01 and no noise: any excess variance is the regularisation's."""
    rng = np.random.default_rng(40)
    x = rng.normal(scale=0.1, size=(20_000, 2))
    return x, np.zeros((len(x), 2, 2))


def _fitted_covariance(x, S, method, w, step=1e-2, online_regularisation="prior"):
    """The paper's schedule (step or learning rate decayed halfway), with batches of 250 so that a step of
    1e-2 forgets the initial covariance I (weight exp(-12) after 20 epochs)."""
    model = XDGMM(
        1,
        method,
        online_regularisation=online_regularisation,
        w=w,
        w_scale="none",  # the paper's w, in the features' units
        step_size=step,
        step_schedule="step",
        epochs=20,
        decay_epoch=10,
        batch_size=250,
        dtype="float64",
        device="cpu",
        random_state=0,
        means_init=np.zeros((1, 2)),
    )
    return model.fit(x, Xcov=S).covariances_[0]


@pytest.mark.parametrize("method, step", [("em", None), ("sgd", None), ("minibatch_em", 1e-2), ("minibatch_em", 1e-1)])
@pytest.mark.parametrize("w", [1e-3, 1e-2])
def test_regularisation_shifts_a_covariance_by_about_w(narrow_gaussian, method, step, w):
    """The bound: each entry of V(w) - V(0) lies within [-0.1 w, 1.1 w] (diagonal) or +-0.1 w (off it).

    Why: Bovy's EM gives (q V + w)/(q + 1), a shift of (w - V)/(N + 1) ~ 0, and online EM with its default
    prior regularisation the same, (c V + w)/(c + 1) with c = qhat N; SGD's penalty w / tr V is one term
    against the log-likelihood of a 250-star batch, a shift ~ w V^2 / (250 tr V^2) << w. Feeding w back
    into online EM's running state, as once, gave about w / step: 10 to 100 times the bound.
    """
    x, S = narrow_gaussian
    step = step or 1e-2
    shift = _fitted_covariance(x, S, method, w, step) - _fitted_covariance(x, S, method, 0.0, step)
    diagonal, off_diagonal = np.diag(shift), shift[0, 1]
    assert np.all(diagonal <= 1.1 * w) and np.all(diagonal >= -0.1 * w), diagonal
    assert abs(off_diagonal) <= 0.1 * w
    if method == "minibatch_em":  # the prior's shift, as batch EM's: w / (N / 2), not w
        assert np.all(np.abs(diagonal) <= 0.01 * w), diagonal


@pytest.mark.parametrize("step", [1e-2, 1e-1])
def test_the_papers_online_regularisation_shifts_each_variance_by_w(narrow_gaussian, step):
    """online_regularisation="paper": the running state stays free of w and the E-step adds w I, so the
    fitted covariance is the w = 0 scatter plus w I."""
    x, S = narrow_gaussian
    fitted = {w: _fitted_covariance(x, S, "minibatch_em", w, step, "paper") for w in (0.0, 1e-2)}
    np.testing.assert_allclose(np.diag(fitted[1e-2] - fitted[0.0]), 1e-2, rtol=0.05)
    assert abs((fitted[1e-2] - fitted[0.0])[0, 1]) <= 1e-3


@pytest.mark.parametrize("online_regularisation, excess", [("prior", 0.0), ("paper", 1e-3)])
def test_minibatch_em_with_regularisation_recovers_the_true_variance(narrow_gaussian, online_regularisation, excess):
    """The issue's case: at the paper's w = 1e-3 and step 1e-2 the fitted variance was 0.208; truth 0.0100.
    The prior's variance is the data's; the paper's form adds w."""
    x, S = narrow_gaussian
    variances = np.diag(_fitted_covariance(x, S, "minibatch_em", 1e-3, online_regularisation=online_regularisation))
    np.testing.assert_allclose(variances, 0.01 + excess, rtol=0.05)


@pytest.mark.parametrize(
    "n, batch, expected",
    [
        (3000, 500, [500] * 6),
        (3001, 500, [500] * 5 + [501]),
        (3499, 500, [500] * 5 + [999]),
        (300, 500, [300]),
        (500, 500, [500]),
        (1, 500, [1]),
    ],
)
def test_a_remainder_joins_the_last_batch(n, batch, expected):
    bounds = batch_bounds(n, batch)
    assert [stop - start for start, stop in bounds] == expected
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


@pytest.fixture(scope="module")
def two_gaussians_1d():
    """Two 1-D Gaussians with heteroscedastic noise, in the spirit of Bovy et al.'s test_oned."""
    rng = np.random.default_rng(41)
    n = 3001
    first = rng.random(n) < 0.3
    v = np.where(first, rng.normal(-3.0, 1.0, n), rng.normal(3.0, 2.0, n))
    sd = rng.uniform(0.2, 0.6, n)
    x = (v + sd * rng.normal(size=n))[:, None]
    return x, (sd**2)[:, None, None]


def _sorted_fit(model):
    order = np.argsort(model.means_[:, 0])
    return model.weights_[order], model.covariances_[order, 0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["minibatch_em", "sgd"])
def test_fit_does_not_depend_on_n_mod_batch_size(two_gaussians_1d, method):
    """N = 3001 used to end every epoch on a one-star batch with a full step: weights (0.234, 0.766)
    against (0.302, 0.699) at N = 3000. Now both agree with each other and with batch EM."""
    x, S = two_gaussians_1d
    init = dict(means_init=[[-1.0], [1.0]], weights_init=[0.5, 0.5], dtype="float64", device="cpu", random_state=0)
    # Online EM with steps lambda_t tracks batch EM after about sum(lambda_t) iterations (45 here); Adam
    # moves a mean by at most ~lr a step, and these start 2 units away.
    settings = dict(epochs=200, decay_epoch=100, batch_size=500, step_size=0.05, step_schedule="step", lr=0.05)
    fits = [_sorted_fit(XDGMM(2, method, **settings, **init).fit(x[:n], Xcov=S[:n])) for n in (3000, 3001)]
    em = _sorted_fit(XDGMM(2, "em", epochs=500, tol=1e-9, **init).fit(x, Xcov=S))
    for weights, variances in fits:
        np.testing.assert_allclose(weights, em[0], atol=0.03)
        np.testing.assert_allclose(variances, em[1], rtol=0.1)
    np.testing.assert_allclose(fits[0][0], fits[1][0], atol=0.02)
