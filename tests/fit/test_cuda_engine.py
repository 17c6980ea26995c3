"""The minibatch step that the CUDA engine replays as a CUDA graph (fit.engines.cuda): run on the CPU on its
static buffers, it gives the fit of the ordinary step, waits for the device at no batch, and hands over to
the reference engine where it must (an epoch's last, smaller batch; an epoch run again after a deferred
check tripped). On CUDA it is captured and replayed (skipped without a GPU)."""

import os
from importlib import import_module

import numpy as np
import pytest
import torch
from helpers import draw_xd_data, random_spd, rounding_prone_fit
from test_deferred_checks import count_waits_per_epoch

from scalable_xd import XDGMM, deferred_checks
from scalable_xd.fit import driver
from scalable_xd.fit.engines import cuda
from scalable_xd.fit.rules.sgd import Adam

pytestmark = pytest.mark.slow  # Triton's interpreter on the CPU


@pytest.fixture
def graphed_steps(monkeypatch):
    """Counts the steps the graphed path takes, with graphs asked for on the CPU."""
    monkeypatch.setattr(driver, "graphs_steps", lambda device: True)
    taken = []
    original = cuda.GraphedStep._body

    def counted(self):
        taken.append(self.layout[0])
        original(self)

    monkeypatch.setattr(cuda.GraphedStep, "_body", counted)
    return taken


@pytest.fixture
def triton_update(monkeypatch):
    """Online EM's update as the GPU's graphed step takes it, one Triton kernel (here through Triton's
    interpreter, which tests/conftest.py sets up)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the GPU's kernel on the CPU: needs TRITON_INTERPRET=1 (set where there is no GPU)")
    from scalable_xd.fit.rules import forms

    monkeypatch.setattr(
        forms, "triton_form", lambda rule, device: import_module(f"scalable_xd.fit.rules.{rule}_triton")
    )


def _data(seed=50, n=2050, k=3, d=3):
    rng = np.random.default_rng(seed)
    weights, means, covs = rng.dirichlet(np.ones(k) * 5), rng.normal(scale=4, size=(k, d)), random_spd(rng, k, d)
    x, S, _, _ = draw_xd_data(rng, n, weights, means, covs, 0.1, 0.6)
    return x, S


def _fit_both(monkeypatch, method, fit_kwargs=None, **settings):
    """(graphed, ordinary) fits of the same settings on the GPU's path."""
    x, S = _data()
    settings = dict(
        n_components=3, n_init=1, method=method, batch_size=200, epochs=3, tol=None, backend="unrolled", **settings
    )
    graphed = XDGMM(random_state=0, **settings).fit(x, Xcov=S, **(fit_kwargs or {}))
    monkeypatch.setattr(driver, "graphs_steps", lambda device: False)
    ordinary = XDGMM(random_state=0, **settings).fit(x, Xcov=S, **(fit_kwargs or {}))
    return graphed, ordinary


def _assert_same_fit(a, b, rtol):
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(a, attr), getattr(b, attr), rtol=rtol, atol=0)
    np.testing.assert_allclose(
        [h["train_loglik"] for h in a.history_], [h["train_loglik"] for h in b.history_], rtol=rtol
    )


@pytest.mark.parametrize(
    "method, settings",
    [
        ("minibatch_em", {}),
        ("minibatch_em", {"online_regularisation": "paper", "fix_means": [True, False, False]}),
        ("stochastic_minibatch_em", {}),
        ("sgd", {}),
        ("sgd", {"sgd_scaling": "none", "fix_covariances": [False, True, False]}),
    ],
)
def test_the_graphed_step_gives_the_ordinary_steps_fit(method, settings, gpu_path, graphed_steps, monkeypatch):
    graphed, ordinary = _fit_both(monkeypatch, method, **settings)
    # 2,050 stars in batches of 200: nine an epoch take the graphed step, the last one (250) the ordinary step
    assert graphed_steps == [200] * 27
    _assert_same_fit(graphed, ordinary, rtol=1e-12)


