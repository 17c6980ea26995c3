"""The XDGMM API: predictions against independent computations, persistence, determinism, resume, errors."""

import math
import warnings

import numpy as np
import pytest
import torch
from helpers import draw_xd_data, random_spd, xd_log_densities, xd_loglik, xd_pair_posteriors
from sklearn.exceptions import ConvergenceWarning, NotFittedError

import scalable_xd.data.dataset
import scalable_xd.estimator
import scalable_xd.fit.driver
import scalable_xd.fit.engines.reference
import scalable_xd.fit.loop
import scalable_xd.fit.run.checkpoint
import scalable_xd.kernel.fused
from scalable_xd import XDGMM, FitDivergedError

K, D = 3, 3


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(40)
    means = rng.normal(scale=4, size=(K, D))
    x, S, _, _ = draw_xd_data(rng, 1500, np.array([0.5, 0.3, 0.2]), means, random_spd(rng, K, D), 0.2, 0.8)
    return x, S


@pytest.fixture(scope="module")
def fitted(data):
    x, S = data
    return XDGMM(K, "em", epochs=30, dtype="float64", device="cpu", random_state=0).fit(x, Xcov=S)


def test_scores_and_responsibilities_match_scipy(fitted, data):
    x, S = data
    params = (fitted.weights_, fitted.means_, fitted.covariances_)
    log_dens = xd_log_densities(x[:50], S[:50], *params)
    np.testing.assert_allclose(
        fitted.score_samples(x[:50], Xcov=S[:50]), np.logaddexp.reduce(log_dens, axis=1), rtol=1e-10
    )
    expected_resp = np.exp(log_dens - np.logaddexp.reduce(log_dens, axis=1, keepdims=True))
    np.testing.assert_allclose(fitted.predict_proba(x[:50], Xcov=S[:50]), expected_resp, atol=1e-10)
    np.testing.assert_array_equal(fitted.predict(x[:50], Xcov=S[:50]), expected_resp.argmax(1))
    assert fitted.score(x, Xcov=S) == pytest.approx(xd_loglik(x, S, *params).mean(), rel=1e-10)


def test_bic_and_aic_count_parameters(fitted, data):
    x, S = data
    total = xd_loglik(x, S, fitted.weights_, fitted.means_, fitted.covariances_).sum()
    n_params = (K - 1) + K * D + K * D * (D + 1) // 2
    assert fitted.bic(x, Xcov=S) == pytest.approx(-2 * total + n_params * math.log(len(x)), rel=1e-10)
    assert fitted.aic(x, Xcov=S) == pytest.approx(-2 * total + 2 * n_params, rel=1e-10)


