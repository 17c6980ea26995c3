"""Minibatch k-means init against scikit-learn's KMeans on separated clusters."""

import numpy as np
import torch
from sklearn.cluster import KMeans

from scalable_xd.fit.kmeans import minibatch_kmeans


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
