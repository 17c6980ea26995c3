"""How an epoch is cut into batches, and the seeded generators that shuffle it.

Shared by the in-memory ``Dataset`` and the streamed ``ParquetSource``: both cut an epoch of n points into
the same batch sizes, and draw their permutations from generators that depend only on the seed and the
position in the fit (epoch, window, batch), never on the device or on how the fit was interrupted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


def batch_bounds(n: int, batch_size: int) -> list[tuple[int, int]]:
    """(start, stop) of each batch of an epoch over n points. A remainder of n mod batch_size joins the
    last batch, so every batch holds between batch_size and 2 batch_size - 1 points (or all n when
    n < batch_size). A separate remainder batch of a handful of points would get a full minibatch-EM or
    Adam step from almost no data, and a fit could end on it."""
    starts = list(range(0, n, batch_size))
    if len(starts) > 1 and n - starts[-1] < batch_size:
        starts.pop()
    return [(start, stop) for start, stop in zip(starts, starts[1:] + [n])]


def generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded from ``keys`` (seed, epoch, ...) through numpy's SeedSequence."""
    state = int(np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint64)[0] >> 1)
    return torch.Generator().manual_seed(state)


def random_rows(n: int, size: int, seed: int) -> torch.Tensor:
    """``size`` of n row numbers (all when n <= size), chosen by the seed, sorted: a fixed sample of a data
    set (k-means's, split-and-merge's judge)."""
    if n <= size:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:size].sort().values


def epoch_order(n: int, batch_size: int, epoch: int, seed: int, shuffle: bool, as_numpy: bool = False):
    """Batches of one epoch over n rows held in memory (see ``batch_bounds``): slices in order, or parts of
    a permutation that depends only on (seed, epoch): int64 tensors, or numpy arrays where ``as_numpy`` (a
    numpy slice costs far less than torch's)."""
    bounds = batch_bounds(n, batch_size)
    if not shuffle:
        return [slice(start, stop) for start, stop in bounds]
    order = torch.randperm(n, generator=generator(seed, epoch))
    cut = order.numpy() if as_numpy else order
    return [cut[start:stop] for start, stop in bounds]


@dataclass
class RowsInMemory:
    """Where a batch's points lie in memory: rows ``rows`` (int64 row numbers) of X (N, d) and of the
    noise: (N, d, d) covariances, (N, d) variances, or compact noise as (sigma (N, d), corr (N, P), the
    (d, d) columns of corr of each pair, ``noise.correlation_columns``); numpy arrays of any float dtype,
    C-contiguous, or fields of a streamed window's records (``stream``). ``observed`` (N, d) bool: each
    point's measured entries where some are missing (``missing="marginalise"``; the pass reads no other
    entry of X or the noise), None where all are."""

    X: np.ndarray
    noise: np.ndarray | tuple
    rows: np.ndarray
    observed: np.ndarray | None = None


@dataclass
class Batch:
    """This process's share of one global batch: ``size`` rows in the global batch, of which this process
    holds x (B, d), S (B, d, d), R (B, d, D) or None, weights (B,) or None and the observed entries (B, d)
    or None (all of them), on the fitting device; ``in_memory`` where x and S are rows of arrays in memory
    (``GatheredOnRead``)."""

    size: int
    x: torch.Tensor
    S: torch.Tensor
    R: torch.Tensor | None
    weights: torch.Tensor | None
    observed: torch.Tensor | None = None
    in_memory: RowsInMemory | None = None


class GatheredOnRead(Batch):
    """A ``Batch`` of rows held in memory (no R or weights), whose x, S and observed entries are gathered
    by ``gather()`` -> (x, S, observed or None) only when first read: the CPU's statistics pass reads the
    rows where they lie (``in_memory``; ``kernel.fused.PlainPass``), hiding the wait for scattered rows
    behind its arithmetic (``kernel.row_access``)."""

    def __init__(self, size: int, in_memory: RowsInMemory, gather: Callable[[], tuple]):
        self.size, self.R, self.weights, self.in_memory = size, None, None, in_memory
        self._all_observed = in_memory.observed is None
        self._gather = gather
        self._gathered: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def expire(self, why: str) -> None:
        """Forget where the rows lie, whose memory is about to hold other rows: x and S, unless gathered
        already, can no longer be read (a RuntimeError giving ``why``), rather than read wrong."""
        self.in_memory = None
        if self._gathered is None:
            self._gather = functools.partial(_expired, why)

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self._gathered is None:
            self._gathered = self._gather()
        return self._gathered

    @property
    def x(self) -> torch.Tensor:  # type: ignore[override]  # a field of Batch, gathered here
        return self._tensors()[0]

    @property
    def S(self) -> torch.Tensor:  # type: ignore[override]
        return self._tensors()[1]

    @property
    def observed(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._all_observed else self._tensors()[2]


def _expired(why: str):
    raise RuntimeError(f"a batch read in place can no longer be read: {why}; read each batch before asking for more")


def batch_views(parts, tensors):
    """A ``Batch`` for each (size in the global batch, rows held) of ``parts``, whose rows follow one another
    in ``tensors`` (x, S, R, weights, observed; any but x and S may be None): views, not copies, so that the
    rows of many batches are gathered and converted at once."""
    at = 0
    for size, rows in parts:
        cut = slice(at, at + rows)
        at = cut.stop
        yield Batch(size, *(None if t is None else t[cut] for t in tensors))
