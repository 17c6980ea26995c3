"""Fits in lockstep (``fit.run.lockstep``): the ensemble pass gives each fit the sums of its pass alone and the
batched online-EM rule each fit's update alone, to the bit (the same compiled arithmetic per point and per
component, each fit's blocks summed in the same order); the baton survives a fit that diverges and stops
the others at a fit that fails otherwise, without hanging."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from scalable_xd.data.batching import GatheredOnRead, RowsInMemory
from scalable_xd.fit.rules import arrays, online_em_numba
from scalable_xd.fit.rules.em import FixedParameters
from scalable_xd.fit.run.lockstep import Lockstep, LockstepStopped
from scalable_xd.kernel.ensemble_pass import EnsemblePass
from scalable_xd.kernel.fused import PlainPass

RNG = np.random.default_rng(0)
N, D, FITS, B = 3000, 4, 3, 400


def _mixtures(k: int):
    weights = RNG.uniform(0.5, 1.0, (FITS, k))
    A = RNG.normal(size=(FITS, k, D, D))
    return weights / weights.sum(1, keepdims=True), RNG.normal(size=(FITS, k, D)), A @ A.swapaxes(2, 3) + np.eye(D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [5, 20, 80])  # one fit's pass serial (400 x 5, 400 x 20: 3 x 8,000 pairs
# would be threaded) and threaded (400 x 80)
@pytest.mark.parametrize("missing", [False, True])  # with a fifth of the entries missing: the masked kernel
def test_each_fits_sums_from_the_ensemble_pass_are_those_of_its_pass_alone(dtype, k, missing):
    X = RNG.normal(size=(N, D)) * 2  # float64 rows, cast as read by a float32 pass
    noise = RNG.uniform(0.05, 0.3, (N, D))  # diagonal variances
    observed = RNG.random((N, D)) > 0.2 if missing else None
    if missing:
        X[~observed] = np.nan  # never read
    places = [RowsInMemory(X, noise, RNG.choice(N, B, replace=False).astype(np.int64), observed) for _ in range(FITS)]
    weights, means, cov = _mixtures(k)
    n, failed, q, U, UU, P = EnsemblePass(D, k, dtype).sums(places, weights, means, cov)
    assert n == B and (failed == -1).all() and np.isfinite(P).all()
    alone = PlainPass(D, k, dtype, 10**9)
    for s in range(FITS):
        n_s, *sums = alone.sums(GatheredOnRead(B, places[s], None), weights[s], means[s], cov[s])
        for name, mine, theirs in zip("q U UU P".split(), (q[s], U[s], UU[s], P[s]), sums):
            assert np.array_equal(mine, theirs), (s, name)


def test_batches_of_other_data_or_sizes_do_not_join():
    X = RNG.normal(size=(N, D))
    noise = np.full((N, D), 0.1)
    rows = np.arange(B, dtype=np.int64)
    weights, means, cov = _mixtures(4)
    ensemble = EnsemblePass(D, 4, torch.float64)
    assert (
        ensemble.sums([RowsInMemory(X, noise, rows)] * 2 + [RowsInMemory(X.copy(), noise, rows)], weights, means, cov)
        is None
    )
    assert (
        ensemble.sums([RowsInMemory(X, noise, rows)] * 2 + [RowsInMemory(X, noise, rows[:-1])], weights, means, cov)
        is None
    )
    observed = np.ones((N, D), bool)
    assert (
        ensemble.sums(
            [RowsInMemory(X, noise, rows)] * 2 + [RowsInMemory(X, noise, rows, observed)], weights, means, cov
        )
        is None
    )


@pytest.mark.slow
@pytest.mark.parametrize("data_size", [None, 1e5])
# 70: two lanes' worth, lanes and threads split the components differently than alone; 9: 27 in all, on one thread
@pytest.mark.parametrize("k", [70, 9])
def test_online_em_steps_give_each_fit_its_update_alone(data_size, k):
    weights, means, cov = _mixtures(k)
    q = RNG.uniform(1, 20, (FITS, k))
    U = RNG.normal(size=(FITS, k, D))
    A = RNG.normal(size=(FITS, k, D, D))
    UU = A @ A.swapaxes(2, 3) + 5 * np.eye(D)
    P = 0.2 * UU
    fixed = FixedParameters.none(k, torch.device("cpu"))
    held = torch.zeros(k, dtype=torch.bool)
    held[::7] = True  # some means and covariances held at their values
    fixed = FixedParameters(fixed.weights, held.clone(), held.clone(), fixed.weight_values)
    steps = [0.01, 0.3, 0.9]
    fits = [(steps[s], 1e-3, fixed, data_size, arrays.CachedViews()) for s in range(FITS)]
    states = [(weights[s], means[s], cov[s]) for s in range(FITS)]
    together = online_em_numba.online_em_steps(states, 400.0, (q, U, UU, P), fits)
    for s in range(FITS):
        alone = online_em_numba.online_em_step(
            states[s], 400.0, q[s], U[s], UU[s], P[s], steps[s], 1e-3, fixed, data_size
        )
        for mine, theirs in zip(together[s][0] + together[s][1], alone[0] + alone[1]):
            assert np.array_equal(mine, theirs), s


class _Request:
    """A step that records which fits stepped together."""

    log: list[list[int]] = []

    def __init__(self, index: int):
        self.index = index

    @staticmethod
    def together(requests):
        _Request.log.append([r.index for r in requests])
        return [None] * len(requests)


def _job(steps: int, fail_at: int | None = None, error: type[BaseException] = ValueError):
    def job(member):
        for step in range(steps):
            if step == fail_at:
                raise error(f"fit {member.index} failed at step {step}")
            member.step(_Request(member.index))
        return member.index

    return job


def test_the_fits_step_together_and_a_survivable_failure_leaves_the_others_to_finish():
    _Request.log = []
    results = Lockstep(survivable=(ValueError,)).run([_job(4), _job(4, fail_at=2), _job(3)])
    assert results[0] == 0 and results[2] == 2 and isinstance(results[1], ValueError)
    assert _Request.log == [[0, 1, 2], [0, 1, 2], [0, 2], [0]]


def test_a_failure_that_is_not_survivable_stops_the_others_without_hanging():
    _Request.log = []
    outcome: list = []
    runner = threading.Thread(
        target=lambda: outcome.append(Lockstep().run([_job(50), _job(50, fail_at=3, error=KeyError), _job(50)]))
    )
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "the lockstep hung"
    (results,) = outcome
    assert isinstance(results[1], KeyError)
    assert all(isinstance(results[s], LockstepStopped) and results[s].__cause__ is results[1] for s in (0, 2))
    assert len(_Request.log) <= 4


def test_a_fit_in_lockstep_leaves_torchs_thread_count_as_it_was():
    from scalable_xd import XDGMM

    X = RNG.normal(size=(2000, 2))
    before = torch.get_num_threads()
    XDGMM(3, "minibatch_em", n_init=3, epochs=2, tol=None, random_state=0).fit(X, Xcov=np.full((2000, 2), 0.1))
    assert torch.get_num_threads() == before


def test_fits_passed_by_the_serial_kernel_are_shared_among_threads_with_the_same_sums():
    """Three fits whose pass alone is serial (400 x 5 pairs) but together enough to share: on two threads
    each thread runs the serial kernel on its own fits' batches, and each fit's sums are its pass alone's."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one thread in numba's pool")
    X, noise = RNG.normal(size=(N, D)), RNG.uniform(0.05, 0.3, (N, D))
    places = [RowsInMemory(X, noise, RNG.choice(N, B, replace=False).astype(np.int64)) for _ in range(FITS)]
    weights, means, cov = _mixtures(5)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ensemble = EnsemblePass(D, 5, torch.float32)
        n, failed, *sums = ensemble.sums(places, weights, means, cov)
        assert ensemble._settled(FITS, B, False)[-1] == 2  # two groups of fits, on two threads
        alone = PlainPass(D, 5, torch.float32, 10**9)
        for s in range(FITS):
            _, *theirs = alone.sums(GatheredOnRead(B, places[s], None), weights[s], means[s], cov[s])
            assert all(np.array_equal(mine[s], their) for mine, their in zip(sums, theirs)), s
    finally:
        torch.set_num_threads(threads)


