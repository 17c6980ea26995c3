"""Bovy's own test cases for fixed parameters and per-star weights (extreme-deconvolution's tests/test_fix.py
and tests/test_oned.py), their data set-ups regenerated here and run through our batch EM with his
defaults (w = 0, tol 1e-6) and his tolerances: a fixed value stays to 1e-10, a fitted one is within
10 / sqrt(N) (twice or three times that for the wide component, as his tests allow)."""

import numpy as np
import pytest

from scalable_xd import XDGMM

N = 3001
TOL = 10.0 / np.sqrt(N)
AMP = 0.3  # the narrow component's weight in the two-component cases


SETTINGS = {}  # for every case: the acceleration (below)


@pytest.fixture(params=["none", "squarem"], autouse=True)
def acceleration(request, monkeypatch):
    """Every case with plain EM and with SQUAREM, which must reach the same fixed point."""
    monkeypatch.setitem(SETTINGS, "acceleration", request.param)


def _fit(y, ycovar, amp, mean, covar, **fix):
    model = XDGMM(
        len(amp),
        "em",
        epochs=5000,
        w=0.0,
        dtype="float64",
        device="cpu",
        weights_init=amp,
        means_init=mean,
        covariances_init=covar,
        **SETTINGS,
        **fix,
    )
    return model.fit(y, Xcov=ycovar)


def _dual(seed):
    """N(-2, 1) with weight 0.3 and N(1, 4) with weight 0.7, no noise (test_fix.py's dual set-up)."""
    rng = np.random.default_rng(seed)
    wide = rng.binomial(1, 1 - AMP, N).astype(bool)
    y = np.where(wide, rng.normal(size=N) * 2 + 1, rng.normal(size=N) - 2)[:, None]
    return y, np.full((2, 1, 1), 3 * y.var())


def _check_dual(model, fixed_amp=False, fixed_mean=(False, False), fixed_covar=(False, False)):
    for j, (amp, mean, var, slack) in enumerate(((AMP, -2.0, 1.0, 1.0), (1 - AMP, 1.0, 4.0, 2.0))):
        assert abs(model.weights_[j] - amp) < (1e-10 if fixed_amp else TOL)
        assert abs(model.means_[j, 0] - mean) < (1e-10 if fixed_mean[j] else slack * TOL)
        assert abs(model.covariances_[j, 0, 0] - var) < (
            1e-10 if fixed_covar[j] else (slack + (j and fixed_covar[0])) * TOL
        )


def test_fixmean_single_gaussian():
    y = np.random.default_rng(1).normal(size=(N, 1)) + 1.0
    model = _fit(y, None, np.ones(1), np.array([[1.0]]), np.array([[[3 * y.var()]]]), fix_means=True)
    assert model.means_[0, 0] == 1.0 and abs(model.covariances_[0, 0, 0] - 1.0) < TOL


def test_fixcovar_single_gaussian():
    y = np.random.default_rng(2).normal(size=(N, 1)) + 1.0
    model = _fit(y, None, np.ones(1), np.array([[y.mean() + y.std()]]), np.ones((1, 1, 1)), fix_covariances=True)
    assert abs(model.means_[0, 0] - 1.0) < TOL and model.covariances_[0, 0, 0] == 1.0


@pytest.mark.parametrize("fix", [True, np.array([True, False])])  # one fixed of two fixes the other too
def test_fixamp_dual_gaussian(fix):
    y, covar = _dual(3)
    model = _fit(y, None, np.array([AMP, 1 - AMP]), np.array([[-1.0], [2.0]]), covar, fix_weights=fix)
    _check_dual(model, fixed_amp=True)


@pytest.mark.parametrize("fix, start", [(True, 1.0), (np.array([True, False]), 1.5)])
def test_fixmean_dual_gaussian(fix, start):
    y, covar = _dual(4)
    model = _fit(y, None, np.ones(2) / 2, np.array([[-2.0], [start]]), covar, fix_means=fix)
    _check_dual(model, fixed_mean=(True, bool(np.all(fix))))


@pytest.mark.parametrize("fix", [True, np.array([True, False])])
def test_fixcovar_dual_gaussian(fix):
    y, covar = _dual(5)
    covar = np.array([[[1.0]], [[4.0 if np.all(fix) else 3 * y.var()]]])
    model = _fit(y, None, np.ones(2) / 2, np.array([[-1.0], [2.0]]), covar, fix_covariances=fix)
    _check_dual(model, fixed_covar=(True, bool(np.all(fix))))


def test_weights_undo_an_oversampled_half():
    """test_oned.py's weights case: the positive values of the last third are folded over (so > 0 is
    oversampled) and weighted 0.5; with per-star noise the weighted fit recovers N(0, 1)."""
    rng = np.random.default_rng(6)
    y = rng.normal(size=(N, 1))
    y[2001:] = np.abs(y[2001:])
    weight = np.where(y[:, 0] > 0, 0.5, 1.0)
    ycovar = rng.uniform(size=(N, 1))
    y += rng.normal(size=(N, 1)) * np.sqrt(ycovar)
    model = XDGMM(
        1,
        "em",
        epochs=5000,
        w=0.0,
        dtype="float64",
        device="cpu",
        weights_init=np.ones(1),
        means_init=np.array([[y.mean() + y.std()]]),
        covariances_init=np.array([[[3 * y.var()]]]),
        **SETTINGS,
    )
    model.fit(y, Xcov=ycovar, sample_weight=weight)
    assert abs(model.means_[0, 0]) < TOL and abs(model.covariances_[0, 0, 0] - 1.0) < TOL
    unweighted = XDGMM(**model.get_params()).fit(y, Xcov=ycovar)
    assert unweighted.means_[0, 0] > TOL  # without the weights the oversampled half pulls the mean up
