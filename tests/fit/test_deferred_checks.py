"""The per-batch path that a GPU runs asks the device nothing (deferred_checks), and a deferred check that
trips gives the fit it would have had with every test made at its batch."""

from functools import partial

import numpy as np
import pytest
import torch
from helpers import draw_xd_data, float32_unfactorisable_problem, kernel_problem, random_spd, rounding_prone_fit
from torch.overrides import TorchFunctionMode

from scalable_xd import XDGMM, deferred_checks
from scalable_xd.data.dataset import Dataset
from scalable_xd.fit import loop
from scalable_xd.fit.run import scoring
from scalable_xd.mixture import Mixture

# Tensor methods that make the host wait for a GPU (or, for a boolean mask, a nonzero inside indexing).
_WAITS = {"item", "tolist", "cpu", "numpy", "nonzero", "masked_select", "unique", "__bool__", "__float__", "__int__"}
_WAITS |= {"__index__"}


class _HostWaits(TorchFunctionMode):
    """Records every torch call that would wait for the device if the tensors were on a GPU (``calls``),
    and the name of every torch call made (``names``)."""

    def __init__(self):
        super().__init__()
        self.calls, self.names = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        self.names.append(name)
        masked = name in ("__getitem__", "__setitem__") and any(
            torch.is_tensor(a) and a.dtype == torch.bool for a in _flatten(args[1:2])
        )
        if name in _WAITS or masked:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _flatten(items):
    for item in items:
        yield from (_flatten(item) if isinstance(item, (tuple, list)) else (item,))


def count_waits_per_epoch(monkeypatch) -> list:
    """A list that gets, for every epoch's batches (``loop._train_epoch``), the calls that would wait."""
    waits_per_epoch = []
    original = loop._train_epoch

    def counted(*args, **kwargs):
        with _HostWaits() as waits:
            original(*args, **kwargs)
        waits_per_epoch.append(waits.calls)

    monkeypatch.setattr(loop, "_train_epoch", counted)
    return waits_per_epoch


def _data(seed=40, n=2000, k=3, d=3):
    rng = np.random.default_rng(seed)
    weights, means, covs = rng.dirichlet(np.ones(k) * 5), rng.normal(scale=4, size=(k, d)), random_spd(rng, k, d)
    x, S, _, _ = draw_xd_data(rng, n, weights, means, covs, 0.1, 0.6)
    return x, S


@pytest.mark.parametrize("method", ["minibatch_em", "sgd"])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_minibatch_epoch_waits_for_the_device_at_no_batch(method, weighted, gpu_path, monkeypatch):
    x, S = _data()
    waits_per_epoch = count_waits_per_epoch(monkeypatch)
    weights = np.random.default_rng(41).uniform(0.5, 2.0, len(x)) if weighted else None
    XDGMM(3, method, n_init=1, batch_size=100, epochs=2, tol=None, backend="unrolled", random_state=0).fit(
        x, Xcov=S, sample_weight=weights
    )
    assert waits_per_epoch == [[], []]  # 20 batches an epoch, and nothing asked of the device in any


def test_a_tripped_check_runs_the_epoch_again_with_every_test_made(gpu_path, monkeypatch, caplog):
    x, S, settings = rounding_prone_fit("minibatch_em", copies=4)
    settings.update(epochs=2, dtype="float32", backend="unrolled")
    with caplog.at_level("DEBUG", logger="scalable_xd.fit"):
        deferred = XDGMM(**settings).fit(x, Xcov=S)
    assert "a deferred check tripped" in caplog.text
    monkeypatch.setattr(deferred_checks, "defers_on", lambda device: False)
    immediate = XDGMM(**settings).fit(x, Xcov=S)
    np.testing.assert_array_equal(deferred.covariances_, immediate.covariances_)
    np.testing.assert_array_equal(deferred.means_, immediate.means_)
    assert np.linalg.eigvalsh(deferred.covariances_).min() > 0


def test_a_zero_weight_batch_under_deferred_checks_makes_no_update(gpu_path, monkeypatch):
    x, S = _data(n=200)
    weights = np.ones(len(x))
    weights[::3] = 0.0  # batches of one star: a third of them weigh nothing
    settings = dict(batch_size=1, epochs=2, tol=None, backend="unrolled", random_state=0)
    deferred = XDGMM(3, "minibatch_em", **settings).fit(x, Xcov=S, sample_weight=weights)
    monkeypatch.setattr(deferred_checks, "defers_on", lambda device: False)
    immediate = XDGMM(3, "minibatch_em", **settings).fit(x, Xcov=S, sample_weight=weights)
    assert np.isfinite(deferred.means_).all()
    np.testing.assert_array_equal(deferred.means_, immediate.means_)
    np.testing.assert_array_equal(deferred.covariances_, immediate.covariances_)


def test_without_trips_deferring_changes_nothing(gpu_path, monkeypatch):
    x, S = _data(seed=42)
    settings = dict(batch_size=200, epochs=2, tol=None, backend="unrolled", random_state=0)
    deferred = XDGMM(3, "sgd", **settings).fit(x, Xcov=S)
    monkeypatch.setattr(deferred_checks, "defers_on", lambda device: False)
    immediate = XDGMM(3, "sgd", **settings).fit(x, Xcov=S)
    np.testing.assert_array_equal(deferred.covariances_, immediate.covariances_)
    assert [h["train_loglik"] for h in deferred.history_] == [h["train_loglik"] for h in immediate.history_]


def _scoring_problem(n: int, fails_in_float32: bool):
    """(data, mixture): n stars and 4 components in 7 dimensions; with ``fails_in_float32``, one component of
    condition number 1e11 and stars of tiny noise, whose V_j + S_i float32 cannot factorise."""
    rng = np.random.default_rng(7)
    problem = float32_unfactorisable_problem if fails_in_float32 else partial(kernel_problem, k=4, d=7)
    x, S, weights, means, covs = problem(rng, n=n)
    return Dataset(x, S), Mixture(*(torch.tensor(a) for a in (weights, means, covs)))


@pytest.mark.parametrize("fails_in_float32", [False, True])
def test_a_scoring_asks_the_device_once_and_a_tripped_check_scores_again(fails_in_float32, gpu_path, monkeypatch):
    """On the GPU's path a scoring of three evaluation batches keeps its sum and its tests on the device and
    asks at the end (whether a test tripped, then the total): two questions, where each batch asked two. A
    float32 pair that cannot be factorised trips the check and the data are scored again with each test
    made at its batch, so the total is the one without deferring (that pair computed in float64)."""
    data, mixture = _scoring_problem(3 * scoring.EVAL_BATCH, fails_in_float32)
    with _HostWaits() as deferred_waits:
        deferred = scoring.total_loglik(data, mixture, "cpu", torch.float32, "unrolled")
    monkeypatch.setattr(deferred_checks, "defers_on", lambda device: False)
    with _HostWaits() as immediate_waits:
        immediate = scoring.total_loglik(data, mixture, "cpu", torch.float32, "unrolled")
    assert deferred == immediate and np.isfinite(deferred)
    assert len(immediate_waits.calls) >= 6  # a test and the sum of each batch
    if fails_in_float32:  # tripped: asked once, then scored again as without deferring
        assert deferred_waits.calls[0] == "__bool__" and len(deferred_waits.calls) > 2
    else:
        assert deferred_waits.calls == ["__bool__", "__float__"]