def test_kinds_of_request_posted_together_are_each_taken_by_their_own_function():
    """Fits posting steps and fits posting scorings in the same round: each kind goes to its own
    ``together`` (one fit re-running an epoch alone scores while the others step on)."""

    class _Other(_Request):
        log: list[list[int]] = []

        @staticmethod
        def together(requests):
            _Other.log.append([r.index for r in requests])
            return [None] * len(requests)

    def job(member):
        member.step((_Other if member.index == 1 else _Request)(member.index))
        member.step(_Request(member.index))

    _Request.log, _Other.log = [], []
    Lockstep().run([job, job, job])
    assert _Request.log == [[0, 2], [0, 1, 2]] and _Other.log == [[1]]


def _scoring_problem(seed: int, n: int = 1500, d: int = 3, missing: bool = False):
    from helpers import random_spd

    from scalable_xd.data.dataset import Dataset
    from scalable_xd.mixture import Mixture

    rng = np.random.default_rng(seed)
    X = rng.normal(scale=3.0, size=(n, d)) + 100.0  # far from 0, as magnitudes are
    if missing:
        X[rng.random((n, d)) < 0.2] = np.nan
    data = Dataset(
        X,
        rng.uniform(0.05, 0.5, (n, d)),
        None,
        sample_weight=rng.uniform(0.5, 2.0, n),
        missing="marginalise" if missing else "variance",
    )
    mixtures = []
    for _ in range(3):
        weights = rng.dirichlet(np.ones(4))
        weights[2] = 0.0  # a frozen component: log alpha = -inf
        means = 100.0 + rng.normal(scale=3.0, size=(4, d))
        mixtures.append(Mixture(*(torch.from_numpy(a) for a in (weights, means, random_spd(rng, 4, d)))))
    return data, mixtures


