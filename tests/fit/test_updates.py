"""Online-EM covariance updates (stable vs the paper's eq. 6-7) and SGD gradients vs finite differences."""

import numpy as np
import pytest
import torch
from helpers import draw_xd_data, random_spd, rounding_prone_fit, xd_loglik, xd_pair_posteriors

from scalable_xd import XDGMM, FitDivergedError
from scalable_xd.fit.rules.em import regularised
from scalable_xd.fit.rules.online_em import online_em_update, online_em_update_naive
from scalable_xd.fit.rules.sgd import CholeskyParameters
from scalable_xd.kernel.dispatch import batch_statistics
from scalable_xd.mixture import Mixture


def _tensors(*arrays, dtype=torch.float64):
    return [torch.tensor(a, dtype=dtype) for a in arrays]


def _eq6_7(x, S, weights, means, covs, step, w):
    """The paper's eq. 4-7 literally, from an unregularised running state ``covs``: the E-step's per-pair
    b, B use covs + w I; raw sums; the new state is S_hat / q_hat - m m^T (w never enters the sums)."""
    r, b, B = xd_pair_posteriors(x, S, weights, means, covs + w * np.eye(means.shape[1]))
    n = len(x)
    q_b = r.sum(0) / n
    s_b = np.einsum("nk,nkd->kd", r, b) / n
    second_b = (np.einsum("nk,nkd,nke->kde", r, b, b) + np.einsum("nk,nkde->kde", r, B)) / n
    q_hat = (1 - step) * weights + step * q_b
    s_hat = (1 - step) * weights[:, None] * means + step * s_b
    mm = means[:, :, None] * means[:, None, :]
    second_hat = (1 - step) * weights[:, None, None] * (covs + mm) + step * second_b
    new_means = s_hat / q_hat[:, None]
    new_covs = second_hat / q_hat[:, None, None] - new_means[:, :, None] * new_means[:, None, :]
    return q_hat, new_means, new_covs


@pytest.mark.parametrize("update", [online_em_update, online_em_update_naive])
def test_online_updates_equal_paper_equations_in_float64(update):
    rng = np.random.default_rng(20)
    k, d = 4, 3
    weights, means, covs = rng.dirichlet(np.ones(k)), rng.normal(scale=3, size=(k, d)), random_spd(rng, k, d)
    x, S, _, _ = draw_xd_data(rng, 200, weights, means + 0.3, covs * 1.5, 0.2, 1.0)
    state = Mixture(*_tensors(weights, means, covs))
    stats = batch_statistics(*_tensors(x, S), regularised(state, 0.05))
    new = update(state, stats, step=0.3, w=0.05)
    expected = _eq6_7(x, S, weights, means, covs, step=0.3, w=0.05)
    np.testing.assert_allclose(new.weights.numpy(), expected[0], rtol=1e-12)
    np.testing.assert_allclose(new.means.numpy(), expected[1], rtol=1e-11)
    np.testing.assert_allclose(new.covariances.numpy(), expected[2], rtol=1e-8, atol=1e-10)


@pytest.fixture(scope="module")
def far_from_origin():
    """Means ~1e4 times the component spread: float32 cannot hold m m^T to the precision of V."""
    rng = np.random.default_rng(21)
    k, d = 3, 3
    means = 1e4 + rng.normal(scale=5, size=(k, d))
    covs = np.stack([np.diag([1.0, 0.5, 2.0])] * k)
    x, S, _, _ = draw_xd_data(rng, 6000, np.ones(k) / k, means, covs, 0.05, 0.2)
    return x, S, means, covs


def test_stable_update_keeps_float32_covariances_positive_definite(far_from_origin):
    x, S, means, covs = far_from_origin
    k = len(means)
    weights = np.ones(k) / k
    m64 = Mixture(*_tensors(weights, means, np.stack([np.eye(3)] * k)))
    m32 = m64.to(dtype=torch.float32)
    exact = online_em_update(m64, batch_statistics(*_tensors(x[:500], S[:500]), m64), 0.5, 0.0).covariances
    stats32 = batch_statistics(*_tensors(x[:500], S[:500], dtype=torch.float32), m32)
    stable = online_em_update(m32, stats32, 0.5, 0.0).covariances
    naive = online_em_update_naive(m32, stats32, 0.5, 0.0).covariances
    assert torch.linalg.eigvalsh(stable.double()).min() > 0.1
    np.testing.assert_allclose(stable.double().numpy(), exact.numpy(), atol=1e-3)
    # The naive form subtracts m m^T ~ 1e8 with float32 spacing ~8 there: the result is noise.
    assert torch.linalg.eigvalsh(naive.double()).min() < 0 or (naive.double() - exact).abs().max() > 1.0


