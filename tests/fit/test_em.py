"""Batch EM and minibatch EM against scikit-learn, the explicit eq. 4-5 update, and each other."""

import numpy as np
import pytest
from helpers import draw_xd_data, random_spd, xd_em_step
from sklearn.mixture import GaussianMixture

from scalable_xd import XDGMM


@pytest.fixture(scope="module")
def noiseless_blobs():
    rng = np.random.default_rng(10)
    k, d = 4, 3
    means = rng.normal(scale=4, size=(k, d))
    x, _, _, _ = draw_xd_data(rng, 3000, rng.dirichlet(5 * np.ones(k)), means, random_spd(rng, k, d), 0, 0)
    init = dict(
        weights_init=np.full(k, 1 / k),
        means_init=x[rng.choice(len(x), k, replace=False)],
        covariances_init=np.stack([np.cov(x.T)] * k),
    )
    return x, init


def test_em_without_noise_follows_sklearn(noiseless_blobs):
    x, init = noiseless_blobs
    k = len(init["weights_init"])
    sk = GaussianMixture(
        k,
        covariance_type="full",
        max_iter=10,
        tol=0.0,
        reg_covar=0.0,
        random_state=0,
        weights_init=init["weights_init"],
        means_init=init["means_init"],
        precisions_init=np.linalg.inv(init["covariances_init"]),
    )
    with pytest.warns(Warning):  # sklearn: did not converge within max_iter
        sk.fit(x)
    ours = XDGMM(k, "em", epochs=10, w=0.0, tol=None, acceleration="none", dtype="float64", device="cpu", **init).fit(
        x, Xcov=None
    )
    np.testing.assert_allclose(ours.weights_, sk.weights_, atol=1e-6)
    np.testing.assert_allclose(ours.means_, sk.means_, atol=1e-6)
    np.testing.assert_allclose(ours.covariances_, sk.covariances_, atol=1e-6)
    assert ours.score(x) == pytest.approx(sk.score(x), abs=1e-6)
    assert ours.n_iter_ == 10


def test_em_step_matches_explicit_bovy_update():
    """With noise and Bovy's regularisation (w > 0), one iteration equals eq. 4-5 written out per pair."""
    rng = np.random.default_rng(11)
    k, d = 3, 2
    means = rng.normal(scale=3, size=(k, d))
    covs = random_spd(rng, k, d)
    x, S, _, _ = draw_xd_data(rng, 300, np.ones(k) / k, means, covs, 0.3, 1.5)
    init = dict(weights_init=np.ones(k) / k, means_init=means + 0.5, covariances_init=covs * 2)
    ours = XDGMM(k, "em", epochs=1, w=0.05, w_scale="none", tol=None, dtype="float64", device="cpu", **init).fit(
        x, Xcov=S
    )
    weights, new_means, new_covs = xd_em_step(x, S, init["weights_init"], init["means_init"], covs * 2, w=0.05)
    np.testing.assert_allclose(ours.weights_, weights, rtol=1e-10)
    np.testing.assert_allclose(ours.means_, new_means, rtol=1e-10)
    np.testing.assert_allclose(ours.covariances_, new_covs, rtol=1e-9)


def test_em_never_decreases_the_loglikelihood():
    rng = np.random.default_rng(12)
    k, d = 5, 3
    x, S, _, _ = draw_xd_data(
        rng, 2000, rng.dirichlet(np.ones(k)), rng.normal(scale=3, size=(k, d)), random_spd(rng, k, d), 0.2, 2.0
    )
    model = XDGMM(
        6, "em", acceleration="none", epochs=40, w=0.0, tol=None, dtype="float64", device="cpu", random_state=0
    ).fit(x, Xcov=S)
    lls = np.array([h["train_loglik"] for h in model.history_])
    assert len(lls) == 41
    assert np.all(np.diff(lls) >= -1e-12 * np.abs(lls[1:]))
    assert lls[-1] > lls[0] + 0.1


def test_em_stops_at_tolerance():
    rng = np.random.default_rng(13)
    x, S, _, _ = draw_xd_data(
        rng, 500, np.ones(2) / 2, np.array([[0.0, 0.0], [6.0, 6.0]]), np.stack([np.eye(2)] * 2), 0.1, 0.3
    )
    model = XDGMM(2, "em", epochs=200, tol=1e-4, dtype="float64", device="cpu", random_state=0).fit(x, Xcov=S)
    assert model.converged_ and model.n_iter_ < 200
    assert model.history_[-1]["train_loglik"] - model.history_[-2]["train_loglik"] < 1e-4


