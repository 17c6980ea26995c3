"""The seeds' algorithms beyond the paper's three: stochastic EM's S-step, Polyak averaging, truncation and
Nguyen, Forbes & McLachlan's step sizes, each against a hand computation."""

import numpy as np
import pytest
import torch
from helpers import draw_xd_data, kernel_problem, random_spd

from scalable_xd import XDGMM
from scalable_xd.fit.families.averaging import PolyakAverage
from scalable_xd.fit.families.minibatch_em import MinibatchEM, inside_compact_set
from scalable_xd.fit.methods import METHODS
from scalable_xd.fit.rules.em import regularised
from scalable_xd.fit.rules.online_em import online_em_update
from scalable_xd.kernel.dispatch import batch_statistics
from scalable_xd.mixture import Mixture


def _tensors(*arrays):
    return [torch.tensor(a, dtype=torch.float64) for a in arrays]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["unrolled", "linalg"])
def test_the_s_step_sums_average_to_the_soft_sums(backend):
    """Sampled one-hot assignments: their sums are unbiased for the soft sums, so the expected stochastic-EM
    statistics (and an M-step linear in them) are EM's. 4,000 draws in float64, checked to 5 standard errors."""
    rng = np.random.default_rng(0)
    x, S, weights, means, covs = kernel_problem(rng, n=30, k=4, d=3)
    x, S = _tensors(x, S)
    mixture = Mixture(*_tensors(weights, means, covs))
    soft = batch_statistics(x, S, mixture, backend=backend)
    generator = torch.Generator().manual_seed(1)
    draws = [
        batch_statistics(
            x, S, mixture, backend=backend, uniforms=torch.rand(30, generator=generator, dtype=torch.float64)
        )
        for _ in range(4000)
    ]
    for name in ("q", "U", "UU", "P"):
        values = torch.stack([getattr(d, name) for d in draws])
        mean, stderr = values.mean(0), values.std(0) / np.sqrt(len(draws))
        assert ((mean - getattr(soft, name)).abs() <= 5 * stderr + 1e-12).all(), name
    q = torch.stack([d.q for d in draws])
    assert torch.equal(q.sum(1), torch.full((4000,), 30.0, dtype=torch.float64))  # each star drawn exactly once
    assert set(torch.unique(q - q.round()).tolist()) == {0.0}  # whole stars, not fractions


def test_the_s_step_never_draws_a_component_of_zero_responsibility():
    rng = np.random.default_rng(2)
    x, S, weights, means, covs = kernel_problem(rng, n=200, k=4, d=2)
    weights[2] = 0.0  # a frozen component: log weight -inf, responsibility exactly 0
    x, S = _tensors(x, S)
    uniforms = torch.cat([torch.zeros(100), torch.full((100,), 1.0 - 1e-16)]).double()  # both ends of [0, 1)
    for backend in ("unrolled", "linalg"):
        stats = batch_statistics(x, S, Mixture(*_tensors(weights, means, covs)), backend=backend, uniforms=uniforms)
        assert stats.q[2] == 0 and stats.q.sum() == 200


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(4)
    weights, means, covs = np.array([0.5, 0.3, 0.2]), rng.normal(scale=3, size=(3, 2)), random_spd(rng, 3, 2)
    x, S, _, _ = draw_xd_data(rng, 2000, weights, means, covs, 0.1, 0.3)
    return x, S


