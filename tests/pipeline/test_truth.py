"""Truth metrics: the true-value log-likelihood against scipy, the references' data, the gap closed, and
every method deconvolving a known mixture better than ignoring the noise (scikit-learn as the references)."""

import math

import numpy as np
import pytest
from helpers import draw_xd_data, xd_loglik
from sklearn.mixture import GaussianMixture

from scalable_xd import XDGMM
from scalable_xd.pipeline.gaia.features import compute_features
from scalable_xd.pipeline.gaia.mock import make_mock
from scalable_xd.pipeline.truth import (
    NO_TRUTH,
    gap_closed,
    reference_data,
    seconds_to_share,
    true_loglik,
    truth_metrics,
)

WEIGHTS = np.array([0.4, 0.6])
MEANS = np.array([[0.0, 0.0], [3.0, 1.0]])
COVS = np.array([[[0.3, 0.1], [0.1, 0.2]], [[0.5, -0.2], [-0.2, 0.4]]])


@pytest.fixture(scope="module")
def noisy_mixture():
    """Noise as large as the intrinsic spread, so that ignoring it costs a lot of log-likelihood."""
    rng = np.random.default_rng(50)
    x, S, v, _ = draw_xd_data(rng, 12_000, WEIGHTS, MEANS, COVS, 0.3, 0.9)
    return x[:10_000], S[:10_000], v[:10_000], v[10_000:]


def test_true_loglik_matches_scipy(noisy_mixture):
    x, S, _, v_test = noisy_mixture
    model = XDGMM(2, "em", epochs=3, device="cpu", dtype="float64", random_state=0).fit(x, Xcov=S)
    expected = xd_loglik(v_test[:300], np.zeros((300, 2, 2)), model.weights_, model.means_, model.covariances_)
    assert true_loglik(model, v_test[:300]) == pytest.approx(expected.mean(), rel=1e-10)


@pytest.mark.parametrize("method", ["em", "minibatch_em"])
def test_eval_sets_follow_the_true_values_epoch_by_epoch(noisy_mixture, method):
    """Each history entry scores its own parameters on the monitored set: the last entry against scipy, and
    entry e against a fit stopped after e epochs (the same trajectory); the training clock is unchanged."""
    x, S, _, v_test = noisy_mixture
    v, zeros = v_test[:300], np.zeros((300, 2, 2))
    kw = dict(device="cpu", dtype="float64", random_state=0, tol=None, decay_epoch=1)  # the same steps for both
    model = XDGMM(2, method, epochs=3, **kw).fit(x, Xcov=S, eval_sets={"true": (v, zeros)})
    assert [set(entry) >= {"true_loglik"} for entry in model.history_] == [True] * 4
    expected = xd_loglik(v, zeros, model.weights_, model.means_, model.covariances_).mean()
    assert model.history_[-1]["true_loglik"] == pytest.approx(expected, rel=1e-10)
    shorter = XDGMM(2, method, epochs=2, **kw).fit(x, Xcov=S)
    expected = xd_loglik(v, zeros, shorter.weights_, shorter.means_, shorter.covariances_).mean()
    assert model.history_[2]["true_loglik"] == pytest.approx(expected, rel=1e-10)


def test_eval_sets_are_checked_by_name(noisy_mixture):
    x, S, _, v_test = noisy_mixture
    model = XDGMM(2, "em", epochs=1, device="cpu", random_state=0)
    with pytest.raises(ValueError, match="'val' is not a usable name"):
        model.fit(x, Xcov=S, eval_sets={"val": (v_test, None)})
    with pytest.raises(ValueError, match=r"eval_sets\['truth'\] must have the same dimensions"):
        model.fit(x, Xcov=S, eval_sets={"truth": (v_test[:, :1], None)})
    bad = v_test.copy()
    bad[7, 1] = np.nan
    with pytest.raises(ValueError, match=r"eval_sets\['truth'\] row 7"):
        model.fit(x, Xcov=S, eval_sets={"truth": (bad, None)})