@pytest.mark.parametrize("projected", [False, True])
def test_posterior_of_true_values(fitted, data, projected):
    x, S = data
    rng = np.random.default_rng(41)
    R = rng.normal(size=(20, 2, D)) if projected else None
    xs, Ss = (x[:20, :2], S[:20, :2, :2]) if projected else (x[:20], S[:20])
    r, b, B = xd_pair_posteriors(xs, Ss, fitted.weights_, fitted.means_, fitted.covariances_, R)
    mean = np.einsum("nk,nkd->nd", r, b)
    centred = b - mean[:, None]
    cov = np.einsum("nk,nkde->nde", r, B + centred[..., None] * centred[..., None, :])
    got_mean, got_cov = fitted.posterior(xs, Xcov=Ss, R=R)
    np.testing.assert_allclose(got_mean, mean, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(got_cov, cov, rtol=1e-8, atol=1e-10)


def test_samples_follow_the_deconvolved_mixture(fitted):
    """(draws, components) as scikit-learn's GaussianMixture.sample returns them: the draws' moments are the
    mixture's, each component's share of the draws its weight, and its draws its mean (sampling error of
    200,000 draws: ~0.005 in a mean of unit spread, hence the tolerances)."""
    draws, labels = fitted.sample(200_000, random_state=3)
    w, m, V = fitted.weights_, fitted.means_, fitted.covariances_
    mean = w @ m
    cov = np.einsum("k,kde->de", w, V + m[:, :, None] * m[:, None, :]) - np.outer(mean, mean)
    np.testing.assert_allclose(draws.mean(0), mean, atol=0.05)
    np.testing.assert_allclose(np.cov(draws.T), cov, rtol=0.03, atol=0.05)
    assert labels.shape == (200_000,) and labels.dtype == np.int64
    np.testing.assert_allclose(np.bincount(labels, minlength=len(w)) / len(labels), w, atol=0.01)
    for k in range(len(w)):
        np.testing.assert_allclose(draws[labels == k].mean(0), m[k], atol=0.05)
    np.testing.assert_array_equal(fitted.sample(10, random_state=3)[0], fitted.sample(10, random_state=3)[0])
    assert not np.array_equal(fitted.sample(10, random_state=3)[0], fitted.sample(10, random_state=4)[0])


def test_save_and_load_round_trip(fitted, data, tmp_path):
    x, S = data
    path = tmp_path / "model.npz"
    fitted.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.npz"]
    loaded = XDGMM.load(path)
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_array_equal(getattr(loaded, attr), getattr(fitted, attr))
    assert loaded.history_ == fitted.history_
    assert loaded.get_params() == fitted.get_params()
    assert loaded.score(x, Xcov=S) == fitted.score(x, Xcov=S)


@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_same_random_state_gives_identical_fits(data, method):
    x, S = data
    fits = [XDGMM(K, method, epochs=3, device="cpu", random_state=7).fit(x, Xcov=S) for _ in range(2)]
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_array_equal(getattr(fits[0], attr), getattr(fits[1], attr))


@pytest.mark.slow
def test_compiled_kernel_gives_the_same_fit_and_scores(data):
    """backend="compiled" changes speed, not results; projected data keeps the LAPACK path."""
    x, S = data
    settings = dict(n_components=K, method="minibatch_em", epochs=2, dtype="float64", device="cpu", random_state=3)
    eager = XDGMM(**settings).fit(x, Xcov=S)
    compiled = XDGMM(backend="compiled", **settings).fit(x, Xcov=S)
    assert (eager.backend_, compiled.backend_) == ("fused", "compiled")
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(compiled, attr), getattr(eager, attr), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(
        [h["train_loglik"] for h in compiled.history_], [h["train_loglik"] for h in eager.history_], rtol=1e-12
    )
    R = np.random.default_rng(41).normal(size=(100, 2, D))
    S_obs = np.einsum("nij,njk,nlk->nil", R, S[:100], R)
    np.testing.assert_allclose(
        compiled.score_samples(x[:100, :2], Xcov=S_obs, R=R), eager.score_samples(x[:100, :2], Xcov=S_obs, R=R)
    )


@pytest.mark.parametrize(
    "method, options",
    [
        ("em", {}),
        ("stochastic_em", {}),
        ("minibatch_em", {}),
        ("sgd", {}),
        ("stochastic_minibatch_em", {}),
        ("minibatch_em", {"averaging": "polyak", "truncation": True}),
    ],
)
def test_a_fit_killed_inside_an_epoch_resumes_from_the_batch_it_reached(
    method, options, tmp_path, monkeypatch, killed_after_checkpoint
):
    """checkpoint_every: a checkpoint inside epoch 2 (after 3 of its batches; batch EM's chunks of 8,192
    points carry the partial sums) resumes with the rest of that epoch, computing only what was not done."""
    rng = np.random.default_rng(41)
    x = np.concatenate([rng.normal(size=(9000, 2)), rng.normal(size=(9000, 2)) + 4])
    S = np.tile(np.eye(2) * 0.1, (len(x), 1, 1))
    batch_size = 8192 if method in ("em", "stochastic_em") else 2000  # 4 batches (batch EM: 2 chunks) an epoch
    settings = {
        **dict(
            n_components=2,
            n_init=1,
            method=method,
            epochs=3,
            batch_size=batch_size,
            tol=None,
            dtype="float64",
            device="cpu",
            random_state=2,
        ),
        **options,
    }
    every = 1 if method in ("em", "stochastic_em") else 3
    uninterrupted = XDGMM(**settings).fit(x, Xcov=S)
    checkpoint = tmp_path / "fit.ckpt"
    with killed_after_checkpoint(1, every):
        XDGMM(**settings).fit(x, Xcov=S, checkpoint=checkpoint, checkpoint_every=every)
    calls, general, plain = [], scalable_xd.fit.engines.reference, scalable_xd.kernel.fused.PlainPass
    real, real_plain = general.batch_statistics, plain._pass  # the plain pass, as Statistics or arrays
    counted = lambda stats: (calls.append(1) if stats is not None else None, stats)[1]  # noqa: E731  # a pass
    monkeypatch.setattr(general, "batch_statistics", lambda *a, **k: counted(real(*a, **k)))
    monkeypatch.setattr(plain, "_pass", lambda *a, **k: counted(real_plain(*a, **k)))
    saved = scalable_xd.fit.run.checkpoint.load(checkpoint)
    monkeypatch.setattr(scalable_xd.fit.loop, "_now", lambda: (5.0, 7.0))  # the resumed run's own time: none
    resumed = XDGMM(**settings).fit(x, Xcov=S, checkpoint=checkpoint, checkpoint_every=every)
    # the time of epoch 2's batches before the kill, wall and CPU, is counted into its entry, and only that
    for clock, done in zip(("seconds", "cpu_seconds"), saved["epoch_seconds"]):
        assert done > 0 and resumed.history_[2][clock] == saved["history"][1][clock] + done
        assert resumed.history_[3][clock] == resumed.history_[2][clock]
    per_epoch = 2 if method in ("em", "stochastic_em") else len(x) // batch_size
    assert len(calls) == 2 * per_epoch - every  # the rest of epoch 2, then epoch 3
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(resumed, attr), getattr(uninterrupted, attr), rtol=1e-12, atol=1e-14)
    assert [h["train_loglik"] for h in resumed.history_] == [h["train_loglik"] for h in uninterrupted.history_]
    split_merge = dict(n_components=2, method="minibatch_em", split_merge=True, device="cpu")
    with pytest.raises(ValueError, match="split_merge fits checkpoint at epochs' ends only"):
        XDGMM(**split_merge).fit(x, Xcov=S, checkpoint=tmp_path / "sm.ckpt", checkpoint_every=2)
    with pytest.raises(ValueError, match=r"checkpoint_every: checkpoints inside an epoch need a checkpoint path"):
        XDGMM(**settings).fit(x, Xcov=S, checkpoint_every=2)  # silently ignored, once


