"""SQUAREM-accelerated batch EM (fit/families/squarem.py): plain EM's fixed point in a fraction of the passes."""

import numpy as np
import pytest
from helpers import draw_xd_data, random_spd

from scalable_xd import XDGMM


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(50)
    k, d = 6, 3
    weights, means, covs = rng.dirichlet(np.ones(k) * 3), rng.normal(scale=2.5, size=(k, d)), random_spd(rng, k, d)
    x, S, _, _ = draw_xd_data(rng, 6000, weights, means, covs, 0.3, 1.5)
    return x, S


def _fit(data, acceleration, **options):
    settings = dict(
        n_init=1, epochs=6000, tol=1e-10, dtype="float64", device="cpu", random_state=0, acceleration=acceleration
    )
    settings["w_scale"] = "none"  # Bovy et al.'s w I, which ``_objective`` writes out
    x, S = data
    return XDGMM(6, "em", **{**settings, **options}).fit(x, Xcov=S)


def _objective(model, data, w):
    """What Bovy et al.'s EM increases (fit/families/squarem.py): the mean log-likelihood plus the log prior of w."""
    V = model.covariances_
    prior = -0.5 * (np.linalg.slogdet(V)[1].sum() + w * np.trace(np.linalg.inv(V), axis1=1, axis2=2).sum())
    x, S = data
    return model.score(x, Xcov=S) + prior / len(x)


def _assert_same_fit(a, b, rtol):
    order_a, order_b = np.argsort(a.means_[:, 0]), np.argsort(b.means_[:, 0])
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(a, attr)[order_a], getattr(b, attr)[order_b], rtol=rtol, atol=rtol)


@pytest.mark.slow
def test_squarem_reaches_plain_ems_fixed_point_in_a_fraction_of_the_passes(data):
    """Maximum likelihood (w = 0): both run to a gain of 1e-10 nats a star."""
    plain, fast = _fit(data, "none", w=0.0), _fit(data, "squarem", w=0.0)
    assert plain.converged_ and fast.converged_
    assert len(fast.history_) < len(plain.history_) / 5  # every pass is an entry: extrapolations included
    assert fast.history_[-1]["extrapolations"] > 0
    _assert_same_fit(fast, plain, rtol=2e-3)
    x, S = data
    assert fast.score(x, Xcov=S) == pytest.approx(plain.score(x, Xcov=S), abs=1e-7)


@pytest.mark.slow
def test_with_regularisation_squarem_climbs_what_em_climbs(data):
    """With w > 0 EM maximises the likelihood times the prior its update implies, whose ridge is flat:
    plain EM stopped by its log-likelihood gain is still far from its fixed point, which it reaches after
    thousands of iterations more (6,000 here); SQUAREM gets there, judging convergence on that objective."""
    w = 1e-3
    fast = _fit(data, "squarem", w=w, tol=1e-10)
    stopped = _fit(data, "none", w=w)
    plain = _fit(data, "none", w=w, tol=None, epochs=6000)
    assert fast.converged_ and len(fast.history_) < 1500
    _assert_same_fit(fast, plain, rtol=0.02)
    assert _objective(fast, data, w) > _objective(stopped, data, w) + 1e-4
    assert _objective(fast, data, w) > _objective(plain, data, w)  # further up than 6,000 EM iterations


def test_every_cycle_starts_higher_and_only_their_first_steps_judge_convergence(data):
    fast = _fit(data, "squarem", epochs=80, tol=1e-4)
    history = fast.history_
    judged = [i for i, h in enumerate(history) if i > 0 and h["em_step"]]
    gains = [history[i]["train_objective"] - history[i - 1]["train_objective"] for i in judged]
    assert min(gains) > -1e-12  # a cycle's first step is an EM step: the objective never falls
    assert fast.converged_ and judged[-1] == len(history) - 1 and gains[-1] < 1e-4
    assert history[-1]["extrapolations"] > 0


