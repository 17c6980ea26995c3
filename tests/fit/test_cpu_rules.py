"""The CPU's compiled forms of the rules (fit/rules/online_em_numba.py, fit/rules/sgd_numba.py) against the
torch rules they replace on the CPU."""

import dataclasses
import pickle
from copy import deepcopy

import numpy as np
import pytest
import torch
from helpers import draw_xd_data, random_spd

pytest.importorskip("numba")

from scalable_xd.fit.families.sgd import SGD  # noqa: E402
from scalable_xd.fit.rules import (  # noqa: E402
    arrays,
    forms,  # noqa: E402
    online_em_numba,
)
from scalable_xd.fit.rules.em import FixedParameters, regularised  # noqa: E402
from scalable_xd.fit.rules.online_em import online_em_update  # noqa: E402
from scalable_xd.fit.rules.sgd import Adam  # noqa: E402
from scalable_xd.kernel.dispatch import batch_statistics  # noqa: E402
from scalable_xd.kernel.statistics import Statistics  # noqa: E402
from scalable_xd.mixture import Mixture  # noqa: E402


def _problem(seed: int, k: int = 5, d: int = 4, n: int = 300):
    rng = np.random.default_rng(seed)
    weights, means, covs = rng.dirichlet(np.ones(k)), rng.normal(scale=3, size=(k, d)), random_spd(rng, k, d)
    x, S, _, _ = draw_xd_data(rng, n, weights, means + 0.4, covs * 1.3, 0.2, 1.0)
    state = Mixture(*(torch.tensor(a) for a in (weights, means, covs)))
    return state, torch.tensor(x), torch.tensor(S)


def _fixed(k: int, weights=(), means=(), covariances=(), values=None) -> FixedParameters:
    def mask(rows):
        m = torch.zeros(k, dtype=torch.bool)
        m[list(rows)] = True
        return m

    values = torch.full((k,), 1.0 / k, dtype=torch.float64) if values is None else values
    return FixedParameters(mask(weights), mask(means), mask(covariances), values)


def _online_em_step(state: Mixture, stats: Statistics, step, w, fixed, data_size=None) -> tuple[Mixture, Mixture]:
    """The compiled online-EM step, which takes and gives arrays, on mixtures and Statistics."""
    new_state, e_step = online_em_numba.online_em_step(
        state.arrays(), *arrays.sums_of(stats), step, w, fixed, data_size
    )
    return Mixture.from_arrays(new_state), Mixture.from_arrays(e_step)


def _assert_mixtures_close(a: Mixture, b: Mixture, rtol: float) -> None:
    for name in ("weights", "means", "covariances"):
        np.testing.assert_allclose(
            getattr(a, name).numpy(), getattr(b, name).numpy(), rtol=rtol, atol=1e-14, err_msg=name
        )