def test_seconds_to_share_is_the_first_entry_at_each_mark():
    history = [{"seconds": float(t), "true_loglik": ll} for t, ll in enumerate([-3.0, -2.0, -1.22, -1.1, -1.25])]
    # noisy -3, achievable -1: shares 0, 0.5, 0.89, 0.95, 0.875
    assert seconds_to_share(history, noisy=-3.0, achievable=-1.0) == {"0.9": 3.0, "0.95": 3.0}
    assert seconds_to_share(history[:3], noisy=-3.0, achievable=-1.0) == {"0.9": None, "0.95": None}


def test_gap_closed():
    assert gap_closed(-2.0, noisy=-3.0, oracle=-1.0) == pytest.approx(0.5)
    assert gap_closed(-4.0, noisy=-3.0, oracle=-1.0) == pytest.approx(-0.5)
    assert math.isnan(gap_closed(-1.0, noisy=-1.0, oracle=-1.0))  # no gap: nothing to close


class _Split:
    """A features split as truth_metrics reads it: its true values and its length."""

    def __init__(self, true):
        self.true = true

    def __len__(self):
        return len(self.true)


def test_the_share_of_the_achievable_measures_from_the_noisy_reference_to_converged_xd(noisy_mixture):
    x, S, v, v_test = noisy_mixture

    test = _Split(v_test)
    model = XDGMM(2, "em", epochs=2, device="cpu", dtype="float64", random_state=0).fit(x, Xcov=S)
    scores = {"oracle": -1.0, "noisy": -3.0, "achievable": -1.5}
    out = truth_metrics(model, test, {kind: {"test_true_loglik": value} for kind, value in scores.items()})
    mine = true_loglik(model, v_test)
    assert out["true_gap_closed"] == pytest.approx((mine + 3.0) / 2.0)
    assert out["true_share_of_achievable"] == pytest.approx((mine + 3.0) / 1.5)
    without = truth_metrics(model, test, {kind: {"test_true_loglik": scores[kind]} for kind in ("oracle", "noisy")})
    assert "true_share_of_achievable" not in without and "true_gap_closed" in without


@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_every_method_closes_most_of_the_gap(noisy_mixture, method):
    """References fitted by scikit-learn (independent of this package): a GMM of the true values and one of
    the noisy values. Each method at its defaults (the paper's settings) must close >= 80% of the gap."""
    x, S, v, v_test = noisy_mixture
    oracle = GaussianMixture(2, covariance_type="full", random_state=0).fit(v).score(v_test)
    noisy = GaussianMixture(2, covariance_type="full", random_state=0).fit(x).score(v_test)
    model = XDGMM(2, method, device="cpu", random_state=0).fit(x, Xcov=S)
    assert oracle - noisy > 0.2  # the noise matters here
    assert gap_closed(true_loglik(model, v_test), noisy, oracle) >= 0.8


@pytest.fixture(scope="module")
def mock():
    return make_mock(3000, seed=5)


def test_reference_data_keep_missingness_but_drop_noise(mock):
    features = compute_features(mock)
    X, variances = reference_data(features, "noisy")
    missing = features.sigma >= 1e6
    np.testing.assert_array_equal(X, features.X)
    assert (variances[missing] == 1e12).all() and (variances[~missing] == 0).all()
    true, zeros = reference_data(features, "oracle")
    np.testing.assert_array_equal(true, mock[[c for c in mock if c.startswith("true_")]].to_numpy())
    assert (zeros == 0).all()
    X, noise = reference_data(features, "achievable")  # XD itself: the noise model as the fits see it
    np.testing.assert_array_equal(X, features.X)
    np.testing.assert_array_equal(noise.sigma.numpy(), features.sigma)
    np.testing.assert_array_equal(noise.corr.numpy(), features.corr)


def test_real_data_say_there_is_no_truth(mock):
    real_like = compute_features(mock.drop(columns=[c for c in mock if c.startswith("true_")]))
    with pytest.raises(ValueError, match="training split has no true_<feature> columns"):
        reference_data(real_like, "oracle")
    assert truth_metrics(None, real_like, None) == {"available": False, "reason": NO_TRUTH}
