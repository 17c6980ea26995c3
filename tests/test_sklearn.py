"""XDGMM keeps scikit-learn's estimator contract: clone, get/set_params, repr, cross-validated choice of K.

Its ``fit`` takes the noise as its second argument (as astroML's XDGMM does), not a target y, so the
estimator checks that pass y positionally do not apply; those that do are run below.
"""

import numpy as np
import pytest
import sklearn
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, KFold
from sklearn.utils import estimator_checks

from scalable_xd import XDGMM


@pytest.fixture(scope="module")
def blobs():
    """Three well-separated 2-D Gaussians seen through per-point diagonal noise."""
    rng = np.random.default_rng(0)
    centres = np.array([[-6.0, 0.0], [0.0, 6.0], [6.0, 0.0]])
    truth = np.concatenate([c + rng.normal(scale=0.7, size=(120, 2)) for c in centres])
    variances = rng.uniform(0.1, 0.5, size=truth.shape)
    return truth + rng.normal(size=truth.shape) * np.sqrt(variances), variances


def test_clone_keeps_every_parameter_including_initial_arrays():
    model = XDGMM(3, "sgd", lr=0.05, tol=None, means_init=np.arange(6.0).reshape(3, 2), random_state=4)
    copy = clone(model)
    params, copied = model.get_params(), copy.get_params()
    assert params.keys() == copied.keys()
    np.testing.assert_array_equal(copied.pop("means_init"), params.pop("means_init"))
    assert copied == params
    text = " ".join(repr(model).split())  # the non-default parameters, as scikit-learn prints them
    assert text.startswith("XDGMM(lr=0.05, means_init=array([[0., 1.],") and "method='sgd', n_components=3" in text
    assert copy.set_params(n_components=5, w=0.01).get_params()["n_components"] == 5


def test_grid_search_picks_k_by_cross_validated_score_with_the_noise_routed(blobs):
    X, variances = blobs
    base = XDGMM(epochs=40, device="cpu", dtype="float64", random_state=0)
    with sklearn.config_context(enable_metadata_routing=True):
        estimator = base.set_fit_request(Xcov=True).set_score_request(Xcov=True)
        folds = KFold(3, shuffle=True, random_state=1)
        search = GridSearchCV(estimator, {"n_components": [1, 2, 3, 4]}, cv=folds).fit(X, Xcov=variances)
    scores = dict(zip(search.cv_results_["param_n_components"], search.cv_results_["mean_test_score"]))
    assert search.best_params_["n_components"] >= 3 and scores[3] > scores[2] + 0.5 > scores[1] + 1.0
    # the grid's fold score is the held-out mean log-likelihood with the held-out noise, fitted independently
    train, test = next(folds.split(X))
    model = XDGMM(3, epochs=40, device="cpu", dtype="float64", random_state=0).fit(X[train], variances[train])
    k3 = list(search.cv_results_["param_n_components"]).index(3)
    assert search.cv_results_["split0_test_score"][k3] == pytest.approx(model.score(X[test], variances[test]), rel=1e-9)


def test_random_state_accepts_numpy_generators(blobs):
    X, variances = blobs
    fits = {}
    for kind, make in (("RandomState", np.random.RandomState), ("Generator", np.random.default_rng)):
        a = XDGMM(2, "minibatch_em", epochs=2, device="cpu", random_state=make(7)).fit(X, variances)
        b = XDGMM(2, "minibatch_em", epochs=2, device="cpu", random_state=make(7)).fit(X, variances)
        np.testing.assert_array_equal(a.means_, b.means_)  # the same generator state gives the same fit
        fits[kind] = a
    assert not np.array_equal(fits["RandomState"].means_, fits["Generator"].means_)


APPLICABLE = [
    "check_estimator_cloneable",
    "check_estimator_repr",
    "check_no_attributes_set_in_init",
    "check_get_params_invariance",
    "check_set_params",
    "check_parameters_default_constructible",
    "check_do_not_raise_errors_in_init_or_set_params",
    "check_mixin_order",
    "check_estimators_unfitted",
    "check_fit1d",
    "check_requires_y_none",
]


@pytest.mark.parametrize("check", APPLICABLE)
def test_applicable_estimator_checks(check):
    getattr(estimator_checks, check)("XDGMM", XDGMM(2, epochs=2, device="cpu", random_state=0))


def test_warm_start_continues_batch_em_exactly(blobs):
    """Plain EM continues exactly; SQUAREM's warm start begins a new cycle (its extrapolation's history
    does not carry over)."""
    X, variances = blobs
    settings = dict(tol=None, acceleration="none", device="cpu", dtype="float64", random_state=0)
    ten = XDGMM(3, epochs=10, **settings).fit(X, variances)
    warm = XDGMM(3, epochs=5, warm_start=True, **settings).fit(X, variances)
    assert warm.n_iter_ == 5
    warm.fit(X, variances)  # five more epochs from where the first five stopped, no k-means
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(warm, attr), getattr(ten, attr), rtol=1e-12, atol=1e-14)
    assert warm.n_iter_ == 10 and [e["epoch"] for e in warm.history_] == list(range(11))  # counted on
    for e in (5, 10):
        assert warm.history_[e]["train_loglik"] == pytest.approx(ten.history_[e]["train_loglik"], rel=1e-12)
    assert np.all(np.diff([e["seconds"] for e in warm.history_]) >= 0)
    cold = XDGMM(3, epochs=5, **settings).fit(X, variances).fit(X, variances)  # without warm_start: restarts
    np.testing.assert_allclose(cold.means_, XDGMM(3, epochs=5, **settings).fit(X, variances).means_)
    with pytest.raises(ValueError, match="warm_start: the fitted model has K = 3"):
        warm.set_params(n_components=4).fit(X, variances)


def test_n_features_in_is_set_by_fit_and_kept_by_save(blobs, tmp_path):
    X, variances = blobs
    model = XDGMM(2, epochs=2, device="cpu", random_state=0).fit(X, variances)
    assert model.n_features_in_ == 2
    model.save(tmp_path / "model.npz")
    assert XDGMM.load(tmp_path / "model.npz").n_features_in_ == 2


def test_verbose_epochs_go_through_the_named_logger(blobs, caplog):
    import logging

    X, variances = blobs
    with caplog.at_level(logging.INFO, logger="scalable_xd.fit"):
        XDGMM(2, epochs=3, device="cpu", random_state=0, verbose=1).fit(X, variances)
    lines = [r.getMessage() for r in caplog.records if r.name == "scalable_xd.fit"]
    assert len(lines) == 4 and lines[0].startswith("epoch   0/3") and "train" in lines[-1]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="scalable_xd.fit"):
        XDGMM(2, epochs=3, device="cpu", random_state=0).fit(X, variances)  # verbose=0: silent
    assert not [r for r in caplog.records if r.name == "scalable_xd.fit"]