def test_squarem_keeps_fixed_parameters(data):
    rng = np.random.default_rng(51)
    fix = np.array([True, False, False, True, False, False])
    start = dict(
        weights_init=rng.dirichlet(np.ones(6)),
        means_init=data[0][rng.choice(len(data[0]), 6, replace=False)],
        covariances_init=np.stack([np.eye(3)] * 6),
    )
    fast = _fit(data, "squarem", epochs=40, fix_weights=fix, fix_means=fix, fix_covariances=fix[::-1], **start)
    assert fast.history_[-1]["extrapolations"] > 0
    np.testing.assert_allclose(fast.weights_[fix], start["weights_init"][fix], rtol=1e-14)  # normalised once
    np.testing.assert_array_equal(fast.means_[fix], start["means_init"][fix])
    np.testing.assert_array_equal(fast.covariances_[fix[::-1]], start["covariances_init"][fix[::-1]])
    assert fast.weights_.sum() == pytest.approx(1.0, abs=1e-12)


def test_an_invalid_stabilising_step_is_rejected_for_plain_ems_two_steps(data, monkeypatch):
    """Where EM's map at the extrapolated point gives an indefinite covariance (float32 sums of a nearly empty
    component did on the demo's mock at K = 64), the cycle ends at theta2, as for a drop in the objective."""
    from scalable_xd.fit.families import squarem
    from scalable_xd.mixture import Mixture

    end_epoch, update = squarem.SquaremEM.end_epoch, squarem.em_update
    phase, broken = [None], []

    def watched_end_epoch(self):
        phase[0] = self.phase  # 2: the pass scored an extrapolation
        end_epoch(self)

    def indefinite_after_an_extrapolation(scored, sums, w, fixed):
        mapped = update(scored, sums, w, fixed)
        if phase[0] != 2 or broken:
            return mapped
        broken.append(True)
        covariances = mapped.covariances.clone()
        covariances[1] = -covariances[1]
        return Mixture(mapped.weights, mapped.means, covariances)

    monkeypatch.setattr(squarem.SquaremEM, "end_epoch", watched_end_epoch)
    monkeypatch.setattr(squarem, "em_update", indefinite_after_an_extrapolation)
    fast = _fit(data, "squarem", epochs=60, tol=None)  # raised FitDivergedError before
    assert broken and fast.history_[-1]["rejections"] >= 1
    assert np.all(np.linalg.eigvalsh(fast.covariances_) > 0)


def test_an_extrapolation_that_collapses_a_component_is_refused_before_its_pass():
    """A component whose variance EM shrinks 10x and then ~10x again (not quite geometrically) extrapolates
    to exp(-2 * 331): a valid float64 matrix that no pass could factorise. SQUAREM refuses it (theta2 goes
    on, the step bound shrinks) instead of the fit ending as a divergence; a mild step is taken."""
    import torch

    from scalable_xd.fit.families.squarem import SquaremEM
    from scalable_xd.mixture import Mixture

    def model(variance):
        return Mixture(torch.ones(1, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64),
                       torch.diag(torch.tensor([1.0, variance], dtype=torch.float64))[None])  # fmt: skip

    fitter = SquaremEM(model(1.0), w=None)
    fitter.step_max = 1000.0
    assert fitter._extrapolate(model(1.0), model(0.1), model(0.0101)) is None  # alpha = 288
    assert fitter.rejections == 1 and fitter.step_max == 250.0
    fitter.step_max = 2.0
    mild = fitter._extrapolate(model(1.0), model(0.1), model(0.0101))  # alpha = 2: exp(8 (r + v)), r + v ~ -1.146
    assert mild is not None and float(mild.covariances[0, 1, 1]) == pytest.approx(1.0406e-4, rel=1e-3)
    assert fitter.rejections == 1


@pytest.mark.parametrize("acceleration", ["squarem", "none"])
def test_collapsing_noiseless_points_raise_the_named_divergence_with_or_without_squarem(acceleration):
    """Collinear points with almost no noise and w = 0 collapse the components onto their line: SQUAREM
    names the component as plain EM does, instead of torch's LinAlgError from the extrapolation's
    Cholesky factors. Both components collapse onto the one line, so which is caught first is a matter of
    rounding (the order of the pass's sums); the message must name the one the error reports."""
    from scalable_xd import FitDivergedError

    t = np.random.default_rng(0).normal(size=100)
    x = np.c_[t, 2 * t, -t]
    settings = dict(w=0.0, acceleration=acceleration, dtype="float64", random_state=0)
    with pytest.raises(FitDivergedError) as caught:
        XDGMM(2, "em", covariances_init=np.stack([np.eye(3)] * 2), **settings).fit(x, Xcov=np.full(x.shape, 1e-12))
    assert caught.value.component in (0, 1)
    assert f"component {caught.value.component} has a covariance that is not positive definite" in str(caught.value)