@pytest.mark.parametrize(
    "method, settings",
    [
        ("minibatch_em", {}),
        ("minibatch_em", {"online_regularisation": "paper", "fix_means": [True, False, False]}),
        ("minibatch_em", {"fix_weights": [False, True, False], "fix_covariances": [True, False, False]}),
        ("stochastic_minibatch_em", {}),
        ("sgd", {}),
        ("sgd", {"sgd_scaling": "none", "fix_means": [True, False, False], "fix_covariances": [False, True, False]}),
        ("sgd", {"sgd_scaling": "component", "w": 1e-3}),
    ],
)
def test_the_graphed_step_with_the_triton_update_gives_the_ordinary_steps_fit(
    method, settings, gpu_path, graphed_steps, triton_update, monkeypatch
):
    graphed, ordinary = _fit_both(monkeypatch, method, **settings)
    assert graphed_steps == [200] * 27
    # the kernel and torch sum the 3 x 3 products alike but may contract them differently: each step agrees
    # to ~1e-15, and 27 steps of a contracting map keep that well inside 1e-10
    _assert_same_fit(graphed, ordinary, rtol=1e-10)


def test_weighted_batches_take_the_graphed_step(gpu_path, graphed_steps, monkeypatch):
    weights = np.random.default_rng(51).uniform(0.5, 2.0, 2050)
    graphed, ordinary = _fit_both(monkeypatch, "minibatch_em", {"sample_weight": weights})
    assert len(graphed_steps) == 27
    _assert_same_fit(graphed, ordinary, rtol=1e-12)


def test_fits_the_graph_cannot_take_take_the_ordinary_step(gpu_path, graphed_steps):
    x, S = _data()
    base = dict(batch_size=200, epochs=2, tol=None, backend="unrolled", random_state=0)
    XDGMM(3, "minibatch_em", truncation=True, **base).fit(x, Xcov=S)
    XDGMM(3, "minibatch_em", averaging="polyak", **base).fit(x, Xcov=S)
    XDGMM(3, "sgd", fix_weights=[True, False, False], **base).fit(x, Xcov=S)
    XDGMM(3, "minibatch_em", cuda_graphs=False, **base).fit(x, Xcov=S)
    assert graphed_steps == []


@pytest.mark.parametrize("method", ["minibatch_em", "sgd"])
def test_the_graphed_step_waits_for_the_device_at_no_batch(method, gpu_path, graphed_steps, monkeypatch):
    x, S = _data()
    waits_per_epoch = count_waits_per_epoch(monkeypatch)
    XDGMM(3, method, n_init=1, batch_size=100, epochs=2, tol=None, backend="unrolled", random_state=0).fit(x, Xcov=S)
    assert len(graphed_steps) == 38 and waits_per_epoch == [[], []]


@pytest.mark.parametrize("update", ["torch", "triton"])
def test_a_tripped_check_runs_the_epoch_again_with_ordinary_steps(
    update, gpu_path, graphed_steps, monkeypatch, caplog, request
):
    if update == "triton":
        request.getfixturevalue("triton_update")
    x, S, settings = rounding_prone_fit("minibatch_em", copies=4)
    settings.update(epochs=2, dtype="float32", backend="unrolled")
    with caplog.at_level("DEBUG", logger="scalable_xd.fit"):
        graphed = XDGMM(**settings).fit(x, Xcov=S)
    assert "a deferred check tripped" in caplog.text and graphed_steps
    monkeypatch.setattr(deferred_checks, "defers_on", lambda device: False)
    immediate = XDGMM(**settings).fit(x, Xcov=S)
    np.testing.assert_allclose(graphed.covariances_, immediate.covariances_, rtol=1e-12)
    np.testing.assert_allclose(graphed.means_, immediate.means_, rtol=1e-12)


@pytest.fixture
def ensemble_steps(monkeypatch):
    """Counts the ensemble steps the graphed path takes, by the number of fits in each."""
    taken = []
    original = cuda.GraphedEnsemble._body

    def counted(self):
        taken.append(len(self.engines))
        original(self)

    monkeypatch.setattr(cuda.GraphedEnsemble, "_body", counted)
    return taken