@pytest.mark.parametrize("missing", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_several_mixtures_scored_in_one_pass_give_each_its_score_alone(missing, dtype):
    """``ensemble_total_loglik``: one pass of the three mixtures' components over weighted data (with a
    fifth of the entries missing, a frozen component) gives each mixture its ``total_loglik``: the same
    log-densities, each fit's log-sum-exp taken by torch instead of the kernel, so to float rounding of
    the per-star log-likelihoods (1e-12 relative in float64; float32's pairs, 1e-6)."""
    from scalable_xd.fit.run.scoring import ensemble_total_loglik, total_loglik

    data, mixtures = _scoring_problem(3, missing=missing)
    cpu = torch.device("cpu")
    together = ensemble_total_loglik(data, mixtures, cpu, dtype, "auto")
    alone = [total_loglik(data, m, cpu, dtype, "auto") for m in mixtures]
    np.testing.assert_allclose(together, alone, rtol=1e-12 if dtype == torch.float64 else 1e-6)
    assert len(set(alone)) == 3  # three different mixtures


def test_scorings_posted_together_share_a_pass_by_data_set_and_each_fails_alone():
    """``scores_together``: two fits scoring one data set share a pass, a third scoring another data set is
    scored alone, and a fit whose mixture does not factorise gets its own error, naming the row, while the
    fit beside it gets its score."""
    from scalable_xd.errors import NotPositiveDefiniteError
    from scalable_xd.fit.run import scoring
    from scalable_xd.mixture import Mixture

    data, mixtures = _scoring_problem(4)
    other, _ = _scoring_problem(5)
    cpu = torch.device("cpu")
    shared = []
    original = scoring.ensemble_total_loglik

    def counted(data_set, group, *args):
        shared.append(len(group))
        return original(data_set, group, *args)

    request = lambda d, m: scoring.ScoreRequest(d, m, cpu, torch.float64, "auto")  # noqa: E731
    requests = [request(data, mixtures[0]), request(other, mixtures[1]), request(data, mixtures[2])]
    import unittest.mock

    with unittest.mock.patch.object(scoring, "ensemble_total_loglik", counted):
        assert scoring.scores_together(requests) == [None, None, None]
    assert sorted(shared) == [1, 2]
    for r in requests:
        assert r.total == pytest.approx(scoring.total_loglik(r.data, r.mixture, cpu, torch.float64, "auto"), rel=1e-12)
    broken = Mixture(mixtures[1].weights, mixtures[1].means, -mixtures[1].covariances)  # no Cholesky factor
    requests = [request(data, mixtures[0]), request(data, broken)]
    errors = scoring.scores_together(requests)
    assert errors[0] is None and isinstance(errors[1], NotPositiveDefiniteError) and errors[1].row == 0
    assert requests[0].total == pytest.approx(scoring.total_loglik(data, mixtures[0], cpu, torch.float64, "auto"))


@pytest.mark.parametrize("method", ["minibatch_em", "sgd"])
def test_starts_in_lockstep_that_score_together_score_as_alone(method, monkeypatch):
    """With scoring shared (as on CUDA, here on the CPU), ``n_init`` starts post their epochs' scorings of
    the validation data to the lockstep and share one pass; each start's history equals its seed's fit
    alone to float rounding (the fit's float32 pairs: each star's log-likelihood to float32's rounding, its
    log-sum-exp taken by torch instead of the kernel), and the steps are unchanged (the same parameters to
    the bit)."""
    from scalable_xd import XDGMM
    from scalable_xd.fit.run import scoring

    data, _ = _scoring_problem(6, n=3000)
    X, variances = data.X.numpy(), torch.diagonal(data.noise.batch(slice(None), "cpu", torch.float64), 0, 1, 2)
    X_val, var_val = X[:500], variances[:500].numpy()
    settings = dict(n_components=3, method=method, batch_size=300, epochs=3, tol=None, train_score_rows=None)
    shared = []
    original = scoring.ensemble_total_loglik

    def counted(data_set, group, *args):
        shared.append(len(group))
        return original(data_set, group, *args)

    monkeypatch.setattr(scoring, "shares_scoring", lambda device: True)
    monkeypatch.setattr(scoring, "ensemble_total_loglik", counted)
    monkeypatch.setattr("scalable_xd.fit.loop.shares_scoring", lambda device: True)
    together = XDGMM(random_state=4, n_init=3, **settings).fit(X, Xcov=variances.numpy(), X_val=X_val, Xcov_val=var_val)
    assert shared and all(size == 3 for size in shared)
    monkeypatch.setattr("scalable_xd.fit.loop.shares_scoring", lambda device: False)
    alone = [
        XDGMM(random_state=seed, n_init=1, **settings).fit(X, Xcov=variances.numpy(), X_val=X_val, Xcov_val=var_val)
        for seed in (4, 5, 6)
    ]
    best = alone[together.best_start_]
    for name in ("weights_", "means_", "covariances_"):
        assert np.array_equal(getattr(together, name), getattr(best, name)), name
    for key in ("train_loglik", "val_loglik"):
        np.testing.assert_allclose([h[key] for h in together.history_], [h[key] for h in best.history_], rtol=1e-6)
    np.testing.assert_allclose(together.start_scores_, [a.history_[-1]["val_loglik"] for a in alone], rtol=1e-6)
