"""Fits in lockstep (``fit.lockstep``): the ensemble pass gives each fit the sums of its pass alone and the
batched online-EM rule each fit's update alone, to the bit (the same compiled arithmetic per point and per
component, each fit's blocks summed in the same order); the baton survives a fit that diverges and stops
the others at a fit that fails otherwise, without hanging."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from scalable_xd.data.batching import GatheredOnRead, RowsInMemory
from scalable_xd.fit.engines import cpu_rules
from scalable_xd.fit.lockstep import Lockstep, LockstepStopped
from scalable_xd.fit.updates import FixedParameters
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
    fits = [(steps[s], 1e-3, fixed, data_size, cpu_rules.ArrayViews()) for s in range(FITS)]
    states = [(weights[s], means[s], cov[s]) for s in range(FITS)]
    together = cpu_rules.online_em_steps(states, 400.0, (q, U, UU, P), fits)
    for s in range(FITS):
        alone = cpu_rules.online_em_step(states[s], 400.0, q[s], U[s], UU[s], P[s], steps[s], 1e-3, fixed, data_size)
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