@pytest.fixture
def ensemble_updates(monkeypatch):
    """Whether each ensemble made updates its fits in one launch of the rule's kernels."""
    made = []
    original = cuda.GraphedEnsemble.__init__

    def recorded(self, *args):
        original(self, *args)
        made.append(self.update is not None)

    monkeypatch.setattr(cuda.GraphedEnsemble, "__init__", recorded)
    return made


@pytest.mark.parametrize(
    "method, backend, update",
    [
        ("minibatch_em", "unrolled", "torch"),
        ("sgd", "unrolled", "torch"),
        ("minibatch_em", "triton", "triton"),
        ("sgd", "unrolled", "triton"),
        ("sgd", "triton", "triton"),
    ],
)
def test_starts_in_lockstep_take_one_replayed_step_and_each_ends_as_alone(
    method, backend, update, gpu_path, graphed_steps, ensemble_steps, ensemble_updates, monkeypatch, request
):
    """``n_init`` starts on the GPU's path advance in lockstep, each step one ``GraphedEnsemble`` step for
    the three (here run eagerly on the CPU). Each start ends as its seed's fit alone to float64 rounding: where
    each fit's pass runs in turn and torch updates one at a time, within 1e-12 (the same arithmetic, but
    torch's CPU kernels pick their vector lanes and blocking by the tensors' shapes and the CPU's vector
    width, so three fits stacked and one alone round alike on one CPU and differ by ~1e-14 on another); with
    the triton kernels within 1e-10 after 10 steps (a fit alone takes an epoch's last, smaller batch with
    torch's update)."""
    if update == "triton":
        request.getfixturevalue("triton_update")
    x, S = _data()
    epochs = 3 if backend == "unrolled" else 1  # Triton's interpreter is slow
    settings = dict(n_components=3, method=method, batch_size=200, epochs=epochs, tol=None, backend=backend)
    together = XDGMM(random_state=4, n_init=3, **settings).fit(x, Xcov=S)
    assert ensemble_steps == [3] * 10 * epochs and graphed_steps == []  # an epoch's last batch (250) too
    assert ensemble_updates == [update == "triton"] * 2  # batches of 200 and the last, of 250
    alone = [XDGMM(random_state=seed, n_init=1, **settings).fit(x, Xcov=S) for seed in (4, 5, 6)]
    assert len(graphed_steps) == 3 * 9 * epochs
    scores = [fit.history_[-1]["train_loglik"] for fit in alone]
    best = alone[together.best_start_]
    rtol = 1e-12 if backend == "unrolled" and update == "torch" else 1e-10
    np.testing.assert_allclose(together.start_scores_, scores, rtol=rtol)
    _assert_same_fit(together, best, rtol=rtol)


def test_a_tripped_check_in_lockstep_runs_that_starts_epoch_again(gpu_path, graphed_steps, ensemble_steps, caplog):
    """A start whose deferred check trips in an ensemble step runs its epoch again alone with every test
    made, and ends as it does alone; the others go on together."""
    x, S, settings = rounding_prone_fit("minibatch_em", copies=4)
    settings.update(epochs=2, dtype="float32", backend="unrolled")
    with caplog.at_level("DEBUG", logger="scalable_xd.fit"):
        together = XDGMM(**{**settings, "n_init": 2}).fit(x, Xcov=S)
    assert "a deferred check tripped" in caplog.text and ensemble_steps
    seeds = [settings["random_state"], settings["random_state"] + 1]
    alone = [XDGMM(**{**settings, "random_state": seed}).fit(x, Xcov=S) for seed in seeds]
    np.testing.assert_allclose(together.start_scores_, [a.history_[-1]["train_loglik"] for a in alone], rtol=1e-12)


def test_adams_step_on_the_device_equals_its_host_step():
    rng = np.random.default_rng(52)
    start = [torch.tensor(rng.normal(size=shape)) for shape in ((4,), (4, 3), (4, 3, 3))]
    host, device = Adam([t.clone() for t in start], lr=0.05), Adam([t.clone() for t in start], lr=0.05)
    corrections = torch.zeros(2, dtype=torch.float64)
    for _ in range(30):
        grads = [torch.tensor(rng.normal(size=t.shape)) for t in start]
        host.step(grads)
        device.steps += 1
        corrections.copy_(torch.tensor(device.corrections(), dtype=torch.float64))
        device.step_on_device([g.clone() for g in grads], corrections)
    for a, b in zip(host.params, device.params):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-13, atol=1e-15)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["minibatch_em", "sgd"])