@pytest.mark.parametrize(
    "method, options",
    [
        ("em", {}),
        ("minibatch_em", {}),
        ("sgd", {}),
        ("stochastic_em", {}),
        ("stochastic_minibatch_em", {}),
        ("minibatch_em", {"averaging": "polyak", "truncation": True, "truncation_bound": 1.5, "batch_size": 50}),
        ("sgd", {"averaging": "polyak", "fix_means": np.array([True, False, False]), "fix_weights": True}),
        ("em", {"split_merge": True, "tol": 0.2, "split_merge_tries": 3}),  # interrupted in a partial EM
        ("em", {"acceleration": "squarem"}),  # interrupted before the pass at an extrapolation
        ("minibatch_em", {"split_merge": True}),  # interrupted with a trial proposed, before its epoch
        ("sgd", {"split_merge": True, "batch_size": 100}),
    ],
)
def test_interrupted_fit_resumes_from_checkpoint(data, method, options, tmp_path, monkeypatch, killed_after_checkpoint):
    x, S = data
    settings = {
        **dict(
            n_components=K, n_init=1, method=method, epochs=6, tol=None, dtype="float64", device="cpu", random_state=5
        ),
        **options,
    }
    uninterrupted = XDGMM(**settings).fit(x, Xcov=S)

    checkpoint = tmp_path / "fit.ckpt"
    with killed_after_checkpoint(3):
        XDGMM(**settings).fit(x, Xcov=S, checkpoint=checkpoint)

    epochs_run = []
    order = scalable_xd.data.dataset.epoch_order
    monkeypatch.setattr(
        scalable_xd.data.dataset,
        "epoch_order",
        lambda n, b, epoch, *a, **kw: (epochs_run.append(epoch), order(n, b, epoch, *a, **kw))[1],
    )
    resumed = XDGMM(**settings).fit(x, Xcov=S, checkpoint=checkpoint)
    assert epochs_run == [4, 5, 6]  # only the epochs after the checkpoint ran again
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(resumed, attr), getattr(uninterrupted, attr), rtol=1e-12, atol=1e-14)
    assert [h["epoch"] for h in resumed.history_] == list(range(7))
    assert resumed.history_ == uninterrupted.history_ or all(  # the same curve (and truncation restarts)
        {k: v for k, v in a.items() if k not in ("seconds", "cpu_seconds")}
        == {k: v for k, v in b.items() if k not in ("seconds", "cpu_seconds")}
        for a, b in zip(resumed.history_, uninterrupted.history_)
    )
    with pytest.raises(ValueError, match="different fit"):
        XDGMM(**{**settings, "w": 0.5}).fit(x, Xcov=S, checkpoint=checkpoint)


