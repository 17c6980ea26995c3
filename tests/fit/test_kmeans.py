"""Minibatch k-means init against scikit-learn's KMeans on separated clusters."""

import numpy as np
import torch
from sklearn.cluster import KMeans
from test_deferred_checks import _HostWaits

from scalable_xd.fit.starts import kmeans
from scalable_xd.fit.starts.kmeans import minibatch_kmeans


def test_minibatch_kmeans_finds_the_same_clusters_as_sklearn():
    rng = np.random.default_rng(60)
    centres = rng.uniform(-50, 50, size=(8, 3))
    sizes = np.array([500, 1500, 800, 1200, 300, 700, 1000, 2000])
    x = np.vstack([c + rng.normal(size=(n, 3)) for c, n in zip(centres, sizes)])
    ours, counts = minibatch_kmeans(torch.tensor(x), 8, epochs=10, batch_size=500, seed=0)
    reference = KMeans(8, n_init=10, random_state=0).fit(x)
    ours = ours.numpy()
    match = [int(np.argmin(np.linalg.norm(ours - c, axis=1))) for c in reference.cluster_centers_]
    assert sorted(match) == list(range(8))
    np.testing.assert_allclose(ours[match], reference.cluster_centers_, atol=0.1)
    np.testing.assert_array_equal(counts.numpy()[match], np.bincount(reference.labels_, minlength=8))


def test_minibatch_kmeans_is_deterministic_for_a_seed():
    x = torch.tensor(np.random.default_rng(61).normal(size=(2000, 2)))
    a = minibatch_kmeans(x, 10, epochs=3, seed=4)[0]
    b = minibatch_kmeans(x, 10, epochs=3, seed=4)[0]
    assert torch.equal(a, b)


def test_the_batch_loop_asks_the_device_nothing_and_moves_data_a_window_at_a_time(monkeypatch):
    """On an H100 minibatch k-means took 15.7 s for 32,000 batches: each batch was copied to the device
    alone, and CUDA's bincount waits for the device to size its output. Counted here on the CPU: the
    calls that would copy to a GPU or wait for it (k-means++, K waits once a fit, set aside)."""
    monkeypatch.setattr(kmeans, "_kmeans_plus_plus", lambda sample, k, generator: sample[:k].clone())
    x = torch.randn(20_000, 3, generator=torch.Generator().manual_seed(1))
    with _HostWaits() as calls:
        minibatch_kmeans(x, 8, epochs=3, batch_size=100, seed=0)  # 200 batches an epoch, one window
    assert "bincount" not in calls.names
    assert calls.names.count("to") == 1 + 3  # the k-means++ sample, then one window an epoch
    assert len(calls.calls) <= 2 * 3, calls.calls  # an epoch's end asks whether a centre won no point, how many


def test_windows_replayed_as_graphs_give_the_eager_centres(monkeypatch):
    """The CUDA path's order of work, run on the CPU with stand-ins for the graph helpers: the first full
    window warms up, the second is captured and replayed, every later full window replayed, an epoch's
    last window run eagerly; a capture CUDA refuses leaves every window eager. The centres are the eager
    ones to the bit either way."""
    x = torch.randn(200_000, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 10
    eager = minibatch_kmeans(x, 16, epochs=2, batch_size=500, seed=0)
    calls = []

    class Replayed:
        def __init__(self, body):
            self.replay = lambda: (calls.append("replay"), body())

    monkeypatch.setattr(kmeans, "warm_up", lambda device, body: (calls.append("warm"), body()))
    monkeypatch.setattr(kmeans, "captured", lambda body, what: (calls.append("capture"), Replayed(body))[1])
    init = kmeans._Windows.__init__
    monkeypatch.setattr(
        kmeans._Windows, "__init__", lambda self, *args: (init(self, *args), setattr(self, "capturing", True))[0]
    )
    graphed = minibatch_kmeans(x, 16, epochs=2, batch_size=500, seed=0)
    assert calls == ["warm", "capture"] + ["replay"] * 5  # three full windows an epoch, two epochs
    assert torch.equal(graphed[0], eager[0]) and torch.equal(graphed[1], eager[1])
    calls.clear()
    monkeypatch.setattr(kmeans, "captured", lambda body, what: (calls.append("refused"), None)[1])
    refused = minibatch_kmeans(x, 16, epochs=2, batch_size=500, seed=0)
    assert calls == ["warm", "refused"] and torch.equal(refused[0], eager[0])