@pytest.mark.parametrize("backend", ["triton", "unrolled"])
def test_cuda_captures_the_step_and_replays_it_to_the_uncaptured_fit(method, backend, monkeypatch):
    replays = []
    original = cuda.GraphedStep.step

    def watched(self, batch, uniforms):
        taken = original(self, batch, uniforms)
        replays.append(self.replays)
        return taken

    monkeypatch.setattr(cuda.GraphedStep, "step", watched)
    x, S = _data()
    settings = dict(n_init=1, batch_size=200, epochs=3, tol=None, device="cuda", backend=backend, dtype="float64")
    captured = XDGMM(3, method, random_state=0, **settings).fit(x, Xcov=S)
    uncaptured = XDGMM(3, method, random_state=0, cuda_graphs=False, **settings).fit(x, Xcov=S)
    assert (
        max(replays) == 27 - 1
    )  # the first full batch warms up; the second is captured and replayed, as is every later one
    _assert_same_fit(captured, uncaptured, rtol=1e-10)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["minibatch_em", "sgd"])
def test_cuda_replays_the_ensemble_step_to_each_starts_fit_alone(method, monkeypatch):
    """Three starts on CUDA: one ensemble step each batch (the full batches' and the last's each warmed up,
    captured, then replayed), each start ending as its seed's captured fit alone, to float rounding."""
    replays = []
    original = cuda.GraphedEnsemble.run
    monkeypatch.setattr(cuda.GraphedEnsemble, "run", lambda self: (original(self), replays.append(self.replays)))
    x, S = _data()
    settings = dict(batch_size=200, epochs=3, tol=None, device="cuda", backend="triton", dtype="float32")
    together = XDGMM(3, method, random_state=0, n_init=3, **settings).fit(x, Xcov=S)
    alone = [XDGMM(3, method, random_state=seed, n_init=1, **settings).fit(x, Xcov=S) for seed in range(3)]
    assert len(replays) == 30 and max(replays) == 27 - 1  # the full batches' ensemble: 27 steps
    np.testing.assert_allclose(together.start_scores_, [a.history_[-1]["train_loglik"] for a in alone], rtol=1e-6)
    _assert_same_fit(together, alone[together.best_start_], rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_captures_again_after_an_epoch_ran_again():
    x, S, settings = rounding_prone_fit("minibatch_em", copies=8)
    settings.update(epochs=3, dtype="float32", backend="unrolled", device="cuda")
    captured = XDGMM(**settings).fit(x, Xcov=S)
    uncaptured = XDGMM(**settings, cuda_graphs=False).fit(x, Xcov=S)
    _assert_same_fit(captured, uncaptured, rtol=1e-10)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kmeans_replays_its_windows_to_the_cpus_centres(monkeypatch):
    """Minibatch k-means on CUDA replays a window of batches as one graph (the first full window eager, the
    second captured): three full windows an epoch over two epochs make five replays. Its centres equal the
    CPU's to float64 rounding (CUDA's index_add_ sums in no fixed order); the clusters are far apart, so no
    point changes its centre."""
    from scalable_xd.fit.starts import kmeans

    replays = []
    original = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: (replays.append(1), original(graph))[1])
    rng = np.random.default_rng(12)
    centres = rng.uniform(-100, 100, size=(16, 3))
    x = torch.tensor(centres[rng.integers(16, size=200_000)] + rng.normal(size=(200_000, 3)))
    cpu, cpu_counts = kmeans.minibatch_kmeans(x, 16, epochs=2, batch_size=500, seed=0)
    gpu, gpu_counts = kmeans.minibatch_kmeans(x, 16, epochs=2, batch_size=500, seed=0, device="cuda")
    assert len(replays) == 5
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-12, atol=1e-10)
    assert torch.equal(gpu_counts.cpu(), cpu_counts)