@pytest.mark.parametrize("method", ["stochastic_em", "stochastic_minibatch_em"])
def test_stochastic_em_is_seeded_and_near_em(data, method):
    x, S = data
    settings = dict(n_components=3, method=method, epochs=60, batch_size=200, device="cpu", dtype="float64")
    first = XDGMM(**settings, random_state=1).fit(x, Xcov=S)
    again = XDGMM(**settings, random_state=1).fit(x, Xcov=S)
    other = XDGMM(**settings, random_state=2).fit(x, Xcov=S)
    np.testing.assert_array_equal(first.means_, again.means_)
    assert not np.array_equal(first.means_, other.means_)
    em = XDGMM(3, "em", epochs=100, device="cpu", dtype="float64", random_state=1).fit(x, Xcov=S)
    # the stochastic fits wander around EM's optimum by ~1/sqrt(N) per star: within 0.01 nats/star here
    assert abs(first.score(x, Xcov=S) - em.score(x, Xcov=S)) < 0.01
    # tol does not stop it (its log-likelihood wanders); converged_ says whether its mean change a epoch over
    # the last epochs (three for a minibatch method) was within tol, up or down, beyond two standard errors
    # where the changes take both signs,
    # and the last epoch no fall beyond tol and the changes before it
    window = 3 if METHODS[method].per_batch else 1
    gains = np.diff([entry["train_loglik"] for entry in first.history_])[-window:]
    error = gains.std(ddof=1) / window if window > 1 and (gains > 0).any() and (gains <= 0).any() else 0.0
    fell = window > 1 and gains[-1] < -(1e-6 + np.abs(gains[:-1]).max())
    assert len(first.history_) == 61 and first.converged_ == (abs(gains.mean()) < 1e-6 + 2 * error and not fell)