def test_fit_without_random_state_resumes_with_the_checkpoints_seed(
    data, tmp_path, monkeypatch, killed_after_checkpoint
):
    x, S = data
    settings = dict(n_components=K, n_init=1, method="sgd", epochs=4, dtype="float64", device="cpu")
    with killed_after_checkpoint(2):
        XDGMM(**settings).fit(x, Xcov=S, checkpoint=tmp_path / "fit.ckpt")
    seed = scalable_xd.fit.run.checkpoint.Checkpoint(tmp_path / "fit.ckpt").seed
    monkeypatch.setattr(scalable_xd.fit.driver, "initial_mixture", None)  # resuming must not re-run the init
    resumed = XDGMM(**settings).fit(x, Xcov=S, checkpoint=tmp_path / "fit.ckpt")
    assert [h["epoch"] for h in resumed.history_] == list(range(5))
    monkeypatch.undo()
    fresh = XDGMM(**settings, random_state=seed).fit(x, Xcov=S)
    np.testing.assert_allclose(resumed.means_, fresh.means_, rtol=1e-12)


def test_collapsing_component_raises_a_named_divergence():
    """Without regularisation a component that captures one repeated point collapses to zero covariance."""
    rng = np.random.default_rng(42)
    x = np.vstack([rng.normal(size=(300, 2)), np.full((5, 2), 30.0)])
    init = dict(means_init=np.array([[0.0, 0.0], [30.0, 30.0]]), weights_init=np.array([0.9, 0.1]))
    with pytest.raises(FitDivergedError, match=r"epoch \d+.*component 1.*larger covariance regularisation w") as err:
        XDGMM(2, "em", w=0.0, dtype="float64", device="cpu", **init).fit(x, Xcov=None)
    # only what would change something: batch EM has no step size, and this fit already runs in float64
    assert "float64" not in str(err.value) and "step" not in str(err.value) and "learning rate" not in str(err.value)
    regularised = XDGMM(2, "em", w=1e-6, dtype="float64", device="cpu", **init).fit(x, Xcov=None)
    assert np.linalg.eigvalsh(regularised.covariances_[1]).min() > 0


def _repeated_points(case):
    """scikit-learn's test_regularisation (five rows of ones and five of zeros, 5 features, K = 10), or a
    cloud of 300 stars with five repeated measurements far off it (K = 2): data only w keeps from collapse."""
    if case == "scikit-learn":
        return np.vstack((np.ones((5, 5)), np.zeros((5, 5)))), 10
    x = np.vstack([np.random.default_rng(42).normal(size=(300, 2)), np.full((5, 2), 30.0)])
    return x, 2


