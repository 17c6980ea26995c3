"""The defaults are right on anyone's data: the same fit whatever units the features are in, enough updates
on a few hundred rows, and at least 90% of the converged optimum on data shapes no single mock covers
(benchmarks/bench_defaults.py, here at its small sizes; the benchmark's JSON has every size)."""

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import random_spd
from sklearn.exceptions import ConvergenceWarning

from scalable_xd import XDGMM
from scalable_xd.fit.methods import METHODS, default_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_defaults  # noqa: E402

UNITS = np.array([1e-4, 1.0, 1e4])


@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_a_change_of_units_changes_nothing_but_the_units(method):
    """Features rescaled by 1e-4, 1 and 1e4 (noise with them) give the same model in the new units: k-means
    on standardised features, each component's starting spread, w relative to each feature's variance and
    SGD in each component's units all follow the features. float64, so that what remains is rounding."""
    X, variances = bench_defaults.data("order_one", 2000)
    settings = dict(n_components=3, method=method, dtype="float64", random_state=0)
    plain = XDGMM(**settings, epochs=5 if method != "em" else None).fit(X, Xcov=variances)
    scaled = XDGMM(**settings, epochs=5 if method != "em" else None).fit(X * UNITS, Xcov=variances * UNITS**2)
    np.testing.assert_allclose(scaled.weights_, plain.weights_, rtol=1e-6)
    np.testing.assert_allclose(scaled.means_ / UNITS, plain.means_, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(scaled.covariances_ / np.outer(UNITS, UNITS), plain.covariances_, rtol=1e-5, atol=1e-9)


def test_the_absolute_w_of_bovy_and_the_paper_stays_available():
    """w_scale="none": W = w I in the features' own units, so a narrow feature is floored at w / (q + 1)."""
    X, variances = bench_defaults.data("mixed_scales", 2000)
    relative = XDGMM(3, "em", dtype="float64", random_state=0).fit(X, Xcov=variances)
    absolute = XDGMM(3, "em", w=1e-3, w_scale="none", dtype="float64", random_state=0).fit(X, Xcov=variances)
    q = absolute.weights_ * len(X)
    assert (absolute.covariances_[:, 0, 0] >= 1e-3 / (q + 1) * (1 - 1e-9)).all()  # feature 0 spreads over 1e-4
    assert relative.covariances_[:, 0, 0].max() < 1e-7  # its own scale: (0.6e-4)^2 ~ 4e-9 and the noise's
    assert relative.score(X, Xcov=variances) > absolute.score(X, Xcov=variances) + 1  # nats per star (1.9 here)


@pytest.mark.parametrize("method", [m for m, row in METHODS.items() if row.per_batch])
def test_a_budget_counts_updates_as_the_batches_fall(method):
    """N // batch_size updates an epoch (a remainder joins the last batch): 894 rows at batch 500 make one
    update an epoch, and the budget gives a minibatch method as many updates on them as on a mock; at 20
    updates an epoch or more it runs no more passes than batch EM's budget. The default batch on 894 rows
    makes 20 updates an epoch, and so does it on as few as 160 rows (a batch of 8)."""
    row = METHODS[method]
    for n in (160, 300, 894, 9_999):
        assert n // default_batch(n) == 20, n
        assert row.budget(n, default_batch(n)) == min(METHODS["em"].epochs, -(-row.min_updates // 20))
    assert default_batch(100) == 8  # fewer updates an epoch below 160 rows, more epochs: the floor of 8 points
    assert row.budget(894, 500) == row.min_updates  # one batch an epoch
    assert row.budget(999, 500) == row.min_updates  # still one: 499 rows join the first batch
    assert row.budget(5_000, 500) == max(row.epochs, -(-row.min_updates // 10))
    assert row.budget(5_000, 250) == min(METHODS["em"].epochs, max(row.epochs, -(-row.min_updates // 20)))
    assert row.budget(10_000_000, 500) == row.epochs
    x, S = bench_defaults.data("order_one", 894)
    model = XDGMM(3, method, random_state=0).fit(x, Xcov=S)
    assert model.n_iter_ == min(METHODS["em"].epochs, -(-row.min_updates // 20))  # epochs of 20 updates


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(bench_defaults.SHAPES))
def test_every_method_at_its_defaults_reaches_90_percent_of_the_optimum_or_says_why(shape):
    """On 500 stars of each shape, each of the paper's methods at its defaults reaches 90% of the converged
    optimum's gain over one Gaussian (log-likelihood of the noisy data, scored by numpy), or warns. The
    optimum here is SQUAREM's converged fit from the methods' own start (seed 0): the test asks whether the
    defaults converge, so each method fits that start alone (``n_init=1``; the default's other starts could
    only raise the score); the benchmark's table takes the best of three starts, local optima included."""
    row = bench_defaults.study(shape, 500, ("em", "minibatch_em", "sgd"), starts=1, n_init=1)
    for method in ("em", "minibatch_em", "sgd"):
        fit = row[method]
        assert "error" not in fit, (shape, method, fit)
        assert fit["share"] >= 0.9 or fit["warning"], (shape, method, fit)


def test_the_stochastic_methods_at_their_defaults_on_mixed_scales():
    row = bench_defaults.study("mixed_scales", 500, ("stochastic_em", "stochastic_minibatch_em"), starts=1, n_init=1)
    for method in ("stochastic_em", "stochastic_minibatch_em"):
        assert row[method]["share"] >= 0.9 or row[method]["warning"], (method, row[method])


def test_the_numpy_score_is_the_library_s():
    X, variances = bench_defaults.data("noise_decades", 300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model = XDGMM(3, "em", epochs=3, dtype="float64", random_state=0).fit(X, Xcov=variances)
    mine = bench_defaults.mean_loglik(X, variances, model.weights_, model.means_, model.covariances_)
    assert mine == pytest.approx(model.score(X, Xcov=variances), rel=1e-10)
    # Full noise covariances (bench_real_peer's form), correlated: the same scorer, the library's score.
    rng = np.random.default_rng(1)
    Xcov = random_spd(rng, len(X), X.shape[1], scale=0.3)
    mine = bench_defaults.mean_loglik(X, Xcov, model.weights_, model.means_, model.covariances_)
    assert mine == pytest.approx(model.score(X, Xcov=Xcov), rel=1e-10)
    # With entries missing, noise matrices score each star's observed entries as its variances do.
    gappy = np.where(rng.random(X.shape) < 0.2, np.nan, X)
    matrices = variances[:, :, None] * np.eye(X.shape[1])
    parameters = (model.weights_, model.means_, model.covariances_)
    as_matrices = bench_defaults.mean_loglik(gappy, matrices, *parameters)
    assert as_matrices == pytest.approx(bench_defaults.mean_loglik(gappy, variances, *parameters), rel=1e-12)
