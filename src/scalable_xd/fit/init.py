"""The one initialisation path: k-means weights and means (``kmeans_init``, on ``kmeans_sample`` of data too
large for memory; the workflow's k-means step calls both too), identity covariances, or whatever the user
gives, checked (``initial_mixture``)."""

from __future__ import annotations

import numpy as np
import torch

from .._torch import one_thread
from ..batching import random_rows
from ..dataset import Dataset
from ..mixture import Mixture
from ..settings import KMeansSettings
from .kmeans import minibatch_kmeans, weights_from_counts


def kmeans_init(X: torch.Tensor, n_components: int, kmeans: KMeansSettings, seed: int, device, dtype):
    """Minibatch k-means on X in ``dtype`` on ``device``: weights from the last epoch's counts and the
    centres as means, both float64 on the CPU."""
    with one_thread(torch.device(device).type == "cpu"):  # batches of 500 points: too small for a pool
        centres, counts = minibatch_kmeans(
            X.to(dtype), n_components, epochs=kmeans.epochs, batch_size=kmeans.batch_size, seed=seed, device=device
        )
    return weights_from_counts(counts), centres.to("cpu", torch.float64)


def kmeans_sample(source, max_rows: int, seed: int) -> Dataset:
    """``max_rows`` rows of ``source`` (all of them where it has fewer) chosen by the seed, in memory: what
    k-means sees of data read from disk (the full catalogue's training split does not fit in memory)."""
    return source.sample(random_rows(len(source), max_rows, seed), "the k-means sample")


def _kmeans_points(data: Dataset, k: int):
    """What k-means clusters: the stars with every entry observed where entries are marginalised (and
    there are at least K of them), all of X otherwise."""
    complete = data.complete_X
    return complete if len(complete) >= k else torch.nan_to_num(data.X, nan=0.0)


def initial_mixture(
    data: Dataset,
    n_components: int,
    kmeans: KMeansSettings,
    seed: int,
    device,
    dtype,
    *,
    weights=None,
    means=None,
    covariances=None,
) -> Mixture:
    """The mixture a fit starts from, in float64 on ``device``: the given arrays where there are any,
    k-means for the means (and then the weights) where not, identity covariances by default."""
    k, dim = n_components, data.model_dim
    f64 = torch.float64
    means = None if means is None else torch.as_tensor(np.asarray(means), dtype=f64)
    weights = None if weights is None else torch.as_tensor(np.asarray(weights), dtype=f64)
    if means is None:
        if data.R is not None and data.obs_dim != dim:
            raise ValueError("means_init is required when the projection R changes the dimension")
        kmeans_weights, means = kmeans_init(_kmeans_points(data, k), k, kmeans, seed, device, dtype)
        weights = kmeans_weights if weights is None else weights
    if weights is None:
        weights = torch.ones(k, dtype=f64)
    if covariances is None:
        covariances = torch.eye(dim, dtype=f64).expand(k, dim, dim).clone()
    else:
        covariances = torch.as_tensor(np.asarray(covariances), dtype=f64)
    for name, value, shape in (
        ("weights_init", weights, (k,)),
        ("means_init", means, (k, dim)),
        ("covariances_init", covariances, (k, dim, dim)),
    ):
        if tuple(value.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
        if not torch.isfinite(value).all():
            raise ValueError(f"{name} contains NaN or inf")
    if (weights <= 0).any():
        raise ValueError("weights_init must be positive")
    mixture = Mixture(weights / weights.sum(), means, covariances)
    problem = mixture.first_invalid_component()
    if problem is not None:
        raise ValueError(f"covariances_init component {problem[0]} is not symmetric positive definite")
    return mixture.to(device, f64)  # parameters live in float64 (see ``fitters``)