# SGD on "own" is left out: Adam narrows the component by about lr a step in log-Cholesky units, and its budget
# ends at a variance of 1e-9 of the data's, finite and resolved
@pytest.mark.slow
@pytest.mark.parametrize(
    "method, case",
    [(m, "scikit-learn") for m in ("em", "minibatch_em", "sgd")] + [("em", "own"), ("minibatch_em", "own")],
)
def test_every_method_reports_a_collapse_on_repeated_points_as_a_divergence(method, case):
    """SGD's log-Cholesky factors and minibatch EM's steps keep a vanishing covariance positive definite, so
    that they once returned variances of 5e-36 and 1e-73 without a word where batch EM raises: each method
    must raise FitDivergedError naming the cure, and fit the same data with the default w."""
    x, k = _repeated_points(case)
    settings = dict(n_components=k, method=method, dtype="float64", device="cpu", random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the discarded starts' and the budget's warnings
        with pytest.raises(
            FitDivergedError, match=r"component \d+ (has a|collapsed).*larger covariance regularisation w"
        ):
            XDGMM(**settings, w=0.0).fit(x, Xcov=np.zeros_like(x))
        regularised = XDGMM(**settings).fit(x, Xcov=np.zeros_like(x))
    assert np.isfinite(regularised.score(x, Xcov=np.zeros_like(x)))


def test_a_vanishing_variance_is_a_divergence_only_where_some_star_has_no_noise():
    """Where every star's noise widens V_j + S_i, a component narrower than the noise has XD's bounded optimum at
    a variance of 0 (a fit of the ten-seed grid, SGD at K = 128, was stopped so at 1.9e-16 of the data's
    parallax variance): not a divergence. In a feature measured without noise it is one."""
    from scalable_xd.fit.loop import _check_collapse
    from scalable_xd.mixture import Mixture

    covariances = torch.tensor([np.eye(2), np.diag([1e-30, 1.0])])
    mixture = Mixture(torch.tensor([0.5, 0.5]), torch.zeros(2, 2, dtype=torch.float64), covariances)
    spread = torch.ones(2, dtype=torch.float64)
    for noise_free in (None, torch.tensor([False, True])):
        _check_collapse(mixture, spread, noise_free, 3, "w")  # no raise
    with pytest.raises(FitDivergedError, match=r"epoch 3: component 1 collapsed: its variance along feature 0"):
        _check_collapse(mixture, spread, torch.tensor([True, False]), 3, "w")


@pytest.mark.parametrize(
    "method, dtype, cures",
    [
        (
            "em",
            "float32",
            'a larger covariance regularisation w (now 1e-06 of each feature\'s variance) or dtype="float64"',
        ),
        ("sgd", "float64", "w (now 1e-06 of each feature's variance) or a smaller learning rate lr (now 0.01)"),
        ("minibatch_em", "float32", 'a smaller step_size (now 0.1) or dtype="float64"'),
    ],
)
def test_a_divergence_advises_only_what_would_change_the_fit(method, dtype, cures):
    from scalable_xd.fit.driver import divergence_cures
    from scalable_xd.settings import FitSettings

    assert cures in divergence_cures(FitSettings(method=method, dtype=dtype))


def test_a_float32_fit_that_diverges_is_fitted_again_in_float64_with_its_seed(data, monkeypatch, tmp_path):
    """The float32 attempt made to diverge (on a given CPU whether rounding tips a near-degenerate component
    over is the CPU's): the fit returned is the float64 fit of the same seed, to the bit (the same code in the
    same process), with a warning naming where float32 diverged. A fit that checkpoints raises instead."""
    import scalable_xd.fit.driver as driver

    x, S = (a[:300] for a in data)
    fit_plan = driver._fit_plan

    def float32_diverges(plan):
        if plan.settings.dtype == "float32":
            raise FitDivergedError(4, 2, "has a covariance that is not positive definite", 'dtype="float64"', 7)
        return fit_plan(plan)

    monkeypatch.setattr(driver, "_fit_plan", float32_diverges)
    settings = dict(n_components=2, method="minibatch_em", epochs=3, device="cpu")
    with pytest.warns(UserWarning, match=r"fit diverged at epoch 4, batch 7: component 2 .* in float32; it was fitted"):
        model = XDGMM(**settings, random_state=np.random.RandomState(5)).fit(x, Xcov=S)
    seed = np.random.RandomState(5).randint(0, 2**62, dtype=np.int64)  # the one seed both attempts share
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = XDGMM(**settings, random_state=int(seed), dtype="float64").fit(x, Xcov=S)
    for name in ("weights_", "means_", "covariances_"):
        assert np.array_equal(getattr(model, name), getattr(reference, name)), name
    with pytest.raises(FitDivergedError, match="epoch 4, batch 7"):
        XDGMM(**settings, random_state=0).fit(x, Xcov=S, checkpoint=tmp_path / "fit.pt")


def test_breast_cancer_at_k8_fits_where_float32_cannot_resolve_its_components():
    """scikit-learn's breast-cancer table (569 rows, its first 20 features, no noise): at K = 8 batch EM's
    components reach condition numbers of 1e8, beyond float32's pass; seed 3 diverged there in float32 on a
    2-core AVX-512 machine. At the defaults the fit ends, in float64 where float32 diverged (then equal to the
    float64 fit of its seed)."""
    from sklearn.datasets import load_breast_cancer

    x = load_breast_cancer().data[:, :20]
    S = np.zeros((len(x), 20, 20))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = XDGMM(8, "em", n_init=1, random_state=3, device="cpu").fit(x, Xcov=S)
    refitted = any("fitted again in float64" in str(w.message) for w in said)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        in_float64 = XDGMM(8, "em", n_init=1, random_state=3, device="cpu", dtype="float64").fit(x, Xcov=S)
    assert np.isfinite(model.score(x, Xcov=S))
    if refitted:
        assert np.array_equal(model.covariances_, in_float64.covariances_)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda x, S: x.__setitem__((7, 1), np.nan), "X row 7, column 1 contains NaN"),
        (lambda x, S: x.__setitem__((2, 0), np.inf), "X row 2, column 0 contains NaN or inf"),
        (lambda x, S: S.__setitem__((3, 2, 1), np.nan), r"Xcov row 3, entry \(2, 1\) contains NaN"),
        (lambda x, S: S.__setitem__((5, 0, 1), S[5, 0, 1] + 0.3), r"Xcov row 5, entry \(0, 1\) is not symmetric"),
        (lambda x, S: S.__setitem__((4, 1, 1), -1.0), "Xcov row 4, column 1 has a negative variance"),
        (
            lambda x, S: S.__setitem__((6, slice(None), slice(None)), [[1, 2, 0], [2, 1, 0], [0, 0, 1]]),
            "Xcov row 6 is not positive semi-definite",
        ),
    ],
)
def test_bad_rows_are_named(data, mutate, message):
    x, S = (a[:50].copy() for a in data)
    mutate(x, S)
    with pytest.raises(ValueError, match=message):
        XDGMM(2, device="cpu").fit(x, Xcov=S)


