"""XDGMM keeps scikit-learn's estimator contract, as scikit-learn's own checks decide it
(``parametrize_with_checks``), and works in its tools: clone, get/set_params, repr, grid search and cross
validation with the noise routed as metadata, pipelines.

Its ``fit(X, y=None, *, Xcov=None, ...)`` ignores y, as every unsupervised estimator does; the noise goes
by name.
"""

import numpy as np
import pytest
import sklearn
from scipy import sparse
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, KFold, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.estimator_checks import parametrize_with_checks

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
    model = XDGMM(3, epochs=40, device="cpu", dtype="float64", random_state=0).fit(X[train], Xcov=variances[train])
    k3 = list(search.cv_results_["param_n_components"]).index(3)
    assert search.cv_results_["split0_test_score"][k3] == pytest.approx(
        model.score(X[test], Xcov=variances[test]), rel=1e-9
    )


def test_random_state_accepts_numpy_generators(blobs):
    X, variances = blobs
    fits = {}
    for kind, make in (("RandomState", np.random.RandomState), ("Generator", np.random.default_rng)):
        a = XDGMM(2, "minibatch_em", epochs=2, device="cpu", random_state=make(7)).fit(X, Xcov=variances)
        b = XDGMM(2, "minibatch_em", epochs=2, device="cpu", random_state=make(7)).fit(X, Xcov=variances)
        np.testing.assert_array_equal(a.means_, b.means_)  # the same generator state gives the same fit
        fits[kind] = a
    assert not np.array_equal(fits["RandomState"].means_, fits["Generator"].means_)


# The checks of scikit-learn's suite that cannot hold for XD, each with its reason.
EXPECTED_FAILURES = {
    "check_sample_weight_equivalence_on_dense_data": (
        "a seeded k-means start draws rows, so weighted and repeated rows start from different means "
        "(scikit-learn's KMeans and MiniBatchKMeans list this check as expected to fail for the same reason)"
    ),
}


@parametrize_with_checks([XDGMM(n_components=2, random_state=0)], expected_failed_checks=lambda _: EXPECTED_FAILURES)
def test_scikit_learn_estimator_checks(estimator, check):
    check(estimator)


@pytest.mark.parametrize("method", ["fit", "partial_fit", "score", "score_samples", "predict", "posterior", "bic"])
def test_noise_given_where_y_goes_is_refused_not_ignored(blobs, method):
    """astroML's and Holoien's XDGMM take the noise second: ``fit(X, Xerr)`` must not fit noiseless data."""
    X, variances = blobs
    model = XDGMM(2, "minibatch_em", epochs=2, device="cpu", random_state=0).fit(X, Xcov=variances)
    call = getattr(model if method != "fit" else XDGMM(2, "minibatch_em", epochs=2), method)
    for noise in (variances, variances[:, :, None] * np.eye(2)):
        with pytest.raises(
            ValueError, match=rf"the second argument is y, .* pass the noise by name, {method}\(X, Xcov="
        ):
            call(X, noise)
    np.testing.assert_array_equal(
        model.score_samples(X, np.zeros(len(X)), Xcov=variances), model.score_samples(X, Xcov=variances)
    )


def test_input_is_checked_in_scikit_learns_words(blobs):
    X, variances = blobs
    model = XDGMM(2, epochs=2, device="cpu", random_state=0).fit(X, Xcov=variances)
    with pytest.raises(ValueError, match="X has 3 features, but XDGMM is expecting 2 features as input"):
        model.predict(np.c_[X, X[:, :1]])
    with pytest.raises(ValueError, match="Reshape your data"):
        model.predict(X[:, 0])
    with pytest.raises(ValueError, match=r"Found array with 0 sample\(s\)"):
        XDGMM(2).fit(X[:0])
    with pytest.raises(ValueError, match="Complex data not supported"):
        XDGMM(2).fit(X + 1j)
    with pytest.raises(TypeError, match="Sparse data was passed for X, but dense data is required"):
        XDGMM(2).fit(sparse.csr_matrix(X))
    with pytest.raises(ValueError, match="X row 4, column 1 contains NaN or inf"):  # our own checks still name the row
        bad = X.copy()
        bad[4, 1] = np.inf
        XDGMM(2).fit(bad, Xcov=variances)
    with pytest.raises(ValueError, match=r"sample_weight must have shape \(360,\), one weight per row of X"):
        XDGMM(2).fit(X, Xcov=variances, sample_weight=[1.0, 2.0, 3.0])


def test_feature_names_come_from_a_dataframe(blobs):
    pd = pytest.importorskip("pandas")
    X, variances = blobs
    frame = pd.DataFrame(X, columns=["colour", "magnitude"])
    model = XDGMM(2, epochs=2, device="cpu", random_state=0).fit(frame, Xcov=variances)
    np.testing.assert_array_equal(model.feature_names_in_, ["colour", "magnitude"])
    np.testing.assert_array_equal(model.score_samples(frame, Xcov=variances), model.score_samples(X, Xcov=variances))
    with pytest.raises(ValueError, match="feature names"):
        model.score(frame[["magnitude", "colour"]], Xcov=variances)
    assert not hasattr(model.fit(X, Xcov=variances), "feature_names_in_")  # refitted on an array: no names


