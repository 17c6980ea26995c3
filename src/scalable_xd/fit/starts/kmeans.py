"""Minibatch k-means (Sculley 2010) in torch, for initialising the mixture on the fitting device.

Each centre moves to the running mean of every point ever assigned to it (per-centre rate 1/count),
updated batch by batch. Centres are seeded by k-means++ on a random subsample, and a centre that wins no
point during an epoch is moved to a random data point (as scikit-learn's MiniBatchKMeans reassigns).
scikit-learn is not used here because the data may live on a GPU and be far larger than memory-bound
CPU code likes; its KMeans is the oracle in the tests.

Batches reach the device a window of many at a time. A batch's step is a dozen small kernels, whose
launches from Python, not their arithmetic, set a GPU's pace (docs/performance.md), so on CUDA
a window's steps are captured once as a CUDA graph and replayed with one launch a window (``_Windows``).
"""

from __future__ import annotations

import functools

import torch

from ...kernel.cuda_graphs import captured, warm_up

# Rows gathered and moved to the device at a time: a copy per batch of 500 would cost a transfer and a wait
# on a GPU each, for a step whose arithmetic takes microseconds.
_WINDOW_ROWS = 65_536


def _squared_distances(x: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    return torch.cdist(x, centres).square()


def _kmeans_plus_plus(sample: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    first = torch.randint(sample.shape[0], (1,), generator=generator)
    centres = [sample[int(first)]]
    closest = _squared_distances(sample, centres[0][None]).squeeze(1)
    for _ in range(1, k):
        total = closest.sum()
        if total <= 0:  # fewer distinct points than centres: pick uniformly
            pick = int(torch.randint(sample.shape[0], (1,), generator=generator))
        else:
            pick = int(torch.multinomial((closest / total).cpu(), 1, generator=generator))
        centres.append(sample[pick])
        closest = torch.minimum(closest, _squared_distances(sample, sample[pick][None]).squeeze(1))
    return torch.stack(centres)


def minibatch_kmeans(
    X: torch.Tensor,
    n_clusters: int,
    *,
    epochs: int = 10,
    batch_size: int = 500,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cluster the rows of X (N, D); returns centres (K, D) and the counts of the last epoch's assignments.

    Work runs on ``device`` in X's dtype; batches are drawn from a permutation seeded by ``seed`` and
    moved to the device many at a time.
    """
    n = X.shape[0]
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be positive, got {epochs} and {batch_size}")
    if isinstance(n_clusters, bool) or not isinstance(n_clusters, int) or n_clusters < 1:
        raise ValueError(f"n_clusters must be a positive integer, got {n_clusters!r}")
    if n_clusters > n:
        raise ValueError(f"n_clusters={n_clusters} is larger than the number of points ({n})")
    generator = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    init_size = min(n, max(3 * n_clusters, 3 * batch_size))
    sample = X[torch.randperm(n, generator=generator)[:init_size]].to(device)
    centres = _kmeans_plus_plus(sample, n_clusters, generator)
    counts = torch.zeros(n_clusters, dtype=X.dtype, device=device)
    epoch_counts = torch.zeros(n_clusters, dtype=torch.long, device=device)
    window = batch_size * max(1, _WINDOW_ROWS // batch_size)  # whole batches
    windows = _Windows(batch_size, window, (centres, counts, epoch_counts), device)
    for epoch in range(epochs):
        epoch_counts.zero_()
        order = torch.randperm(n, generator=generator)
        for window_start in range(0, n, window):
            windows.run(X[order[window_start : window_start + window]].to(device))
        empty = epoch_counts == 0
        if empty.any() and epoch < epochs - 1:
            picks = torch.randint(n, (int(empty.sum()),), generator=generator)
            centres[empty] = X[picks].to(device)
            counts[empty] = 0
    return centres, epoch_counts


def _step(x: torch.Tensor, centres: torch.Tensor, counts: torch.Tensor, epoch_counts: torch.Tensor) -> None:
    """One batch's step, in place: each centre that won points moves to the running mean of every point ever
    assigned to it."""
    assign = _squared_distances(x, centres).argmin(dim=1)
    # index_add_, not bincount: on CUDA bincount waits for the device to size its output
    batch_counts = torch.zeros_like(epoch_counts).index_add_(0, assign, torch.ones_like(assign))
    sums = torch.zeros_like(centres).index_add_(0, assign, x)
    new_counts = counts + batch_counts
    moved = batch_counts > 0
    centres.copy_(
        torch.where(moved[:, None], (centres * counts[:, None] + sums) / new_counts.clamp_min(1)[:, None], centres)
    )
    counts.copy_(new_counts)
    epoch_counts += batch_counts


class _Windows:
    """A window's batch steps on the k-means state (centres, counts, this epoch's counts), updated in place.
    On CUDA the first full window runs eagerly on a side stream (cuBLAS and the allocator settle, as CUDA
    graphs ask), the second is captured as one graph, and every full window from then on is copied into the
    graph's static buffer and replayed; a shorter window (an epoch's last) runs eagerly, as every window does
    on the CPU. A capture that CUDA refuses is said in a warning, and the windows run eagerly."""

    def __init__(self, batch_size: int, window: int, state: tuple[torch.Tensor, ...], device: torch.device):
        self.batch_size, self.window, self.state = batch_size, window, state
        self.capturing = device.type == "cuda"
        self.static: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def run(self, rows: torch.Tensor) -> None:
        """The steps of the window ``rows`` on the device (shorter than ``window`` at an epoch's end)."""
        if not self.capturing or len(rows) != self.window:
            self._steps(rows)
        elif self.static is None:
            warm_up(rows.device, functools.partial(self._steps, rows))
            self.static = torch.empty_like(rows)
        else:
            self.static.copy_(rows)
            if self.graph is None:
                self.graph = captured(functools.partial(self._steps, self.static), "k-means' window")
                self.capturing = self.graph is not None
            if self.graph is not None:
                self.graph.replay()
            else:
                self._steps(self.static)

    def _steps(self, rows: torch.Tensor) -> None:
        for start in range(0, len(rows), self.batch_size):
            _step(rows[start : start + self.batch_size], *self.state)


def weights_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """Initial mixture weights from the k-means counts (paper appendix B.2), in float64 on the CPU: each
    count floored at one point, so that no component starts with weight zero, then normalised."""
    counts = counts.to("cpu", torch.float64).clamp_min(1.0)
    return counts / counts.sum()
