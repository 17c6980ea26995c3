"""Missing entries marginalised exactly (``missing="marginalise"``): equal to an explicit projection R_i
written out in numpy, and the limit of the paper's variance-1e12 convention (scores less the known
constant per missing entry, parameters to float tolerance)."""

import numpy as np
import pytest
import torch
from helpers import draw_xd_data, random_spd, xd_loglik, xd_pair_posteriors

from scalable_xd import XDGMM
from scalable_xd.data.batching import Batch, RowsInMemory
from scalable_xd.data.missing import MISSING_LOGLIK_CONSTANT, MISSING_VARIANCE
from scalable_xd.fit.engines.reference import ReferenceEngine
from scalable_xd.kernel.dispatch import batch_statistics, log_densities
from scalable_xd.kernel.ensemble_pass import EnsemblePass
from scalable_xd.kernel.fused import PlainPass
from scalable_xd.mixture import Mixture

K, D = 3, 4


@pytest.fixture(scope="module")
def problem():
    """Noisy points with about a quarter of their entries missing (NaN), a few with none observed."""
    rng = np.random.default_rng(21)
    weights, means, covs = np.array([0.5, 0.3, 0.2]), rng.normal(scale=3, size=(K, D)), random_spd(rng, K, D)
    x, S, _, _ = draw_xd_data(rng, 500, weights, means, covs, 0.1, 0.5)
    observed = rng.random(x.shape) > 0.25
    observed[:3] = False  # nothing observed
    x_nan = np.where(observed, x, np.nan)
    init = dict(weights_init=np.full(K, 1 / K), means_init=means + 0.5, covariances_init=covs * 1.5)
    return x_nan, S, observed, init


def _selection(observed_row):
    return np.eye(len(observed_row))[observed_row]


def test_the_kernel_equals_an_explicit_projection_per_star(problem):
    x_nan, S, observed, init = problem
    mixture = Mixture(*(torch.as_tensor(init[k]) for k in ("weights_init", "means_init", "covariances_init")))
    x = torch.as_tensor(np.nan_to_num(x_nan))
    mask = torch.as_tensor(observed)
    loglik, _ = log_densities(x, torch.as_tensor(S), mixture, observed=mask)
    for i in range(len(x)):
        R = _selection(observed[i])
        if not observed[i].any():
            assert loglik[i] == 0.0  # p(x) = 1: nothing was measured
            continue
        want = xd_loglik(
            x_nan[i : i + 1, observed[i]],
            (R @ S[i] @ R.T)[None],
            init["weights_init"],
            init["means_init"],
            init["covariances_init"],
            R[None],
        )[0]
        assert float(loglik[i]) == pytest.approx(want, rel=1e-12)
    stats = batch_statistics(x, torch.as_tensor(S), mixture, observed=mask)
    assert stats.n_points == len(x) and float(stats.q.sum()) == pytest.approx(len(x), rel=1e-12)


