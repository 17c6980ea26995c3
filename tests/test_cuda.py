"""On CUDA, every method agrees with the CPU result to float32 tolerance (skipped without a GPU)."""

import numpy as np
import pytest
import torch
from helpers import draw_xd_data, random_spd

from scalable_xd import XDGMM

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_cuda_fit_matches_cpu(method):
    rng = np.random.default_rng(70)
    k, d = 4, 3
    x, S, _, _ = draw_xd_data(
        rng, 5000, np.ones(k) / k, rng.normal(scale=4, size=(k, d)), random_spd(rng, k, d), 0.2, 1.0
    )
    init = dict(means_init=x[:k], weights_init=np.ones(k) / k)
    settings = dict(n_components=k, method=method, epochs=3, dtype="float32", random_state=0, **init)
    cpu = XDGMM(device="cpu", **settings).fit(x, S)
    gpu = XDGMM(device="cuda", **settings).fit(x, S)
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(gpu, attr), getattr(cpu, attr), rtol=2e-3, atol=2e-3)
    assert gpu.score(x, S) == pytest.approx(cpu.score(x, S), abs=1e-3)