@pytest.mark.slow
def test_minibatch_em_with_unit_step_on_full_batch_is_one_em_iteration():
    rng = np.random.default_rng(14)
    k, d = 4, 3
    x, S, _, _ = draw_xd_data(
        rng, 800, np.ones(k) / k, rng.normal(scale=3, size=(k, d)), random_spd(rng, k, d), 0.2, 1.0
    )
    init = dict(weights_init=np.ones(k) / k, means_init=x[:k], covariances_init=np.stack([np.eye(d)] * k))
    common = dict(epochs=1, w=0.0, dtype="float64", device="cpu", **init)
    em = XDGMM(k, "em", tol=None, **common).fit(x, Xcov=S)
    online = XDGMM(k, "minibatch_em", step_size=1.0, batch_size=len(x), **common).fit(x, Xcov=S)
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(online, attr), getattr(em, attr), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method, acceleration", [("em", "none"), ("em", "squarem"), ("stochastic_em", "none")])
def test_batch_em_makes_one_pass_an_iteration_and_logs_the_score_of_each_iterate(method, acceleration, monkeypatch):
    """Entry e of the history scores the parameters after e updates (checked by scipy on refits stopped
    after e epochs), from the E-step that starts from them: one pass an iteration, one more at the end."""
    from helpers import xd_loglik

    import scalable_xd.fit.engines.reference as reference
    import scalable_xd.fit.run.scoring as scoring
    from scalable_xd.kernel.fused import PlainPass

    rng = np.random.default_rng(12)
    means = rng.normal(scale=3, size=(3, 2))
    x, S, _, _ = draw_xd_data(rng, 400, np.array([0.5, 0.3, 0.2]), means, random_spd(rng, 3, 2), 0.1, 0.5)
    init = dict(weights_init=np.full(3, 1 / 3), means_init=means + 0.7, covariances_init=np.stack([np.eye(2)] * 3))
    settings = dict(n_components=3, method=method, tol=None, dtype="float64", device="cpu", random_state=1, **init)
    settings["acceleration"] = acceleration
    passes = {"E-step": 0, "evaluation": 0}
    real_stats, real_plain, real_dens = reference.batch_statistics, PlainPass.statistics, scoring.log_densities

    def counted(stats):  # an E-step pass, through the plain pass (not None) or the general one
        passes["E-step"] += stats is not None
        return stats

    monkeypatch.setattr(reference, "batch_statistics", lambda *a, **k: counted(real_stats(*a, **k)))
    monkeypatch.setattr(PlainPass, "statistics", lambda *a, **k: counted(real_plain(*a, **k)))
    monkeypatch.setattr(
        scoring,
        "log_densities",
        lambda *a, **k: (passes.update({"evaluation": passes["evaluation"] + 1}), real_dens(*a, **k))[1],
    )
    model = XDGMM(epochs=4, **settings).fit(x, Xcov=S)
    assert passes == {"E-step": 4, "evaluation": 1}  # 400 stars: one chunk a pass
    curve = [h["train_loglik"] for h in model.history_]
    assert curve[0] == pytest.approx(
        xd_loglik(x, S, init["weights_init"], init["means_init"], init["covariances_init"]).mean(), rel=1e-11
    )
    for epochs in range(1, 5):
        stopped = XDGMM(epochs=epochs, **settings).fit(x, Xcov=S)
        independent = xd_loglik(x, S, stopped.weights_, stopped.means_, stopped.covariances_).mean()
        assert curve[epochs] == pytest.approx(independent, rel=1e-11), epochs

    if acceleration == "none" and method == "em":  # convergence: found by the pass that scores the parameters
        passes.update({"E-step": 0, "evaluation": 0})
        converged = XDGMM(**{**settings, "epochs": 200, "tol": 1e-4}).fit(x, Xcov=S)
        n = converged.n_iter_
        curve = [h["train_loglik"] for h in converged.history_]
        assert converged.converged_ and curve[n] - curve[n - 1] < 1e-4 <= curve[n - 1] - curve[n - 2]
        assert passes == {"E-step": n + 1, "evaluation": 0}
        np.testing.assert_array_equal(XDGMM(**{**settings, "epochs": n}).fit(x, Xcov=S).means_, converged.means_)