def test_one_em_step_equals_the_update_written_out_with_projections(problem):
    x_nan, S, observed, init = problem
    r_all, b_all, B_all = [], [], []
    for i in range(len(x_nan)):  # eq. 4 with R_i dropping the missing entries, one star at a time
        R = _selection(observed[i])
        if observed[i].any():
            r, b, B = xd_pair_posteriors(
                x_nan[i : i + 1, observed[i]],
                (R @ S[i] @ R.T)[None],
                init["weights_init"],
                init["means_init"],
                init["covariances_init"],
                R[None],
            )
        else:  # nothing observed: the prior's responsibilities, means and covariances
            r, b, B = init["weights_init"][None], init["means_init"][None], init["covariances_init"][None]
        r_all.append(r), b_all.append(b), B_all.append(B)
    r, b, B = np.concatenate(r_all), np.concatenate(b_all), np.concatenate(B_all)
    q = r.sum(0)
    means = np.einsum("nk,nkd->kd", r, b) / q[:, None]
    centred = b - means[None]
    covs = (np.einsum("nk,nkd,nke->kde", r, centred, centred) + np.einsum("nk,nkde->kde", r, B)) / q[:, None, None]
    model = XDGMM(K, "em", epochs=1, w=0.0, tol=None, dtype="float64", device="cpu", missing="marginalise", **init).fit(
        x_nan, Xcov=S
    )
    np.testing.assert_allclose(model.weights_, q / q.sum(), rtol=1e-11)
    np.testing.assert_allclose(model.means_, means, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(model.covariances_, covs, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_marginalising_is_the_limit_of_the_variance_convention(problem, method):
    """The same stars with missing entries as value 0, variance 1e12 (the paper) or marginalised: the same
    parameters to float tolerance, and scores that differ by the constant per missing entry."""
    x_nan, S, observed, init = problem
    x_zero = np.nan_to_num(x_nan)
    S_big = S.copy()
    for i, j in zip(*np.nonzero(~observed)):
        S_big[i, j, :], S_big[i, :, j] = 0.0, 0.0
        S_big[i, j, j] = MISSING_VARIANCE
    settings = dict(
        n_components=K,
        method=method,
        epochs=3,
        batch_size=100,
        tol=None,
        dtype="float64",
        device="cpu",
        random_state=4,
        **init,
    )
    convention = XDGMM(**settings).fit(x_zero, Xcov=S_big)
    marginalised = XDGMM(**settings, missing="marginalise").fit(x_zero, Xcov=S_big)  # variance 1e12 marks them
    from_nan = XDGMM(**settings, missing="marginalise").fit(x_nan, Xcov=S)  # and so does NaN
    for name in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(marginalised, name), getattr(convention, name), rtol=1e-7, atol=1e-9)
        np.testing.assert_allclose(getattr(from_nan, name), getattr(marginalised, name), rtol=1e-12, atol=1e-13)
    per_star = ~observed
    expected = convention.score_samples(x_zero, Xcov=S_big) - MISSING_LOGLIK_CONSTANT * per_star.sum(1)
    np.testing.assert_allclose(marginalised.score_samples(x_zero, Xcov=S_big), expected, rtol=1e-9, atol=1e-9)


def test_posteriors_of_stars_with_missing_entries_and_the_errors(problem):
    x_nan, S, observed, init = problem
    model = XDGMM(K, "em", epochs=5, tol=None, dtype="float64", device="cpu", missing="marginalise", **init)
    model.fit(x_nan, Xcov=S)
    mean, cov = model.posterior(x_nan, Xcov=S)
    assert np.isfinite(mean).all() and np.isfinite(cov).all()
    prior_mean = (model.weights_[:, None] * model.means_).sum(0)
    np.testing.assert_allclose(mean[0], prior_mean, rtol=1e-10)  # nothing observed: the prior's mean
    full = observed.all(1)
    assert (np.diagonal(cov[full], axis1=1, axis2=2) < np.diagonal(cov[0])).all()  # data narrow the posterior
    with pytest.raises(ValueError, match=r"X row 0, column \d contains NaN or inf"):
        XDGMM(K, "em", epochs=1, device="cpu", **init).fit(x_nan, Xcov=S)
    with pytest.raises(ValueError, match="unknown missing 'drop'"):
        XDGMM(K, "em", epochs=1, device="cpu", missing="drop").fit(x_nan, Xcov=S)
    S_nan = np.array(S, dtype=np.float64)
    S_nan[0, 0, 0] = np.nan  # marking a missing entry in the noise instead of in X
    with pytest.raises(
        ValueError, match=r"Xcov row 0, entry \(0, 0\) contains NaN or inf; .* marked by NaN in X .*not by NaN in Xcov"
    ):
        XDGMM(K, "em", epochs=1, device="cpu", missing="marginalise", **init).fit(x_nan, Xcov=S_nan)


def test_with_no_complete_star_k_means_starts_among_the_data_of_features_far_from_zero():
    """Twenty features, three tenths of the entries missing, 300 stars: no star has all twenty, so
    k-means clusters every star with its missing entries at their feature's observed mean. The starting
    means then lie among each feature's values; with those entries at 0, features centred at up to
    +-1,000 (spread 1) started up to hundreds away, outside their values."""
    from scalable_xd.data.dataset import Dataset
    from scalable_xd.fit.starts.mixture import initial_mixture
    from scalable_xd.settings import KMeansSettings

    rng = np.random.default_rng(5)
    X = rng.normal(size=(300, 20)) + np.linspace(-1000, 1000, 20)
    X[rng.random(X.shape) < 0.3] = np.nan
    assert not (~np.isnan(X)).all(1).any()
    data = Dataset(X, np.full(X.shape, 0.01), missing="marginalise")
    means = initial_mixture(data, 3, KMeansSettings(), 0, "cpu", torch.float64).means.numpy()
    low, high = np.nanmin(X, 0), np.nanmax(X, 0)
    assert ((means >= low) & (means <= high)).all(), (means - np.nanmean(X, 0)).round(1)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["minibatch_em", "sgd"])