def test_float32_fit_far_from_the_origin_recovers_the_covariances(far_from_origin):
    x, S, means, covs = far_from_origin
    model = XDGMM(
        3,
        "minibatch_em",
        dtype="float32",
        device="cpu",
        epochs=3,
        step_size=0.05,
        batch_size=200,
        means_init=means,
        random_state=0,
    ).fit(x, Xcov=S)
    assert np.linalg.eigvalsh(model.covariances_).min() > 0.3
    np.testing.assert_allclose(
        np.diagonal(model.covariances_, axis1=1, axis2=2), np.diagonal(covs, axis1=1, axis2=2), rtol=0.35
    )


def test_naive_update_diverges_where_even_float64_runs_out_of_digits():
    """Parameters are updated in float64; with means 1e9 times the spread, m m^T ~ 1e18 has a float64
    spacing of ~128, so eq. 7 loses the covariance entirely while the centred update does not."""
    rng = np.random.default_rng(23)
    means = 1e9 + rng.normal(scale=5, size=(3, 3))
    covs = np.stack([np.diag([1.0, 0.5, 2.0])] * 3)
    x, S, _, _ = draw_xd_data(rng, 6000, np.ones(3) / 3, means, covs, 0.05, 0.2)
    settings = dict(
        n_components=3,
        method="minibatch_em",
        dtype="float64",
        device="cpu",
        epochs=3,
        step_size=0.05,
        batch_size=200,
        means_init=means,
        random_state=0,
    )
    stable = XDGMM(covariance_update="stable", **settings).fit(x, Xcov=S)
    np.testing.assert_allclose(
        np.diagonal(stable.covariances_, axis1=1, axis2=2), np.diagonal(covs, axis1=1, axis2=2), rtol=0.35
    )
    with pytest.raises(FitDivergedError, match="epoch 1"):
        XDGMM(covariance_update="naive", **settings).fit(x, Xcov=S)


@pytest.mark.parametrize("scale", [None, [0.5, 3.0, 20.0]])
def test_sgd_gradients_match_finite_differences(scale):
    rng = np.random.default_rng(22)
    k, d, w = 3, 3, 0.7
    weights, means, covs = rng.dirichlet(np.ones(k)), rng.normal(scale=2, size=(k, d)), random_spd(rng, k, d)
    x, S, _, _ = draw_xd_data(rng, 60, weights, means, covs, 0.3, 1.0)
    s = np.ones(d) if scale is None else np.array(scale)
    params = CholeskyParameters(Mixture(*_tensors(weights, means, covs)), None if scale is None else torch.tensor(s))
    np.testing.assert_allclose(params.mixture().covariances.numpy(), covs, rtol=1e-12)
    stats = batch_statistics(*_tensors(x, S), params.mixture())
    analytic = [g.numpy() for g in params.loss_gradients(stats, w)]
    base = [t.numpy().copy() for t in params.tensors()]

    def loss(values):
        logits, mu, raw = values
        chol = np.tril(raw, -1) + np.einsum("kd,de->kde", np.exp(np.diagonal(raw, axis1=1, axis2=2)), np.eye(d))
        chol = s[:, None] * chol  # L = diag(s) Lt
        cov = chol @ np.transpose(chol, (0, 2, 1))
        alpha = np.exp(logits - np.logaddexp.reduce(logits))
        return -xd_loglik(x, S, alpha, s * mu, cov).sum() + (w / np.trace(cov, axis1=1, axis2=2)).sum()

    eps = 1e-6
    for which, shape in enumerate(t.shape for t in base):
        for flat in range(int(np.prod(shape))):
            index = np.unravel_index(flat, shape)
            if which == 2 and index[1] < index[2]:
                continue  # strictly-upper entries of the Cholesky factor are not parameters
            plus = [b.copy() for b in base]
            minus = [b.copy() for b in base]
            plus[which][index] += eps
            minus[which][index] -= eps
            numeric = (loss(plus) - loss(minus)) / (2 * eps)
            assert analytic[which][index] == pytest.approx(numeric, rel=1e-5, abs=1e-6), (which, index)


