"""What Bovy's XD does beyond a plain fit: fixed parameters and per-star weights, each checked against an
independent computation (numpy, by hand) rather than against the code's own output (conditioning:
test_conditioning.py)."""

import numpy as np
import pytest
from helpers import draw_xd_data, random_spd, xd_pair_posteriors

from scalable_xd import XDGMM

K, D = 3, 3
METHODS = ["em", "minibatch_em", "sgd", "stochastic_em", "stochastic_minibatch_em"]


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(13)
    weights, means, covs = np.array([0.5, 0.3, 0.2]), rng.normal(scale=4, size=(K, D)), random_spd(rng, K, D)
    x, S, _, _ = draw_xd_data(rng, 600, weights, means, covs, 0.1, 0.6)
    init = dict(weights_init=np.array([0.4, 0.35, 0.25]), means_init=means + 0.5, covariances_init=covs * 1.3)
    return x, S, init


def _fit(x, S, init, **settings):
    base = dict(n_components=K, epochs=3, batch_size=100, tol=None, dtype="float64", device="cpu", random_state=0)
    return XDGMM(**{**base, **init, **settings}).fit(x, Xcov=S)


@pytest.mark.parametrize("method", METHODS)
def test_fixed_parameters_stay_exactly_fixed(problem, method):
    x, S, init = problem
    mask = np.array([True, False, True])
    model = _fit(
        x, S, init, method=method, fix_weights=mask, fix_means=mask, fix_covariances=np.array([False, True, False])
    )
    np.testing.assert_array_equal(model.weights_[mask], init["weights_init"][mask])
    np.testing.assert_array_equal(model.means_[mask], init["means_init"][mask])
    np.testing.assert_array_equal(model.covariances_[1], init["covariances_init"][1])
    assert abs(model.weights_.sum() - 1.0) < 1e-12
    assert not np.allclose(model.means_[1], init["means_init"][1])  # the free ones moved
    assert not np.allclose(model.covariances_[0], init["covariances_init"][0])
    everything = _fit(x, S, init, method=method, fix_weights=True, fix_means=True, fix_covariances=True)
    for attr, name in (("weights_", "weights_init"), ("means_", "means_init"), ("covariances_", "covariances_init")):
        np.testing.assert_array_equal(getattr(everything, attr), init[name])


def test_em_step_with_fixed_parameters_matches_bovys_update_by_hand(problem):
    """One iteration against eq. 4-5 written out: free weights share 1 - the fixed ones (Bovy's ampnorm), a
    fixed mean's covariance is the scatter about that mean, with Bovy's regularisation (sum + w I)/(q + 1)."""
    x, S, init = problem
    w = 0.05
    fix_weights, fix_means = np.array([False, True, False]), np.array([True, False, False])
    model = _fit(x, S, init, method="em", epochs=1, w=w, w_scale="none", fix_weights=fix_weights, fix_means=fix_means)
    weights, means, covs = init["weights_init"], init["means_init"], init["covariances_init"]
    r, b, B = xd_pair_posteriors(x, S, weights, means, covs)
    q = r.sum(0)
    expected_weights = q / q[~fix_weights].sum() * (1 - weights[fix_weights].sum())
    expected_weights[fix_weights] = weights[fix_weights]
    expected_means = np.where(fix_means[:, None], means, np.einsum("nk,nkd->kd", r, b) / q[:, None])
    centred = b - expected_means[None]
    scatter = np.einsum("nk,nkd,nke->kde", r, centred, centred) + np.einsum("nk,nkde->kde", r, B)
    expected_covs = (scatter + w * np.eye(D)) / (q[:, None, None] + 1.0)
    np.testing.assert_allclose(model.weights_, expected_weights, rtol=1e-12)
    np.testing.assert_allclose(model.means_, expected_means, rtol=1e-11)
    np.testing.assert_allclose(model.covariances_, expected_covs, rtol=1e-10)


@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_a_weighted_fit_equals_the_fit_of_repeated_rows(problem, method):
    """Integer weights: the fit is that of the data with each row repeated (weight 0: the row left out). One
    batch per epoch, so that minibatch methods see the same sums in both."""
    x, S, init = problem
    counts = np.random.default_rng(3).integers(0, 4, size=len(x))
    repeated = np.repeat(np.arange(len(x)), counts)
    settings = dict(method=method, epochs=4, batch_size=4 * len(x), step_size=0.5, lr=0.05)
    weighted = XDGMM(n_components=K, tol=None, dtype="float64", device="cpu", random_state=0, **init, **settings)
    weighted.fit(x, Xcov=S, sample_weight=counts.astype(float))
    plain = _fit(x[repeated], S[repeated], init, **settings)
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(weighted, attr), getattr(plain, attr), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(weighted.history_[-1]["train_loglik"], plain.history_[-1]["train_loglik"], rtol=1e-12)
    np.testing.assert_allclose(
        weighted.score(x, Xcov=S, sample_weight=counts), plain.score(x[repeated], Xcov=S[repeated]), rtol=1e-12
    )


@pytest.mark.parametrize(
    "weights, message",
    [
        (np.r_[np.ones(599), -1.0], "sample_weight row 599 is negative"),
        (np.r_[np.ones(10), np.nan, np.ones(589)], "sample_weight row 10 is NaN or inf"),
        (np.ones(5), r"sample_weight must have shape \(600,\)"),
        (np.zeros(600), "zero for every row"),
    ],
)
def test_bad_sample_weights_are_named(problem, weights, message):
    x, S, init = problem
    with pytest.raises(ValueError, match=message):
        XDGMM(K, device="cpu", **init).fit(x, Xcov=S, sample_weight=weights)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(fix_means=np.array([True, False])), "fix_means must be True, False or a boolean array of length"),
        (dict(fix_covariances="yes"), "fix_covariances must be True, False or a boolean array"),
        (dict(method="minibatch_em", covariance_update="naive", fix_means=True), "covariance_update='stable'"),
        (dict(method="em", averaging="polyak"), "averaging='polyak' averages minibatch updates"),
        (dict(method="sgd", truncation=True), "truncation applies to minibatch_em"),
        (dict(method="minibatch_em", truncation_bound=0.5), r"truncation_bound must be in \(1"),
    ],
)
def test_bad_settings_are_named(problem, settings, message):
    x, S, init = problem
    with pytest.raises(ValueError, match=message):
        XDGMM(K, device="cpu", **{**init, **settings}).fit(x, Xcov=S)
