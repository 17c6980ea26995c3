"""The uniform background component (``background``, ``fit.families.background_fit``): its likelihood against scipy,
batch EM's weight update against a direct computation, every method against the truth of a mock with a
known outlier fraction, refusals, resume and the model file."""

import json
import zipfile

import numpy as np
import pytest
from scipy import stats

import scalable_xd.fit.run.checkpoint
from scalable_xd import XDGMM
from scalable_xd.background import Background, from_setting

# The mock: a 2-D mixture of 3 with per-point noise; a known share of the points (OUTLIERS) is uniform over
# the square BOX instead, then observed with the same noise.
WEIGHTS = np.array([0.5, 0.3, 0.2])
MEANS = np.array([[0.0, 0.0], [3.0, 1.0], [-2.0, 3.0]])
COVS = np.array([[[1, 0.5], [0.5, 1]], [[0.3, 0], [0, 0.6]], [[0.5, -0.2], [-0.2, 0.4]]])
BOX = 10.0
OUTLIERS = 0.2


def _draw(rng, n, outliers=OUTLIERS):
    labels = rng.choice(3, n, p=WEIGHTS)
    true = MEANS[labels] + np.einsum("nij,nj->ni", np.linalg.cholesky(COVS)[labels], rng.normal(size=(n, 2)))
    outlier = rng.random(n) < outliers
    true[outlier] = rng.uniform(-BOX, BOX, (outlier.sum(), 2))
    S = np.zeros((n, 2, 2))
    S[:, [0, 1], [0, 1]] = rng.uniform(0.05, 0.3, (n, 2))
    x = true + np.einsum("nij,nj->ni", np.linalg.cholesky(S), rng.normal(size=(n, 2)))
    return x, S, true, outlier


@pytest.fixture(scope="module")
def mock():
    rng = np.random.default_rng(1)
    x, S, _, outlier = _draw(rng, 6000)
    held_out = _draw(rng, 20_000, outliers=0.0)[2]  # the stars' own density, without outliers or noise
    return x, S, outlier, held_out


def _truth_loglik(weights, means, covs, values) -> float:
    """Mean log-density of ``values`` under a Gaussian mixture, by scipy."""
    dens = sum(w * stats.multivariate_normal(m, c).pdf(values) for w, m, c in zip(weights, means, covs))
    return float(np.mean(np.log(dens)))


def test_the_likelihood_is_the_mixture_and_the_uniform_box_as_scipy_computes_them(mock):
    x, S, _, _ = mock
    model = XDGMM(3, background="auto", acceleration="none", epochs=3, tol=None, dtype="float64", random_state=0)
    model.fit(x, Xcov=S)
    box = model._background
    volume = np.prod(np.subtract(box.upper, box.lower))
    gaussian = sum(
        w * np.array([stats.multivariate_normal(m, c + s).pdf(xi) for xi, s in zip(x[:200], S[:200])])
        for w, m, c in zip(model.weights_, model.means_, model.covariances_)
    )
    beta = model.background_weight_
    expected = np.log((1 - beta) * gaussian + beta / volume)
    assert np.allclose(model.score_samples(x[:200], Xcov=S[:200]), expected, rtol=0, atol=1e-9)
    outside = np.array([[box.upper[0] + 1.0, 0.0]])  # outside the box the background adds nothing
    assert np.allclose(model.background_proba(outside, Xcov=S[:1]), 0.0)
    proba = model.predict_proba(x[:200], Xcov=S[:200])
    assert np.allclose(proba.sum(1) + model.background_proba(x[:200], Xcov=S[:200]), 1.0)
    assert np.allclose(proba.sum(1), (1 - beta) * gaussian / np.exp(expected))


