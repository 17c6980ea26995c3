"""CPU threads on a shared machine: OpenMP's spin count, and small work kept off the thread pools."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import scalable_xd.fit.starts.mixture
import scalable_xd.kernel.fused
from scalable_xd import XDGMM


def _spincount_after_import(env: dict) -> list[str]:
    code = "import sys, os, scalable_xd; print(os.environ['GOMP_SPINCOUNT'], 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_openmp_spins_briefly_unless_the_environment_says_otherwise():
    """Set on import, before torch (whose OpenMP reads it when it loads); a user's own value is kept."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert _spincount_after_import(env) == ["3000", "False"]
    assert _spincount_after_import({**env, "GOMP_SPINCOUNT": "77"}) == ["77", "False"]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _recording(monkeypatch, module, name, seen):
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: (seen.append(torch.get_num_threads()), real(*a, **k))[1])


def test_cpu_k_means_runs_on_one_thread(two_threads, monkeypatch):
    """Its batches of 500 points are too small for a pool, whose waits stall it 3-4x beside other work."""
    seen = []
    _recording(monkeypatch, scalable_xd.fit.starts.mixture, "minibatch_kmeans", seen)
    x = np.random.default_rng(0).normal(size=(600, 2))
    XDGMM(n_components=3, method="em", n_init=1, epochs=2, device="cpu").fit(x, Xcov=np.zeros((600, 2)))
    assert seen == [1]
    assert torch.get_num_threads() == 2  # restored


@pytest.mark.slow
@pytest.mark.parametrize("k, threads", [(4, 1), (64, 2)])
def test_minibatch_steps_use_the_pool_only_above_parallel_pairs(two_threads, monkeypatch, k, threads):
    """500 stars x K pairs: below ``PARALLEL_PAIRS`` (30,000) a step runs on one thread, above on all."""
    seen = []
    _recording(monkeypatch, scalable_xd.kernel.fused.PlainPass, "sums", seen)  # the loop's pass of plain batches
    x = np.random.default_rng(1).normal(size=(1000, 2))
    XDGMM(n_components=k, method="minibatch_em", n_init=1, epochs=1, batch_size=500, device="cpu").fit(
        x, Xcov=np.zeros((1000, 2))
    )
    assert seen == [threads, threads]
    assert torch.get_num_threads() == 2