@pytest.mark.parametrize("method", ["em", "minibatch_em"])
def test_float32_rounding_cannot_make_a_nearly_singular_scatter_indefinite(method):
    """Float32 sums leave the scatter of a nearly singular component indefinite by rounding (see
    ``helpers.rounding_prone_fit``): the update clips that rounding instead of letting it become a
    negative variance."""
    x, S, settings = rounding_prone_fit(method)
    f32 = XDGMM(dtype="float32", **settings).fit(x, Xcov=S)
    f64 = XDGMM(dtype="float64", **settings).fit(x, Xcov=S)
    assert np.linalg.eigvalsh(f32.covariances_).min() > 0
    np.testing.assert_allclose(f32.covariances_, f64.covariances_, atol=1e-3 * np.abs(f64.covariances_).max())


def test_feature_scale_is_the_mixtures_spread():
    from scalable_xd.fit.rules.sgd import feature_scale

    rng = np.random.default_rng(25)
    weights, means, covs = rng.dirichlet(np.ones(3)), rng.normal(scale=[1.0, 100.0], size=(3, 2)), random_spd(rng, 3, 2)
    labels = rng.choice(3, size=400_000, p=weights)
    draws = means[labels] + np.einsum("nij,nj->ni", np.linalg.cholesky(covs)[labels], rng.normal(size=(400_000, 2)))
    scale = feature_scale(Mixture(*_tensors(weights, means, covs))).numpy()
    np.testing.assert_allclose(scale, draws.std(axis=0), rtol=0.01)


def test_psd_projection_clips_rounding_only():
    from scalable_xd.fit.rules.em import psd

    q, _ = np.linalg.qr(np.random.default_rng(24).normal(size=(3, 3)))
    rounding = torch.tensor((q * np.array([-1e-3, 1.0, 3.0])) @ q.T)  # from V ~ 1e3: rounding-sized
    genuine = torch.tensor((q * np.array([-5.0, 1.0, 3.0])) @ q.T)
    healthy = torch.tensor((q * np.array([1e-3, 1.0, 3.0])) @ q.T)
    V = torch.diag(torch.tensor([1e3, 10.0, 1.0])).expand(3, 3, 3)
    out = psd(torch.stack([rounding, genuine, healthy]), V)
    assert torch.linalg.eigvalsh(out[0]).min() >= -1e-12  # clipped to zero
    np.testing.assert_allclose(out[0].numpy(), rounding.numpy(), atol=2e-3)
    assert torch.linalg.eigvalsh(out[1]).min() < -4  # not rounding: left for the divergence check
    assert torch.equal(out[2], 0.5 * (healthy + healthy.mT))  # positive definite: untouched


def test_online_em_with_the_prior_and_a_unit_step_on_all_data_is_bovys_em_step():
    """online_regularisation="prior": the E-step covariance (c Vr + w I) / (c + 1), c = qhat N, is the one
    batch EM's (sum + w I) / (q + 1) gives, so a unit step over all N points is one of Bovy et al.'s
    regularised EM steps, w > 0 included (the paper's w I after each update is not)."""
    from scalable_xd.fit.rules.em import em_update

    rng = np.random.default_rng(26)
    k, d, w = 4, 3, 0.3
    weights, means, covs = rng.dirichlet(np.ones(k) * 4), rng.normal(scale=3, size=(k, d)), random_spd(rng, k, d)
    x, S, _, _ = draw_xd_data(rng, 500, weights, means + 0.5, covs * 1.4, 0.2, 1.0)
    n = float(len(x))
    count = weights[:, None, None] * n
    running = (covs * (count + 1) - w * np.eye(d)) / count  # the state whose E-step covariance is covs
    state = Mixture(*_tensors(weights, means, running))
    e_step = regularised(state, w, data_size=n)
    np.testing.assert_allclose(e_step.covariances.numpy(), covs, rtol=1e-12)
    stats = batch_statistics(*_tensors(x, S), e_step)
    online = regularised(online_em_update(state, stats, 1.0, w, data_size=n), w, data_size=n)
    bovy = em_update(Mixture(*_tensors(weights, means, covs)), stats, w)
    for name in ("weights", "means", "covariances"):
        np.testing.assert_allclose(getattr(online, name).numpy(), getattr(bovy, name).numpy(), rtol=1e-10)
    paper = regularised(online_em_update(state, stats, 1.0, w), w)
    assert not np.allclose(paper.covariances.numpy(), bovy.covariances.numpy(), rtol=1e-3)
