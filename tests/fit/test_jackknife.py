"""Jackknife standard errors of the fitted parameters (``XDGMM.parameter_errors``): against the jackknife
computed by hand where the maximum-likelihood parameters have a closed form, and against truth, the spread
of fits over independent draws of the same population."""

import numpy as np
import pytest
from sklearn.exceptions import NotFittedError

from scalable_xd import XDGMM
from scalable_xd.jackknife import _matching

TRUE_WEIGHTS = np.array([0.35, 0.65])
TRUE_MEANS = np.array([[0.0, 0.0], [4.0, 1.0]])
TRUE_COVARIANCES = np.array([[[1.0, 0.3], [0.3, 0.5]], [[0.6, -0.2], [-0.2, 1.2]]])


def _draw(rng, n):
    """n noisy points of the two-component population, each with its own diagonal noise."""
    z = rng.choice(2, size=n, p=TRUE_WEIGHTS)
    v = TRUE_MEANS[z] + np.einsum("nij,nj->ni", np.linalg.cholesky(TRUE_COVARIANCES)[z], rng.normal(size=(n, 2)))
    variances = rng.uniform(0.05, 0.6, size=(n, 2))
    return v + rng.normal(size=(n, 2)) * np.sqrt(variances), variances


def _free_parameters(weights, means, covariances):
    """The 11 free numbers of a two-component mixture in 2-D: one weight, the means, each upper triangle."""
    return np.concatenate([weights[:1], means.ravel(), covariances[:, [0, 0, 1], [0, 1, 1]].ravel()])


def _jackknife(replicates):
    g = len(replicates)
    return np.sqrt((g - 1) / g * ((replicates - replicates.mean(0)) ** 2).sum(0))


@pytest.mark.parametrize("weighted", [False, True])
def test_one_noiseless_gaussian_gives_the_jackknife_of_its_sample_mean_and_covariance(weighted):
    """With K = 1, no noise and no regularisation, each replicate's maximum-likelihood parameters are the
    (weighted) mean and covariance of the rows it keeps: the jackknife follows in numpy."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(300, 2)) * [1e-3, 1e3] + [5.0, -2e3]  # two scales six decades apart
    weights = rng.uniform(0.5, 2.0, 300) if weighted else np.ones(300)
    model = XDGMM(1, tol=1e-12, dtype="float64", w=0.0, random_state=0).fit(X, sample_weight=weights)
    errors = model.parameter_errors(X, sample_weight=weights, n_folds=7, random_state=3)
    assert errors.converged.all() and errors.n_folds == 7
    assert np.bincount(errors.fold).tolist() == [43] * 6 + [42]
    kept = [errors.fold != g for g in range(7)]
    means = np.array([np.average(X[k], axis=0, weights=weights[k]) for k in kept])
    covariances = np.array([np.cov(X[k].T, aweights=weights[k], bias=True) for k in kept])
    # EM iterated to 1e-12 from a start O(1/N) away: the replicates agree with the closed form to 1e-9
    np.testing.assert_allclose(errors.means[0], _jackknife(means), rtol=1e-6)
    np.testing.assert_allclose(errors.covariances[0], _jackknife(covariances), rtol=1e-6)
    np.testing.assert_allclose(errors.replicate_means[:, 0], means, rtol=1e-9, atol=1e-12)
    assert errors.weights[0] == 0.0  # one component: its weight is 1 in every replicate


@pytest.mark.slow
def test_the_errors_match_the_spread_of_fits_over_independent_draws():
    """Coverage: 60 independent draws of 1,000 noisy points, each fitted and jackknifed (10 groups). The
    standard deviation of each fitted parameter across the draws agrees with the mean reported error
    within Monte-Carlo error: with 60 draws the sample deviation scatters by ~9%, so each ratio lies in
    [0.7, 1.4] (over 100 draws they were 0.93-1.14) and their mean within 15% of one."""
    fitted, reported = [], []
    for draw in range(60):
        X, variances = _draw(np.random.default_rng(100 + draw), 1000)
        start = dict(weights_init=TRUE_WEIGHTS, means_init=TRUE_MEANS, covariances_init=TRUE_COVARIANCES)
        model = XDGMM(2, tol=1e-9, dtype="float64", random_state=draw, **start).fit(X, Xcov=variances)
        errors = model.parameter_errors(X, Xcov=variances, n_folds=10, random_state=draw)
        fitted.append(_free_parameters(model.weights_, model.means_, model.covariances_))
        reported.append(_free_parameters(errors.weights, errors.means, errors.covariances))
    ratio = np.std(fitted, axis=0, ddof=1) / np.mean(reported, axis=0)
    assert np.all((ratio > 0.7) & (ratio < 1.4)), ratio
    assert abs(ratio.mean() - 1) < 0.15, ratio


def test_fixed_parameters_have_no_error_and_the_others_do():
    X, variances = _draw(np.random.default_rng(5), 800)
    start = dict(weights_init=TRUE_WEIGHTS, means_init=TRUE_MEANS, covariances_init=TRUE_COVARIANCES)
    model = XDGMM(2, tol=1e-9, dtype="float64", fix_means=[True, False], **start).fit(X, Xcov=variances)
    errors = model.parameter_errors(X, Xcov=variances, n_folds=5, random_state=0)
    assert np.all(errors.means[0] == 0) and np.all(errors.means[1] > 0)
    assert np.all(errors.covariances[:, [0, 1], [0, 1]] > 0)


def test_replicate_components_are_matched_to_the_full_fit_whatever_their_order():
    means = np.array([[0.0, 0.0], [5.0, 0.0], [0.0, 5.0]])
    covariances = np.stack([np.eye(2)] * 3)
    order = _matching(means, covariances, means[[2, 0, 1]] + 0.1)
    np.testing.assert_array_equal(order, [1, 2, 0])


def test_bad_requests_are_refused_naming_what_is_wrong():
    X, variances = _draw(np.random.default_rng(2), 50)
    with pytest.raises(NotFittedError):
        XDGMM(2).parameter_errors(X, Xcov=variances)
    model = XDGMM(1, dtype="float64").fit(X, Xcov=variances)
    with pytest.raises(ValueError, match="n_folds must be an integer >= 2, got 1"):
        model.parameter_errors(X, Xcov=variances, n_folds=1)
    with pytest.raises(ValueError, match="n_folds=51 is more than the 50 rows of X"):
        model.parameter_errors(X, Xcov=variances, n_folds=51)
    with pytest.raises(ValueError, match="tol must be a positive number, got 0"):
        model.parameter_errors(X, Xcov=variances, tol=0)
    with pytest.raises(ValueError, match="sample_weight must have shape \\(50,\\)"):
        model.parameter_errors(X, Xcov=variances, sample_weight=np.ones(49))
    with pytest.raises(TypeError, match="parameter_errors needs X, Xcov, R and sample_weight as arrays"):
        model.parameter_errors(iter([(X, variances)]))
    with pytest.raises(ValueError, match="parameter_errors"):
        model.parameter_errors(X, variances)  # the noise where scikit-learn's y goes