def test_polyak_average_is_the_mean_of_the_iterates_and_leaves_the_updates_alone(data):
    x, S = data
    x, S = _tensors(x, S)
    start = Mixture(
        *_tensors(np.ones(3) / 3, np.array([[0.0, 0.0], [2.0, 1.0], [-2.0, 1.0]]), np.stack([np.eye(2)] * 3))
    )
    settings = dict(
        w=1e-3,
        step_size=0.3,
        schedule="cappe_moulines",
        step_decay=1.0,
        decay_epoch=0,
        kappa=0.6,
        covariance_update="stable",
    )
    plain, averaged = MinibatchEM(start, **settings), PolyakAverage(MinibatchEM(start, **settings))
    iterates = []
    for batch in range(8):
        rows = slice(250 * batch, 250 * (batch + 1))
        plain.observe(batch_statistics(x[rows], S[rows], plain.mixture))
        averaged.observe(batch_statistics(x[rows], S[rows], averaged.mixture))
        iterates.append(plain.result)
        for a, b in zip(
            (plain.mixture.means, plain.mixture.covariances), (averaged.mixture.means, averaged.mixture.covariances)
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # the E-step model is the plain iterate
    for name in ("weights", "means", "covariances"):
        hand = sum(getattr(m, name).numpy() for m in iterates) / len(iterates)
        np.testing.assert_allclose(getattr(averaged.result, name).numpy(), hand, rtol=1e-13, atol=1e-15)


def test_truncation_restarts_when_and_only_when_the_parameters_leave_the_set(data):
    """Walk a truncated fitter and, beside it, the plain update from the same state: each step either leaves
    K_m (then the state is the initial one and m grows) or is kept exactly."""
    x, S = data
    x, S = _tensors(x * 1.5, S)  # spreads of a few units: the first sets (bound 1.5 + m) are too small
    start = Mixture(
        *_tensors(np.ones(3) / 3, np.array([[0.0, 0.0], [1.0, 0.5], [-1.0, 0.5]]), np.stack([np.eye(2)] * 3))
    )
    truncated = MinibatchEM(
        start,
        w=1e-3,
        step_size=0.5,
        schedule="power",
        step_decay=1.0,
        decay_epoch=0,
        kappa=0.6,
        covariance_update="stable",
        truncation=1.5,
    )
    restarts_seen = []
    for batch in range(20):
        rows = slice(100 * batch, 100 * (batch + 1))
        before, m = truncated.state, truncated.restarts
        stats = batch_statistics(x[rows], S[rows], truncated.mixture)
        candidate = online_em_update(before, stats.double(), truncated.step_size(0), 1e-3)
        truncated.observe(stats)
        if inside_compact_set(regularised(candidate, 1e-3), 1.5 + m):
            assert truncated.restarts == m
            # the fitter's compiled update against torch's: the same formula, rounded by two compilers
            # (vector width, fused multiply-adds differ by CPU); a restart would move the means by O(1)
            torch.testing.assert_close(truncated.state.means, candidate.means, rtol=1e-12, atol=1e-14)
        else:
            assert truncated.restarts == m + 1
            assert truncated.state is truncated.initial
            restarts_seen.append(batch)
    assert restarts_seen and restarts_seen[-1] < 19  # it restarted, and the growing sets let it settle


def test_inside_compact_set_checks_each_bound():
    good = Mixture(*_tensors(np.array([0.5, 0.5]), np.zeros((2, 2)), np.stack([np.eye(2)] * 2)))
    assert inside_compact_set(good, 10.0)
    for broken in (
        Mixture(good.weights.new_tensor([0.95, 0.05]), good.means, good.covariances),
        Mixture(good.weights, good.means + 11.0, good.covariances),
        Mixture(good.weights, good.means, good.covariances * 20.0),
        Mixture(good.weights, good.means, good.covariances * 0.05),
    ):
        assert not inside_compact_set(broken, 10.0)


def test_the_power_schedule_is_nguyen_forbes_mclachlans_learning_rate():
    fitter = MinibatchEM(
        Mixture.placeholder(2, 2, "cpu"),
        w=0,
        step_size=1 - 1e-10,
        schedule="power",
        step_decay=0.5,
        decay_epoch=10,
        kappa=0.6,
        covariance_update="stable",
    )
    for r in (1, 2, 10, 1000):
        fitter.n_updates = r - 1
        assert fitter.step_size(0) == pytest.approx((1 - 1e-10) * r**-0.6, rel=1e-15)


def test_truncation_and_averaging_are_recorded_in_the_history(data):
    x, S = data
    model = XDGMM(
        3,
        "minibatch_em",
        epochs=3,
        batch_size=100,
        truncation=True,
        truncation_bound=1.5,
        averaging="polyak",
        device="cpu",
        random_state=0,
    ).fit(x * 1.5, Xcov=S)
    restarts = [h["truncation_restarts"] for h in model.history_]
    assert restarts[0] == 0 and restarts == sorted(restarts) and restarts[-1] > 0


@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_fits_through_the_plain_pass_equal_fits_through_the_general_pass(method, monkeypatch):
    """The loop hands plain batches to ``fused.PlainPass`` (where it can) and the rest to the general
    pass: the fitted model is the same to the bit either way, shuffled batches of 250, float32; and the
    minibatch methods' compiled rules take the same sums as the pass's arrays (``CpuEngine``) or as
    Statistics alike."""
    from scalable_xd.fit.engines import cpu
    from scalable_xd.fit.rules.arrays import sums_of
    from scalable_xd.fit.rules.online_em_numba import OnlineEMArrays
    from scalable_xd.fit.rules.sgd_numba import AdamArrays
    from scalable_xd.kernel.fused import PlainPass
    from scalable_xd.mixture import Mixture

    rng = np.random.default_rng(11)
    weights, means = np.array([0.6, 0.4]), np.array([[0.0, 0.0, 0.0], [4.0, 1.0, -2.0]])
    covs = random_spd(rng, 2, 3)
    X, S = draw_xd_data(rng, 3000, weights, means, covs, 0.1, 0.5)[:2]
    settings = dict(method=method, n_init=1, epochs=2, batch_size=250, tol=None, dtype="float32", random_state=0)
    taken = []
    engine = cpu.engine
    monkeypatch.setattr(cpu, "engine", lambda *args: taken.append(engine(*args)) or taken[-1])
    arrays_taken = []
    for form in (OnlineEMArrays, AdamArrays):
        observe_sums = form.observe_sums
        monkeypatch.setattr(form, "observe_sums", lambda *a, f=observe_sums: arrays_taken.append(f(*a)))
    fast = XDGMM(2, **settings).fit(X, Xcov=S)
    assert len(arrays_taken) == (0 if method == "em" else 2 * 3000 // 250)
    statistics = PlainPass.statistics  # the pass's Statistics, as tensors, then the arrays of them
    monkeypatch.setattr(PlainPass, "sums", lambda self, b, *a: sums_of(statistics(self, b, Mixture.from_arrays(a))))
    as_statistics = XDGMM(2, **settings).fit(X, Xcov=S)
    monkeypatch.setattr(cpu, "engine", lambda *args: None)
    general = XDGMM(2, **settings).fit(X, Xcov=S)
    assert taken and all(p is not None for p in taken)
    for other in (as_statistics, general):
        for name in ("weights_", "means_", "covariances_"):
            assert np.array_equal(getattr(fast, name), getattr(other, name)), name
        assert [h["train_loglik"] for h in fast.history_] == [h["train_loglik"] for h in other.history_]
