"""Engines: a toy engine defined in this test alone runs a fit through ``XDGMM`` (adding a device is one
module and its name in ``engines.ENGINES``, a compiled form of a rule one entry in ``rules.forms``), and each
fit's batches go to the engine its device and settings call for."""

import numpy as np
import pytest
import torch
from helpers import draw_xd_data, random_spd

from scalable_xd import XDGMM, deferred_checks
from scalable_xd.fit import engines
from scalable_xd.fit.rules import forms
from scalable_xd.fit.rules.em import regularised
from scalable_xd.fit.rules.online_em import online_em_update
from scalable_xd.kernel.dispatch import batch_statistics

TAKEN: list[str] = []  # what the toy engine did, in order


class ToyOnlineEM:
    """Online EM's rule as the toy engine 'compiles' it: the torch rule, its results handed back as arrays
    (as the CPU's compiled rules hand theirs)."""

    def __init__(self, fitter):
        self.fitter = fitter

    def observe(self, stats) -> None:
        f = self.fitter
        state = online_em_update(f.state, stats.double(), f.next_step_size(), f.w, f.fixed_parameters, f.data_size)
        f.hold(state.arrays(), regularised(state, f.w, f.fixed, f.data_size).arrays())
        TAKEN.append("rule")


class ToyEngine:
    """Every plain batch through the LAPACK pass, then the fitter's update; the rest to the reference engine."""

    checks = None
    in_place = False

    def __init__(self, fitter, cfg, general):
        self.fitter, self.general = fitter, general

    def step(self, batch, epoch, number, uniforms) -> None:
        if batch.R is not None or batch.observed is not None or uniforms is not None:
            self.general.step(batch, epoch, number, uniforms)
            return
        stats = batch_statistics(batch.x, batch.S, self.fitter.mixture, backend="linalg", point_weights=batch.weights)
        TAKEN.append("step")
        self.fitter.observe(stats)

    def restart(self) -> None:
        return None


def engine(fitter, cfg, general):
    return ToyEngine(fitter, cfg, general) if fitter.rule == "online_em" else None


def toy_form(fitter, device):
    return ToyOnlineEM(fitter) if fitter.rule == "online_em" else None


def _data():
    rng = np.random.default_rng(5)
    weights, means, covs = np.array([0.5, 0.3, 0.2]), rng.normal(scale=4, size=(3, 3)), random_spd(rng, 3, 3)
    return draw_xd_data(rng, 1200, weights, means, covs, 0.1, 0.5)[:2]


@pytest.mark.parametrize("method", ["minibatch_em", "sgd"])
def test_a_toy_engine_defined_in_the_test_alone_runs_the_fits_whose_rule_it_has(method, monkeypatch):
    """Registered alone, the toy engine takes every batch of a minibatch-EM fit (its steps) and its form of
    online EM's rule every update, and the fit equals the reference engine's with the torch rule to float64
    rounding; SGD, whose rule it does not have, runs on the reference engine."""
    x, S = _data()
    settings = dict(method=method, n_init=1, epochs=2, batch_size=200, tol=None, dtype="float64", backend="linalg")
    TAKEN.clear()
    monkeypatch.setattr(engines, "ENGINES", (__name__,))
    monkeypatch.setattr(forms, "compiled", toy_form)
    toy = XDGMM(3, random_state=0, **settings).fit(x, Xcov=S)
    steps = 2 * 1200 // 200
    assert TAKEN == ([] if method == "sgd" else ["step", "rule"] * steps)
    monkeypatch.setattr(engines, "ENGINES", ())
    monkeypatch.setattr(forms, "compiled", lambda fitter, device: None)
    reference = XDGMM(3, random_state=0, **settings).fit(x, Xcov=S)
    for name in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(toy, name), getattr(reference, name), rtol=1e-12, atol=1e-14)


@pytest.mark.slow
def test_each_fit_takes_the_engine_its_device_and_settings_call_for(monkeypatch):
    """On the CPU with the fused kernel, a plain minibatch fit takes the CPU engine, its fitter the compiled
    rule; with the LAPACK kernel, a selection or a background, the reference engine; graphed steps asked for
    (the GPU's default) take the CUDA engine, which hands it the batches of another size."""
    from scalable_xd.fit import driver, loop
    from scalable_xd.fit.engines.cpu import CpuEngine
    from scalable_xd.fit.engines.cuda import CudaEngine
    from scalable_xd.fit.engines.reference import ReferenceEngine
    from scalable_xd.fit.rules.online_em_numba import OnlineEMArrays

    pytest.importorskip("numba")
    chosen = []
    engine_for = loop.engine_for
    monkeypatch.setattr(loop, "engine_for", lambda fitter, cfg: chosen.append(engine_for(fitter, cfg)) or chosen[-1])
    x, S = _data()
    settings = dict(epochs=1, batch_size=200, tol=None)
    XDGMM(3, "minibatch_em", random_state=0, **settings).fit(x, Xcov=S)
    assert isinstance(chosen[-1], CpuEngine) and isinstance(chosen[-1].fitter.compiled, OnlineEMArrays)
    XDGMM(3, "minibatch_em", random_state=0, backend="linalg", **settings).fit(x, Xcov=S)
    assert type(chosen[-1]) is ReferenceEngine
    XDGMM(3, "sgd", random_state=0, background="auto", **settings).fit(x, Xcov=S)
    assert type(chosen[-1]) is ReferenceEngine
    monkeypatch.setattr(driver, "graphs_steps", lambda device: True)
    monkeypatch.setattr(deferred_checks, "defers_on", lambda device: True)
    XDGMM(3, "sgd", random_state=0, **settings).fit(x, Xcov=S)
    assert isinstance(chosen[-1], CudaEngine) and isinstance(chosen[-1].general, ReferenceEngine)
    assert chosen[-1].graphed.device == torch.device("cpu")