def test_a_bad_variance_is_named_by_row_and_column(data):
    x, S = (a[:50].copy() for a in data)
    variances = np.diagonal(S, axis1=1, axis2=2).copy()
    variances[9, 2] = np.nan
    with pytest.raises(ValueError, match="Xcov row 9, column 2 contains NaN or inf"):
        XDGMM(2, device="cpu").fit(x, Xcov=variances)


def test_bad_shapes_and_parameters_are_named(data):
    x, S = data
    with pytest.raises(ValueError, match="Xcov describes 1500 points of dimension 2"):
        XDGMM(2, device="cpu").fit(x, Xcov=S[:, :2, :2])
    with pytest.raises(ValueError, match="Xcov describes 10 points"):
        XDGMM(2, device="cpu").fit(x, Xcov=S[:10])
    with pytest.raises(ValueError, match=r"Expected 2D array, got 1D array instead \(X of shape \(1500,\)\)\. Resh"):
        XDGMM(2, device="cpu").fit(x[:, 0], Xcov=S)  # scikit-learn's words, without its 1,500 values
    with pytest.raises(ValueError, match="fit: X is empty: give at least one row"):  # not advice to reshape
        XDGMM(2, device="cpu").fit([])
    numeric_strings = x[:100].astype(str).astype(object)  # converted, as GaussianMixture converts them
    assert np.allclose(XDGMM(1, epochs=2).fit(numeric_strings).means_, XDGMM(1, epochs=2).fit(x[:100]).means_)
    with pytest.raises(ValueError, match=r"X must have shape \(N, d\)"):  # a tensor: ours
        XDGMM(2, device="cpu").fit(torch.as_tensor(x[:, 0]), Xcov=S)
    with pytest.raises(ValueError, match="n_components=20 is larger than the number of points"):
        XDGMM(20, device="cpu").fit(x[:10], Xcov=S[:10])
    with pytest.raises(ValueError, match="unknown method 'adam'"):
        XDGMM(2, "adam").fit(x, Xcov=S)
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        XDGMM(2, device="gpu0").fit(x, Xcov=S)
    with pytest.raises(ValueError, match="unknown dtype 'float16': choose one of float32, float64"):
        XDGMM(2, dtype="float16").fit(x, Xcov=S)
    with pytest.raises(ValueError, match="w must be in"):
        XDGMM(2, w=-1.0).fit(x, Xcov=S)
    with pytest.raises(ValueError, match="step_size must be in"):
        XDGMM(2, step_size=2.0).fit(x, Xcov=S)
    with pytest.raises(ValueError, match="n_components must be a positive integer"):
        XDGMM(0).fit(x, Xcov=S)
    with pytest.raises(ValueError, match="unknown backend 'yes': choose one of auto, fused, triton"):
        XDGMM(2, backend="yes").fit(x, Xcov=S)
    with pytest.raises(ValueError, match=r"means_init must have shape \(2, 3\)"):
        XDGMM(2, device="cpu", means_init=np.zeros((3, 3))).fit(x, Xcov=S)
    with pytest.raises(ValueError, match="covariances_init component 1 is not symmetric positive definite"):
        XDGMM(2, device="cpu", covariances_init=np.stack([np.eye(3), -np.eye(3)])).fit(x, Xcov=S)
    with pytest.raises(NotFittedError, match="not fitted"):
        XDGMM(2).score(x, Xcov=S)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_request_without_cuda_says_so():
    with pytest.raises(ValueError, match="CUDA is not available"):
        XDGMM(2, device="cuda").fit(np.zeros((5, 2)))


