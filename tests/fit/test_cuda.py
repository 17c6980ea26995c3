"""On CUDA, every method and kernel agrees with the CPU result to float32 tolerance (skipped without a GPU)."""

import numpy as np
import pytest
import torch
from helpers import draw_xd_data, hard_kernel_problem, max_row_relative_error, random_spd

from scalable_xd import XDGMM
from scalable_xd.kernel.dispatch import batch_statistics
from scalable_xd.mixture import Mixture

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("backend", ["auto", "triton", "compiled", "unrolled"])
@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_cuda_fit_matches_cpu(method, backend):
    rng = np.random.default_rng(70)
    k, d = 4, 3
    x, S, _, _ = draw_xd_data(
        rng, 5000, np.ones(k) / k, rng.normal(scale=4, size=(k, d)), random_spd(rng, k, d), 0.2, 1.0
    )
    init = dict(means_init=x[:k], weights_init=np.ones(k) / k)
    settings = dict(n_components=k, method=method, epochs=3, dtype="float32", random_state=0, **init)
    cpu = XDGMM(device="cpu", **settings).fit(x, Xcov=S)
    gpu = XDGMM(device="cuda", backend=backend, **settings).fit(x, Xcov=S)
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(gpu, attr), getattr(cpu, attr), rtol=2e-3, atol=2e-3)
    assert gpu.score(x, Xcov=S) == pytest.approx(cpu.score(x, Xcov=S), abs=1e-3)


@pytest.mark.parametrize(
    "method, options",
    [
        ("stochastic_em", {}),
        ("stochastic_minibatch_em", {}),
        ("minibatch_em", {"averaging": "polyak"}),
        ("minibatch_em", {"split_merge": True}),
        ("em", {"split_merge": True, "tol": 1e-3}),
    ],
)
def test_cuda_draws_and_moves_match_cpu(method, options):
    """The S-step's uniforms come from a CPU generator, so CUDA draws the same assignments (in float64, where
    no responsibility sits on a rounding boundary); split-and-merge makes the same moves."""
    rng = np.random.default_rng(71)
    k, d = 4, 3
    x, S, _, _ = draw_xd_data(
        rng, 4000, np.ones(k) / k, rng.normal(scale=4, size=(k, d)), random_spd(rng, k, d), 0.2, 1.0
    )
    settings = dict(
        n_components=k, method=method, epochs=4, dtype="float64", random_state=0, means_init=x[:k], **options
    )
    cpu = XDGMM(device="cpu", **settings).fit(x, Xcov=S)
    gpu = XDGMM(device="cuda", **settings).fit(x, Xcov=S)
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(gpu, attr), getattr(cpu, attr), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("backend", ["triton", "unrolled", "compiled"])
def test_cuda_pass_matches_the_cpu_reference_on_hard_inputs(backend):
    x, S, weights, means, covs = hard_kernel_problem(np.random.default_rng(4), n=3000, k=64)
    mixture = Mixture(*(torch.tensor(a) for a in (weights, means, covs)))
    reference = batch_statistics(torch.tensor(x), torch.tensor(S), mixture, backend="linalg")
    args = [torch.tensor(a, dtype=torch.float32, device="cuda") for a in (x, S)]
    fast = batch_statistics(*args, mixture.to("cuda", torch.float32), backend=backend)
    for name in ("q", "U", "UU", "P"):
        got, want = getattr(fast, name).double().cpu().numpy(), getattr(reference, name).numpy()
        assert max_row_relative_error(got, want) < 1e-4, name


@pytest.mark.parametrize("method", ["minibatch_em", "sgd"])
def test_cuda_minibatch_epochs_never_wait_for_the_device_at_a_batch(method, monkeypatch):
    """PyTorch's own detector raises at any synchronising call inside the epochs' batches (the
    evaluation passes, the epoch-end checks and the k-means start are outside them)."""
    from scalable_xd.fit import loop

    original = loop._train_epoch

    def watched(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            original(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(loop, "_train_epoch", watched)
    rng = np.random.default_rng(72)
    x, S, _, _ = draw_xd_data(
        rng, 4000, np.ones(4) / 4, rng.normal(scale=4, size=(4, 3)), random_spd(rng, 4, 3), 0.2, 1.0
    )
    XDGMM(4, method, batch_size=200, epochs=2, tol=None, device="cuda", random_state=0).fit(x, Xcov=S)


@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_a_fit_under_a_selection_on_cuda_matches_the_cpu(method):
    """The removed points are drawn on the host from generators keyed by the batch, and sent to the device:
    the same draws as the CPU fit's, so the same model to float32 tolerance (the graphed step is off)."""
    rng = np.random.default_rng(71)
    x = np.concatenate([rng.normal(size=(3000, 2)), rng.normal(size=(3000, 2)) + [3, 0]])
    kept = x[:, 0] < 3
    S = np.full((int(kept.sum()), 2), 0.05)
    settings = dict(n_components=2, method=method, epochs=3, dtype="float64", random_state=0, tol=None)
    settings.update(acceleration="none", means_init=[[0, 0], [3, 0]], selection="x0 < 3")
    cpu = XDGMM(device="cpu", **settings).fit(x[kept], Xcov=S)
    gpu = XDGMM(device="cuda", **settings).fit(x[kept], Xcov=S)
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(gpu, attr), getattr(cpu, attr), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_a_background_and_noise_mixtures_on_cuda_match_the_cpu(method):
    """The background's density pass and the noise components' rows run on the device: the CPU's model."""
    from scalable_xd import NoiseMixture

    rng = np.random.default_rng(72)
    x = np.concatenate([rng.normal(size=(3000, 2)), rng.normal(size=(3000, 2)) + [3, 0], rng.uniform(-8, 8, (600, 2))])
    S = np.full((len(x), 2), 0.05)
    noise = NoiseMixture(
        np.full((len(x), 2), 0.5), np.stack([S, S], 1), np.stack([-0.1 * np.ones_like(x), 0.1 * np.ones_like(x)], 1)
    )
    settings = dict(n_components=2, method=method, epochs=3, dtype="float64", random_state=0, tol=None)
    settings.update(acceleration="none", means_init=[[0, 0], [3, 0]])
    for extra, Xcov in ((dict(background="auto"), S), ({}, noise)):
        cpu = XDGMM(device="cpu", **settings, **extra).fit(x, Xcov=Xcov)
        gpu = XDGMM(device="cuda", **settings, **extra).fit(x, Xcov=Xcov)
        for attr in ("weights_", "means_", "covariances_", "background_weight_"):
            np.testing.assert_allclose(getattr(gpu, attr), getattr(cpu, attr), rtol=1e-6, atol=1e-8)
