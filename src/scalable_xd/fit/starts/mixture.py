"""The one initialisation path: k-means weights and means (``kmeans_init``, on ``kmeans_sample`` of data too
large for memory; the workflow's k-means step calls both too), each component's covariance from the spread
of its cluster (``cluster_covariances``), or whatever the user gives, checked (``initial_mixture``).

Everything here is the same whatever units the features are in: k-means runs on features divided by their
spread (Euclidean distances in raw units would cluster on the widest feature alone: degrees of right
ascension over milliarcseconds of parallax), and the starting covariances are the clusters' own."""

from __future__ import annotations

import numpy as np
import torch

from ..._torch import one_thread
from ...data.batching import random_rows
from ...data.dataset import Dataset
from ...mixture import Mixture
from ...settings import KMeansSettings
from .kmeans import minibatch_kmeans, weights_from_counts


def feature_spread(
    X: torch.Tensor, observed: torch.Tensor | None = None, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Each feature's standard deviation over its ``observed`` entries (all where None), each point counted
    ``weights`` times (once where None), float64 (D,); 1 where a feature has fewer than two observed
    values or none that differ (no scale to divide by)."""
    X = X.to(torch.float64)
    mask = torch.ones_like(X, dtype=torch.bool) if observed is None else observed
    counted = mask.to(torch.float64) * (1.0 if weights is None else weights.to(torch.float64)[:, None])
    X = torch.where(mask, X, 0.0)
    count = counted.sum(0)
    mean = (counted * X).sum(0) / count.clamp_min(1e-300)
    variance = (counted * (X - mean) ** 2).sum(0) / count.clamp_min(1e-300)
    spread = variance.sqrt()
    return torch.where((mask.sum(0) >= 2) & (spread > 0), spread, torch.ones_like(spread))


def kmeans_init(X: torch.Tensor, n_components: int, kmeans: KMeansSettings, seed: int, device, dtype):
    """Minibatch k-means on X in ``dtype`` on ``device``, each feature in units of its spread: weights from
    the last epoch's counts and the centres as means, both float64 on the CPU."""
    X = X.to(torch.float64)
    centre, scale = X.mean(0), feature_spread(X)  # centred too: a float32 distance of 1e9-sized values is noise
    with one_thread(torch.device(device).type == "cpu"):  # batches of 500 points: too small for a pool
        centres, counts = minibatch_kmeans(
            ((X - centre) / scale).to(dtype),
            n_components,
            epochs=kmeans.epochs,
            batch_size=kmeans.batch_size,
            seed=seed,
            device=device,
        )
    return weights_from_counts(counts), centres.to("cpu", torch.float64) * scale + centre


def cluster_covariances(
    X: torch.Tensor,
    observed: torch.Tensor | None,
    weights: torch.Tensor | None,
    means: torch.Tensor,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Starting covariances (K, D, D), diagonal: each feature's variance about its mean among the points
    nearest it (distances in units of each feature's spread, as k-means measures them; each point counted
    ``weights`` times), as scikit-learn's GaussianMixture starts from its k-means clusters. A feature with
    fewer than two observed values in a cluster takes its variance over all points; every variance is at
    least 1e-6 of that, so that a cluster of identical values does not start singular. The distances run on
    ``device`` (N x K of them: on a GPU, not its host) in float64; the result is on the CPU."""
    X = X.to(torch.float64)
    mask = torch.ones_like(X, dtype=torch.bool) if observed is None else observed
    scale = feature_spread(X, mask, weights)
    k, dim = means.shape
    centre, scale, means = (t.to(device) for t in (means.mean(0), scale, means))
    zeros = torch.zeros(k, dim, dtype=torch.float64, device=device)
    points, counts, squares = zeros.clone(), zeros.clone(), zeros.clone()
    for start in range(0, len(X), 65_536):
        x, m = X[start : start + 65_536].to(device), mask[start : start + 65_536].to(device)
        weight = 1.0 if weights is None else weights[start : start + 65_536].to(device, torch.float64)[:, None]
        centred = (torch.where(m, x, centre) - centre) / scale
        labels = torch.cdist(centred, (means - centre) / scale, compute_mode="donot_use_mm_for_euclid_dist").argmin(1)
        points.index_add_(0, labels, m.to(torch.float64))
        counts.index_add_(0, labels, m.to(torch.float64) * weight)
        squares.index_add_(0, labels, torch.where(m, x - means[labels], 0.0) ** 2 * weight)
    overall = scale**2
    variances = torch.where((points >= 2) & (counts > 0), squares / counts.clamp_min(1e-300), overall)
    return torch.diag_embed(torch.maximum(variances, 1e-6 * overall)).cpu()


def kmeans_sample(source, max_rows: int, seed: int) -> Dataset:
    """``max_rows`` rows of ``source`` (all of them where it has fewer) chosen by the seed, in memory: what
    k-means sees of data read from disk (the full catalogue's training split does not fit in memory)."""
    return source.sample(random_rows(len(source), max_rows, seed), "the k-means sample")


def _kmeans_points(data: Dataset, k: int):
    """What k-means clusters: the stars with every entry observed where entries are marginalised (and
    there are at least K of them), else every star with its missing entries at their feature's mean over
    the observed ones (0 in the features' own units would sit far from data centred away from 0: a
    magnitude of 15, a parallax of 1e3); all of X without marginalised entries."""
    complete, observed = data.complete_X, data.observed
    if observed is None or len(complete) >= k:
        return complete
    X = data.X.to(torch.float64)
    counts = observed.sum(0).clamp_min(1)
    means = torch.where(observed, X, 0.0).sum(0) / counts
    return torch.where(observed, X, means)


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
    """The mixture a fit starts from, in float64 on ``device``: the given arrays where there are any (checked
    before any k-means runs, ``given_start``), k-means for the means (and then the weights) where not, and
    covariances from the spread of the points nearest each mean (``cluster_covariances``; identity where R
    projects the model onto fewer features)."""
    k, dim = n_components, data.model_dim
    weights, means, covariances = given_start(k, dim, weights, means, covariances)
    projected = data.R is not None and data.obs_dim != dim
    if means is None:
        if projected:
            raise ValueError("means_init is required when the projection R changes the dimension")
        kmeans_weights, means = kmeans_init(_kmeans_points(data, k), k, kmeans, seed, device, dtype)
        weights = kmeans_weights if weights is None else weights
    if weights is None:
        weights = torch.ones(k, dtype=torch.float64)
    if covariances is None and projected:
        covariances = torch.eye(dim, dtype=torch.float64).expand(k, dim, dim).clone()
    elif covariances is None:
        covariances = cluster_covariances(data.X, data.observed_entries(), data.weights, means, device)
    return Mixture(weights / weights.sum(), means, covariances).to(device, torch.float64)  # see ``fitters``


# How far from 1 the given weights may sum (scikit-learn refuses weights that are not normalised; float32
# weights a file stored sum to 1 within ~1e-7)
WEIGHTS_SUM_TOL = 1e-6


def given_start(k: int, dim: int, weights, means, covariances) -> tuple:
    """The given initial arrays (any may be None) as float64 tensors, or a ValueError naming the parameter
    where one has the wrong shape, NaN or inf, a weight outside (0, 1], weights that do not sum to 1, or a
    covariance that is not symmetric or has no Cholesky factor (as scikit-learn's GaussianMixture refuses them)."""
    given = []
    for name, value, shape in (
        ("weights_init", weights, (k,)),
        ("means_init", means, (k, dim)),
        ("covariances_init", covariances, (k, dim, dim)),
    ):
        if value is not None:
            value = torch.as_tensor(np.asarray(value), dtype=torch.float64)
            if tuple(value.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
            if not torch.isfinite(value).all():
                raise ValueError(f"{name} contains NaN or inf")
        given.append(value)
    weights, means, covariances = given
    if weights is not None:
        if (weights <= 0).any() or (weights > 1).any():
            row = int(torch.nonzero((weights <= 0) | (weights > 1))[0])
            raise ValueError(f"weights_init must lie in (0, 1]: component {row}'s is {float(weights[row]):.6g}")
        if abs(float(weights.sum()) - 1) > WEIGHTS_SUM_TOL:
            raise ValueError(f"weights_init must sum to 1 (within {WEIGHTS_SUM_TOL:g}), got {float(weights.sum()):.6g}")
    if covariances is not None:
        diagonal = torch.diagonal(covariances, dim1=1, dim2=2).abs()
        scale = torch.sqrt(diagonal[:, :, None] * diagonal[:, None, :])  # |V_ij| <= this where V is SPD
        asymmetric = ((covariances - covariances.mT).abs() > 1e-8 * scale).any(dim=(1, 2))
        if asymmetric.any():
            raise ValueError(f"covariances_init component {int(torch.nonzero(asymmetric)[0])} is not symmetric")
        _, info = torch.linalg.cholesky_ex(covariances)
        if (info > 0).any():
            row = int(torch.nonzero(info > 0)[0, 0])
            raise ValueError(f"covariances_init component {row} is not symmetric positive definite")
    return weights, means, covariances