def test_cappe_moulines_schedule():
    from scalable_xd.fit.families.minibatch_em import MinibatchEM
    from scalable_xd.mixture import Mixture

    fitter = MinibatchEM(
        Mixture.placeholder(2, 2, "cpu"),
        w=0,
        step_size=0.01,
        schedule="cappe_moulines",
        step_decay=0.5,
        decay_epoch=10,
        kappa=0.6,
        covariance_update="stable",
    )
    assert fitter.step_size(0) == pytest.approx(0.01)
    fitter.n_updates = 5000
    assert fitter.step_size(0) == pytest.approx((0.01 ** (-1 / 0.6) + 5000) ** -0.6)
    paper = MinibatchEM(
        Mixture.placeholder(2, 2, "cpu"),
        w=0,
        step_size=0.01,
        schedule="step",
        step_decay=0.5,
        decay_epoch=10,
        kappa=0.6,
        covariance_update="stable",
    )
    assert [paper.step_size(e) for e in (0, 9, 10, 19)] == [0.01, 0.01, 0.005, 0.005]


@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_a_fit_stopped_by_its_epoch_budget_says_so(data, method):
    """scikit-learn's ConvergenceWarning, exactly when the last epoch still gained more than tol; then
    converged_ is False. A loose tol judges the same fit converged, silently; tol=None judges nothing."""
    x, S = data
    settings = dict(n_components=K, method=method, epochs=2, dtype="float64", device="cpu", random_state=0)
    with pytest.warns(ConvergenceWarning, match=f"{method} ended by its budget of 2 epochs .*more than tol = 1e-06"):
        short = XDGMM(**settings).fit(x, Xcov=S)
    gain = short.history_[-1]["train_loglik"] - short.history_[-2]["train_loglik"]
    assert not short.converged_ and gain >= 1e-6
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        loose = XDGMM(**settings, tol=gain + 1.0).fit(x, Xcov=S)
        unjudged = XDGMM(**settings, tol=None).fit(x, Xcov=S)
    assert loose.converged_ and not unjudged.converged_