@pytest.mark.parametrize("n_init", [1, 3])  # one fit's plain pass; three in lockstep, one ensemble pass
def test_minibatch_steps_with_missing_entries_take_the_compiled_pass_with_the_general_pass_s_result(
    problem, method, n_init, monkeypatch
):
    """On the CPU every minibatch step of stars with missing entries goes through the fused kernel's plain
    (or ensemble) pass reading the rows in place, never the general pass, and the fit equals, to the bit,
    the fit whose every step the general pass takes (the same compiled masked kernel, the same blocks)."""
    pytest.importorskip("numba")
    x_nan, S, _, _ = problem
    settings = dict(method=method, epochs=2, batch_size=100, tol=None, random_state=4, n_init=n_init)
    general_steps = []
    step = ReferenceEngine.step
    monkeypatch.setattr(ReferenceEngine, "step", lambda self, *args: general_steps.append(1) or step(self, *args))
    fast = XDGMM(K, missing="marginalise", **settings).fit(x_nan, Xcov=S)
    assert general_steps == []
    monkeypatch.setattr(PlainPass, "_pass", lambda self, *args: None)  # every step to the general pass
    monkeypatch.setattr(EnsemblePass, "sums", lambda self, *args: None)
    general = XDGMM(K, missing="marginalise", **settings).fit(x_nan, Xcov=S)
    assert len(general_steps) == n_init * 2 * len(x_nan) // 100
    for name in ("weights_", "means_", "covariances_"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(general, name))


def test_the_plain_pass_reads_missing_entries_in_place_or_gathered_as_the_general_pass(problem):
    """A batch with missing entries through ``PlainPass``: read in place (X keeping its NaN, never read) or
    gathered (x zero there, ``observed`` beside it), its sums are the general pass's to the bit."""
    pytest.importorskip("numba")
    x_nan, S, observed, init = problem
    mixture = Mixture(*(torch.as_tensor(init[k]) for k in ("weights_init", "means_init", "covariances_init")))
    rows = np.random.default_rng(2).permutation(len(x_nan))[:300]
    x, mask = torch.as_tensor(np.nan_to_num(x_nan[rows])), torch.as_tensor(observed[rows])
    want = batch_statistics(x, torch.as_tensor(S[rows]), mixture, observed=mask)
    plain = PlainPass(D, K, torch.float64, max_pairs=1 << 20)
    gathered = Batch(300, x, torch.as_tensor(S[rows]), None, None, mask)
    in_place = Batch(300, None, None, None, None, None, RowsInMemory(x_nan, S, rows, observed))
    for batch in (gathered, in_place):
        got = plain.statistics(batch, mixture)
        for name in ("n_points", "q", "U", "UU", "P", "loglik"):
            assert torch.equal(torch.as_tensor(getattr(got, name)), torch.as_tensor(getattr(want, name))), name