@pytest.mark.slow
def test_batch_em_sets_the_weight_to_the_mean_responsibility(mock):
    """One batch-EM iteration from given parameters: beta' = mean of beta U / p(x_i), computed here by scipy."""
    x, S, _, _ = mock
    start = dict(weights_init=WEIGHTS, means_init=MEANS, covariances_init=COVS)
    settings = dict(background="-12:12, -12:12", background_weight=0.3, acceleration="none", tol=None)
    model = XDGMM(3, epochs=1, dtype="float64", random_state=0, **settings, **start).fit(x, Xcov=S)
    gaussian = sum(
        w * np.array([stats.multivariate_normal(m, c + s).pdf(xi) for xi, s in zip(x, S)])
        for w, m, c in zip(WEIGHTS, MEANS, COVS)
    )
    uniform = 0.3 / 24.0**2
    assert model.background_weight_ == pytest.approx(np.mean(uniform / (0.7 * gaussian + uniform)), rel=1e-9)
    assert model.history_[1]["background_weight"] == model.background_weight_


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")  # minibatch fits at their budget
@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_a_fit_with_a_background_finds_the_outlier_share_and_the_stars_density(mock, method):
    """With 20% of the points uniform outliers, every method finds a background weight near their share
    (a few points of it fall on the stars, where they count as theirs) and closes at least 80% of the gap
    between the fit without a background and the oracle (a fit to the stars' noise-free values), in
    held-out log-likelihood of the stars' density. Measured: 97% (batch and minibatch EM) and 93% (SGD);
    the background takes 83% of the outliers and 0.4% of the stars."""
    x, S, outlier, held_out = mock
    settings = dict(n_components=3, method=method, random_state=0, acceleration="none")
    plain = XDGMM(**settings).fit(x, Xcov=S)
    with_background = XDGMM(**settings, background="auto").fit(x, Xcov=S)
    assert with_background.background_weight_ == pytest.approx(OUTLIERS, abs=0.04)
    found = with_background.background_proba(x, Xcov=S) > 0.5
    assert (found & outlier).sum() > 0.7 * outlier.sum()
    assert (found & ~outlier).sum() < 0.02 * (~outlier).sum()
    oracle = _truth_loglik(WEIGHTS, MEANS, COVS, held_out)
    naive = _truth_loglik(plain.weights_, plain.means_, plain.covariances_, held_out)
    aware = _truth_loglik(with_background.weights_, with_background.means_, with_background.covariances_, held_out)
    assert (aware - naive) / (oracle - naive) > 0.8


def test_samples_hold_the_background_share(mock):
    x, S, _, _ = mock
    model = XDGMM(3, background="auto", acceleration="none", random_state=0).fit(x, Xcov=S)
    draws, labels = model.sample(20_000, random_state=1)

    def far(values):  # beyond every star component's reach (6 sigma of the widest)
        return (np.abs(values - MEANS[:, None]).max(-1) > 6).all(0)

    box = model._background
    uniform = np.random.default_rng(2).uniform(box.lower, box.upper, (200_000, 2))
    assert far(draws).mean() == pytest.approx(model.background_weight_ * far(uniform).mean(), abs=0.01)
    assert (labels == -1).mean() == pytest.approx(model.background_weight_, abs=0.01)  # the background's label
    assert not far(draws[labels >= 0]).any()


def test_the_posterior_of_an_outlier_is_its_own_measurement(mock):
    x, S, _, _ = mock
    model = XDGMM(3, background="auto", acceleration="none", random_state=0).fit(x, Xcov=S)
    far = np.array([[9.0, -9.0]])
    mean, cov = model.posterior(far, Xcov=S[:1])
    assert np.allclose(mean, far, atol=1e-6) and np.allclose(cov, S[:1], atol=1e-6)


@pytest.mark.parametrize(
    ("settings", "fit", "message"),
    [
        (dict(background="auto", split_merge=True, acceleration="none"), {}, "split_merge"),
        (dict(background="auto", acceleration="none"), dict(R=True), "projections R"),
        (dict(background="-1:1"), {}, "1 ranges given for 2 features"),
        (dict(background="-1:1, 2"), {}, "range 1 '2' is not 'lower:upper'"),
        (dict(background="-1:1, 2:a"), {}, "not a number"),
        (dict(background="-1:1, 2:1"), {}, "feature 1's range"),
        (dict(background="auto", background_weight=1.0), {}, "background_weight"),
        (dict(background="auto", acceleration="none", tol=None, selection="x0 < 99"), {}, "not with a selection"),
    ],
)
def test_a_background_that_cannot_be_used_is_refused_naming_what(mock, settings, fit, message):
    x, S, _, _ = mock
    extra = {"R": np.broadcast_to(np.eye(2), (len(x), 2, 2))} if fit.get("R") else {}
    with pytest.raises(ValueError, match=message):
        XDGMM(2, epochs=1, **settings).fit(x, Xcov=S, **extra)


def test_auto_refuses_a_feature_of_one_value():
    x = np.column_stack([np.linspace(0, 1, 50), np.ones(50)])
    with pytest.raises(ValueError, match="feature 1 takes one value"):
        XDGMM(1, background="auto", acceleration="none").fit(x)
    with pytest.raises(ValueError, match="give one 'lower:upper' range"):
        from_setting("auto", None, 0.1)