def test_batch_em_that_converges_within_its_budget_does_not_warn(data):
    x, S = data
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        model = XDGMM(K, "em", epochs=500, tol=1e-4, dtype="float64", device="cpu", random_state=0).fit(x, Xcov=S)
    assert model.converged_ and model.n_iter_ < 500


@pytest.mark.parametrize("method", ["minibatch_em", "sgd"])
def test_minibatch_epochs_score_a_fixed_sample_of_the_training_data(data, method):
    """``train_score_rows``: every entry's ``train_loglik`` is the mean log-likelihood (scipy's) of the same
    seeded sample of the training rows, not of all of them; None scores every row."""
    from scalable_xd.data.batching import random_rows

    x, S = data
    settings = dict(n_init=1, epochs=2, tol=None, dtype="float64", device="cpu", random_state=3)
    model = XDGMM(K, method, train_score_rows=200, **settings).fit(x, Xcov=S)
    rows = random_rows(len(x), 200, 3).numpy()
    params = (model.weights_, model.means_, model.covariances_)
    on_sample = xd_loglik(x[rows], S[rows], *params).mean()
    assert model.history_[-1]["train_loglik"] == pytest.approx(on_sample, rel=1e-9)
    assert abs(on_sample - xd_loglik(x, S, *params).mean()) > 1e-6  # the sample is not the whole set
    full = XDGMM(K, method, train_score_rows=None, **settings).fit(x, Xcov=S)
    params = (full.weights_, full.means_, full.covariances_)
    assert full.history_[-1]["train_loglik"] == pytest.approx(xd_loglik(x, S, *params).mean(), rel=1e-9)
    np.testing.assert_array_equal(full.means_, model.means_)  # what is scored does not change the fit


@pytest.mark.parametrize("method", ["minibatch_em", "sgd"])
def test_scored_data_held_on_the_device_score_as_read_from_the_host(data, method, monkeypatch):
    """The training sample and the validation set are held on the fit's device in its dtype between
    scorings (``Dataset.resident``): every history figure equals, to the bit, a fit that reads them from
    the host at each scoring (``RESIDENT_BYTES`` 0)."""
    from scalable_xd.data import dataset

    x, S = data
    settings = dict(epochs=2, tol=None, dtype="float32", device="cpu", random_state=3, train_score_rows=200)
    split = len(x) * 3 // 4
    fit = lambda: XDGMM(K, method, **settings).fit(x[:split], Xcov=S[:split], X_val=x[split:], Xcov_val=S[split:])
    held = fit()
    monkeypatch.setattr(dataset, "RESIDENT_BYTES", 0)
    read = fit()
    strip = lambda history: [
        {k: v for k, v in entry.items() if k not in ("seconds", "cpu_seconds")} for entry in history
    ]
    assert strip(held.history_) == strip(read.history_)