@pytest.mark.parametrize("w, data_size", [(0.0, None), (0.3, None), (0.3, 2000.0), (0.0, 2000.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fixed_rows", [{}, {"means": [0]}, {"weights": [1], "means": [0, 2], "covariances": [2, 3]}])
def test_online_em_step_equals_the_torch_update(w, data_size, dtype, fixed_rows):
    state, x, S = _problem(30)
    fixed = _fixed(5, **fixed_rows, values=state.weights)
    stats = batch_statistics(x.to(dtype), S.to(dtype), regularised(state, w, fixed, data_size))
    stats.q[4] = 0.0  # a component that drew nothing and whose running weight is gone: frozen
    stats.U[4] = stats.UU[4] = stats.P[4] = 0.0
    state.weights[4] = 0.0
    new_state, e_step = _online_em_step(state, stats, 0.2, w, fixed, data_size)
    expected = online_em_update(state, stats.double(), 0.2, w, fixed, data_size)
    _assert_mixtures_close(new_state, expected, rtol=1e-12)
    _assert_mixtures_close(e_step, regularised(expected, w, fixed, data_size), rtol=1e-12)
    assert torch.equal(new_state.covariances[4], state.covariances[4])


@pytest.mark.slow
@pytest.mark.parametrize("k", [online_em_numba.PARALLEL_COMPONENTS + 3, 2 * online_em_numba.PARALLEL_COMPONENTS + 3])
def test_online_em_step_shared_among_threads_equals_the_serial_loop_to_the_bit(monkeypatch, k):
    """From ``PARALLEL_COMPONENTS`` components the update runs in numba's threads, a share of the components
    each (one part a thread, then four from twice as many components): every component's arithmetic is
    unchanged, so the result is the serial loop's, bit for bit."""
    state, x, S = _problem(31, k=k, d=3, n=2000)
    fixed = _fixed(k, means=[0], covariances=[5, 6], values=state.weights)
    stats = batch_statistics(x, S, regularised(state, 0.3, fixed, 5000.0))
    results = {}
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
        results[threads] = _online_em_step(state, stats, 0.2, 0.3, fixed, 5000.0)
    assert online_em_numba._online_em_loop_parallel.signatures  # the threaded loop ran
    for serial, shared in zip(*results.values()):
        for name in ("weights", "means", "covariances"):
            assert torch.equal(getattr(serial, name), getattr(shared, name)), name


def test_online_em_components_are_independent_lanes_to_the_bit():
    """The update runs LANES components side by side: a component's result does not depend on which lane
    or block of lanes it lands in, or on its neighbours, so the components updated in any group are
    those of the whole update, bit for bit; and the whole agrees with the torch update."""
    k = online_em_numba.LANES + 5
    state, x, S = _problem(32, k=k, d=4, n=3000)
    fixed = _fixed(k, means=[1], covariances=[online_em_numba.LANES + 1], values=state.weights)
    stats = batch_statistics(x, S, regularised(state, 0.3, fixed, 5000.0))
    whole, whole_e_step = _online_em_step(state, stats, 0.2, 0.3, fixed, 5000.0)
    expected = online_em_update(state, stats.double(), 0.2, 0.3, fixed, 5000.0)
    _assert_mixtures_close(whole, expected, rtol=1e-12)
    for rows in (torch.tensor([0, 1, 2]), torch.arange(online_em_numba.LANES - 2, k), torch.tensor([k - 1, 4])):
        part_stats = Statistics(stats.n_points, *(getattr(stats, name)[rows] for name in ("q", "U", "UU", "P")))
        part, part_e_step = _online_em_step(
            online_em_numba._rows(state, rows), part_stats, 0.2, 0.3, online_em_numba._rows(fixed, rows), 5000.0
        )
        for name in ("weights", "means", "covariances"):
            assert torch.equal(getattr(part, name), getattr(whole, name)[rows]), (rows, name)
        # the E-step's weights are shared out over all the components (``share_weights``): not compared
        assert torch.equal(part_e_step.covariances, whole_e_step.covariances[rows]), rows


@pytest.mark.slow
def test_online_em_step_clips_rounding_as_the_torch_update_does():
    """Covariance updates built to land exactly on an indefinite matrix: one whose negative eigenvalue is
    rounding-sized (clipped), one whose is not (left for the divergence check), and a healthy one."""
    q, _ = np.linalg.qr(np.random.default_rng(24).normal(size=(3, 3)))
    targets = np.stack([(q * np.array(eig)) @ q.T for eig in ([-1e-3, 1.0, 3.0], [-5.0, 1.0, 3.0], [1e-3, 1.0, 3.0])])
    V = np.diag([1e3, 10.0, 1.0])
    V_inv = np.linalg.inv(V)
    # step 1, w 0, U 0, one point of responsibility 1: the new covariance is V + V (UU - P) V = target
    UU = torch.tensor(np.stack([V_inv @ (t - V) @ V_inv for t in targets]))
    stats = Statistics(1, torch.ones(3), torch.zeros(3, 3), UU, torch.zeros(3, 3, 3))
    state = Mixture(
        torch.full((3,), 1 / 3, dtype=torch.float64),
        torch.zeros(3, 3, dtype=torch.float64),
        torch.tensor(np.stack([V] * 3)),
    )
    new_state, _ = _online_em_step(state, stats, 1.0, 0.0, FixedParameters.none(3))
    expected = online_em_update(state, stats, 1.0, 0.0)
    np.testing.assert_allclose(new_state.covariances.numpy(), expected.covariances.numpy(), rtol=1e-9, atol=1e-9)
    eigenvalues = np.linalg.eigvalsh(new_state.covariances.numpy())
    assert eigenvalues[0, 0] >= -1e-9 and eigenvalues[1, 0] < -4 and eigenvalues[2, 0] > 0


def _sgd_pair(state: Mixture, fixed: FixedParameters | None, scaling: str):
    settings = dict(w=0.2, lr=0.05, lr_decay=0.1, decay_epoch=10, scaling=scaling, fixed=fixed)
    fused, plain = SGD(state, **settings), SGD(state, **settings)
    plain._fused = None  # the torch update and torch.optim.Adam
    for fitter in (fused, plain):
        fitter.start_epoch(0)
    return fused, plain


@pytest.mark.slow
@pytest.mark.parametrize("scaling", ["none", "spread"])
@pytest.mark.parametrize("fixed_rows", [{}, {"weights": [1, 3], "means": [0], "covariances": [2]}])
def test_sgd_step_equals_the_torch_gradient_and_adam(scaling, fixed_rows):
    state, x, S = _problem(31)
    fixed = _fixed(5, **fixed_rows, values=state.weights) if fixed_rows else None
    fused, plain = _sgd_pair(state, fixed, scaling)
    for batch in range(6):
        rows = slice(50 * batch, 50 * batch + 50)
        stats = batch_statistics(x[rows].float(), S[rows].float(), plain.mixture)
        fused.observe(stats)
        plain.observe(stats)
        _assert_mixtures_close(fused.mixture, plain.mixture, rtol=1e-11)
    # One optimiser state for both, so a fit can resume on the other path (a checkpoint, a GPU).
    mine, theirs = fused.optimizer.state_dict(), plain.optimizer.state_dict()
    assert mine["steps"] == theirs["steps"] == 6
    for key in ("exp_avg", "exp_avg_sq"):
        for a, b in zip(mine[key], theirs[key]):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9, atol=1e-300)


def test_array_views_are_made_again_for_replaced_tensors_and_in_copies():
    """The compiled SGD step keeps numpy views of the tensors that live from step to step
    (``CachedViews``): made once, made again where a tensor was replaced, and made afresh in a copy, whose
    tensors and arrays would otherwise be copies sharing no memory (the step would write to neither)."""
    views, make = arrays.CachedViews(), lambda tensors: (tensors[0].numpy(),)
    a = torch.zeros(3)
    first = views((a, None), make)
    assert views((a, None), make) is first
    b = torch.zeros(3)
    assert views((b, None), make)[0] is not first[0]
    for copied_b, copied_views in (deepcopy((b, views)), pickle.loads(pickle.dumps((b, views)))):
        copied_views((copied_b, None), make)[0][0] = 5.0  # as the step writes into its arrays
        assert copied_b[0] == 5.0 and b[0] == 0.0


def test_adam_is_torch_adam_to_the_bit():
    """Our Adam (its step count on the host) against torch.optim.Adam's single-tensor step, the
    learning rate changed between steps as SGD's schedule does."""
    rng = np.random.default_rng(33)
    ours = [torch.tensor(rng.normal(size=shape)) for shape in [(5,), (5, 4), (5, 4, 4)]]
    theirs = [t.clone() for t in ours]
    adam, reference = Adam(ours, lr=0.05), torch.optim.Adam(theirs, lr=0.05, foreach=False)
    for step in range(12):
        if step == 8:
            adam.lr = reference.param_groups[0]["lr"] = 0.005
        grads = [torch.tensor(rng.normal(scale=10.0 ** rng.integers(-6, 3), size=t.shape)) for t in ours]
        adam.step(grads)
        for tensor, grad in zip(theirs, grads):
            tensor.grad = grad.clone()
        reference.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), step


def test_the_compiled_rules_run_on_the_cpu_only_and_not_for_the_naive_update():
    from scalable_xd.fit.families.minibatch_em import MinibatchEM
    from scalable_xd.fit.families.sgd import SGD
    from scalable_xd.fit.rules.online_em_numba import OnlineEMArrays
    from scalable_xd.fit.rules.sgd_numba import AdamArrays

    state = _problem(3)[0]
    settings = dict(w=0.3, step_size=0.2, schedule="step", step_decay=0.5, decay_epoch=10, kappa=0.6)
    online = MinibatchEM(state, covariance_update="stable", **settings)
    adam = SGD(state, w=0.3, lr=0.01, lr_decay=0.1, decay_epoch=10, scaling="none")
    assert isinstance(online.compiled, OnlineEMArrays) and isinstance(adam.compiled, AdamArrays)
    assert MinibatchEM(state, covariance_update="naive", **settings).compiled is None
    assert forms.compiled(online, torch.device("meta")) is None


def test_a_fixed_parameters_copy_answers_for_its_own_masks():
    fixed = _fixed(3, weights=[0])
    assert fixed.has_fixed_weights
    assert not dataclasses.replace(fixed, weights=torch.zeros(3, dtype=torch.bool)).has_fixed_weights


def test_minibatch_em_keeps_the_compiled_steps_arrays_and_makes_their_mixtures_when_asked():
    """Fed sums as arrays (``observe_sums``) minibatch EM holds the update's arrays: its state and E-step
    mixture are the torch update's (to rounding), the E-step's arrays are what the next pass reads, and a
    change of data size (online learning) or of the fixed parameters makes the E-step mixture again from
    the state, as ``regularised`` does."""
    from scalable_xd.fit.families.minibatch_em import MinibatchEM

    state, x, S = _problem(33)
    fixed = _fixed(5, weights=[2], means=[0], values=state.weights)
    settings = dict(w=0.3, step_size=0.2, schedule="step", step_decay=0.5, decay_epoch=10, kappa=0.6)
    fitter = MinibatchEM(state, covariance_update="stable", fixed=fixed, data_size=2000.0, **settings)
    fitter.start_epoch(0)
    stats = batch_statistics(x, S, fitter.mixture)
    fitter.compiled.observe_sums(*arrays.sums_of(stats))
    expected = online_em_update(state, stats.double(), 0.2, 0.3, fixed, 2000.0)
    _assert_mixtures_close(fitter.state, expected, rtol=1e-12)
    _assert_mixtures_close(fitter.mixture, regularised(expected, 0.3, fixed, 2000.0), rtol=1e-12)
    for held, made in zip(fitter.e_step_arrays(), fitter.mixture.tensors()):
        assert np.shares_memory(held, made.numpy())
    fitter.resize(8000.0)
    assert torch.equal(fitter.mixture.covariances, regularised(fitter.state, 0.3, fixed, 8000.0).covariances)
    fitter.release_fixed()
    assert torch.equal(fitter.mixture.weights, regularised(fitter.state, 0.3, None, 8000.0).weights)