def test_partial_fit_refuses_a_background(mock):
    x, S, _, _ = mock
    with pytest.raises(ValueError, match="partial_fit fits no background"):
        XDGMM(2, "minibatch_em", background="auto").partial_fit(x[:500], Xcov=S[:500])


@pytest.mark.parametrize(("method", "every"), [("em", 0), ("minibatch_em", 2)])
def test_a_fit_with_a_background_resumes_to_the_bit(mock, method, every, tmp_path, killed_after_checkpoint):
    """The background's weight (and batch EM's sums towards it) is in the checkpoint; a checkpoint refuses
    another box."""
    x, S, _, _ = mock
    settings = dict(n_components=2, method=method, epochs=3, batch_size=2048 if method == "em" else 1000)
    settings.update(tol=None, acceleration="none", dtype="float64", random_state=2, background="-12:12, -12:12")
    uninterrupted = XDGMM(**settings).fit(x, Xcov=S)
    checkpoint = tmp_path / "fit.ckpt"
    with killed_after_checkpoint(1, every or None):
        XDGMM(**settings).fit(x, Xcov=S, checkpoint=checkpoint, checkpoint_every=every)
    with pytest.raises(scalable_xd.fit.run.checkpoint.CheckpointError, match="background"):
        XDGMM(**{**settings, "background": "-13:13, -12:12"}).fit(x, Xcov=S, checkpoint=checkpoint)
    resumed = XDGMM(**settings).fit(x, Xcov=S, checkpoint=checkpoint, checkpoint_every=every)
    for name in ("weights_", "means_", "covariances_", "background_weight_"):
        assert np.array_equal(getattr(resumed, name), getattr(uninterrupted, name))


def test_the_model_file_keeps_the_background_and_refuses_a_damaged_one(mock, tmp_path):
    x, S, _, _ = mock
    model = XDGMM(3, background="auto", acceleration="none", epochs=5, tol=None, random_state=0).fit(x, Xcov=S)
    path = tmp_path / "model.npz"
    model.save(path)
    loaded = XDGMM.load(path)
    assert loaded.background_weight_ == model.background_weight_
    assert np.array_equal(loaded.score_samples(x, Xcov=S), model.score_samples(x, Xcov=S))
    assert loaded.bic(x, Xcov=S) == model.bic(x, Xcov=S)
    with np.load(path) as arrays:
        contents = {name: arrays[name] for name in arrays.files}
    meta = json.loads(str(contents["meta"]))
    meta["background"]["weight"] = 1.5
    contents["meta"] = np.array(json.dumps(meta))
    damaged = tmp_path / "damaged.npz"
    np.savez(damaged, **contents)
    assert zipfile.is_zipfile(damaged)
    with pytest.raises(ValueError, match=f"model {damaged} holds an invalid background: .*weight"):
        XDGMM.load(damaged)


def test_without_a_background_nothing_changes(mock):
    x, S, _, _ = mock
    model = XDGMM(2, epochs=3, tol=None, random_state=0).fit(x, Xcov=S)
    assert model.background_weight_ == 0.0
    assert np.allclose(model.predict_proba(x, Xcov=S).sum(1), 1.0)
    assert (model.predict(x, Xcov=S) >= 0).all()
    assert "background_weight" not in model.history_[-1]


def test_the_background_refuses_a_bad_box():
    with pytest.raises(ValueError, match="feature 0's range"):
        Background((1.0,), (0.0,), 0.1)
    with pytest.raises(ValueError, match="weight must lie in"):
        Background((0.0,), (1.0,), 1.0)


def test_a_background_or_a_selection_at_the_defaults_gets_a_fit_and_says_what_it_chose(mock, caplog):
    """Batch EM under a background or a selection needs plain EM (and, under a selection, no tol): left
    at their defaults, they are resolved and said, as scikit-learn's "auto" settings are."""
    import logging

    x, S, _, _ = mock
    with caplog.at_level(logging.INFO, logger="scalable_xd.fit"):
        model = XDGMM(2, background="auto", epochs=2, random_state=0).fit(x, Xcov=S)
        assert model.settings_.acceleration == "none" and model.settings_.tol == 1e-6  # tol judges EM here
        selected = XDGMM(2, selection="x0 < 1", epochs=2, random_state=0).fit(x[x[:, 0] < 1], Xcov=S[x[:, 0] < 1])
        assert selected.settings_.acceleration == "none" and selected.settings_.tol is None
    said = [r.getMessage() for r in caplog.records if r.name == "scalable_xd.fit"]
    assert "a background: acceleration='none'" in said
    assert "a selection's Monte Carlo EM: acceleration='none', tol=None" in said