def test_cross_val_score_and_a_scaling_pipeline_route_the_noise(blobs):
    """Noise travels as metadata; a transformer before XDGMM changes X but not the noise, so the noise is
    given in the units of what reaches XDGMM (here scaled by the scaler's fitted scale)."""
    X, variances = blobs
    settings = dict(epochs=20, device="cpu", dtype="float64", random_state=0)
    with sklearn.config_context(enable_metadata_routing=True):
        routed = XDGMM(3, **settings).set_fit_request(Xcov=True).set_score_request(Xcov=True)
        folds = KFold(3, shuffle=True, random_state=1)
        scores = cross_val_score(routed, X, params={"Xcov": variances}, cv=folds)
        scaler = StandardScaler().fit(X)
        scaled_noise = variances / scaler.scale_**2
        pipe = make_pipeline(StandardScaler(), routed).fit(X, Xcov=scaled_noise)
        piped = pipe.score(X, Xcov=scaled_noise)
    for score, (train, test) in zip(scores, folds.split(X)):
        alone = XDGMM(3, **settings).fit(X[train], Xcov=variances[train])
        assert score == pytest.approx(alone.score(X[test], Xcov=variances[test]), rel=1e-9)
    direct = XDGMM(3, **settings).fit(scaler.transform(X), Xcov=scaled_noise)
    assert piped == pytest.approx(direct.score(scaler.transform(X), Xcov=scaled_noise), rel=1e-9)


def test_warm_start_continues_batch_em_exactly(blobs):
    """Plain EM continues exactly; SQUAREM's warm start begins a new cycle (its extrapolation's history
    does not carry over)."""
    X, variances = blobs
    settings = dict(tol=None, acceleration="none", device="cpu", dtype="float64", random_state=0)
    ten = XDGMM(3, epochs=10, **settings).fit(X, Xcov=variances)
    warm = XDGMM(3, epochs=5, warm_start=True, **settings).fit(X, Xcov=variances)
    assert warm.n_iter_ == 5
    warm.fit(X, Xcov=variances)  # five more epochs from where the first five stopped, no k-means
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(warm, attr), getattr(ten, attr), rtol=1e-12, atol=1e-14)
    assert warm.n_iter_ == 10 and [e["epoch"] for e in warm.history_] == list(range(11))  # counted on
    for e in (5, 10):
        assert warm.history_[e]["train_loglik"] == pytest.approx(ten.history_[e]["train_loglik"], rel=1e-12)
    assert np.all(np.diff([e["seconds"] for e in warm.history_]) >= 0)
    cold = XDGMM(3, epochs=5, **settings).fit(X, Xcov=variances).fit(X, Xcov=variances)  # without warm_start: restarts
    np.testing.assert_allclose(cold.means_, XDGMM(3, epochs=5, **settings).fit(X, Xcov=variances).means_)
    with pytest.raises(ValueError, match="warm_start: the fitted model has K = 3"):
        warm.set_params(n_components=4).fit(X, Xcov=variances)


def test_n_features_in_is_set_by_fit_and_kept_by_save(blobs, tmp_path):
    X, variances = blobs
    model = XDGMM(2, epochs=2, device="cpu", random_state=0).fit(X, Xcov=variances)
    assert model.n_features_in_ == 2
    model.save(tmp_path / "model.npz")
    assert XDGMM.load(tmp_path / "model.npz").n_features_in_ == 2


def test_verbose_epochs_go_through_the_named_logger(blobs, caplog):
    import logging

    X, variances = blobs
    with caplog.at_level(logging.INFO, logger="scalable_xd.fit"):
        XDGMM(2, n_init=1, epochs=3, device="cpu", random_state=0, verbose=1).fit(X, Xcov=variances)
    lines = [r.getMessage() for r in caplog.records if r.name == "scalable_xd.fit"]
    assert len(lines) == 4 and lines[0].startswith("epoch   0/3") and "train" in lines[-1]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="scalable_xd.fit"):
        XDGMM(2, n_init=1, epochs=3, device="cpu", random_state=0).fit(X, Xcov=variances)  # verbose=0: silent
    assert not [r for r in caplog.records if r.name == "scalable_xd.fit"]


@pytest.mark.parametrize(("method", "epochs"), [("minibatch_em", 333), ("em", 120)])
def test_a_long_fit_logs_at_most_fifty_epoch_lines_and_its_last_once(blobs, caplog, method, epochs):
    """A small data set's minibatch fit runs hundreds of epochs: every k-th is logged (k = 7 for 333, 3
    for 120), and the last, once, whether the budget or ``tol`` ended the fit."""
    import logging

    X, variances = blobs
    with caplog.at_level(logging.INFO, logger="scalable_xd.fit"):
        model = XDGMM(2, method, n_init=1, epochs=epochs, batch_size=100, device="cpu", random_state=0, verbose=1)
        model.fit(X, Xcov=variances)
    epochs_logged = [
        int(r.getMessage().split()[1].split("/")[0]) for r in caplog.records if r.name == "scalable_xd.fit"
    ]
    every = -(-epochs // 50)
    last = model.n_iter_
    assert epochs_logged == sorted(set(range(0, last, every)) | {last}) and len(epochs_logged) <= 52


def test_scores_and_responsibilities_are_float64_and_scoring_noisy_data_without_its_noise_warns(blobs):
    """scikit-learn returns float64 whatever the fit's precision; X scored without Xcov after a fit to
    noisy data is taken as noiseless, which is rarely what was meant: said, unless the noise is given."""
    import warnings

    X, variances = blobs
    model = XDGMM(3, dtype="float32", epochs=3, random_state=0).fit(X, Xcov=variances)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none with the noise given
        assert model.score_samples(X, Xcov=variances).dtype == np.float64
        assert model.predict_proba(X, Xcov=variances).dtype == np.float64
    with pytest.warns(UserWarning, match="score: X has no Xcov, so it is taken as noiseless, but the model was"):
        noiseless = model.score(X)
    assert noiseless != pytest.approx(model.score(X, Xcov=variances), abs=0.05)  # not the data's score
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fitted without noise: nothing to warn of
        XDGMM(3, epochs=3, random_state=0).fit(X).score(X)
