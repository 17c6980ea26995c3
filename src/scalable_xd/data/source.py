"""What a fit asks of its training data: the ``DataSource`` protocol.

Three sources implement it: ``dataset.Dataset`` (arrays in memory), ``stream.ParquetSource`` (Parquet on
disk, a window at a time) and ``iterable.IterableSource`` (any re-iterable of batches, a PyTorch
``DataLoader`` included). ``XDGMM.fit``, ``score`` and the rest take an object of a user's own class too,
wherever it has these members: the fit only ever reads its data through them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch

from .batching import Batch


@runtime_checkable
class DataSource(Protocol):
    """Points x (N, d) with their noise covariances (and optionally projections and weights), as a fit reads
    them: a batch at a time, on the fitting device, in the fit's dtype. Values are checked before the fit
    begins (by the source itself, naming the first bad row), so a fit assumes every batch is clean."""

    missing: str  # how missing entries are marked: "variance" or "marginalise" (see ``Dataset``)

    def __len__(self) -> int:
        """The number of points, N."""

    @property
    def obs_dim(self) -> int:
        """d, the dimension of x."""

    @property
    def model_dim(self) -> int:
        """D, the dimension of the model (d unless projections map it onto x)."""

    @property
    def total_weight(self) -> float:
        """What a mean over the data divides by: N, or the sum of the points' weights."""

    def check_range(self, dtype: torch.dtype, name: str = "X") -> None:
        """Raise a ValueError naming the first row whose values overflow ``dtype`` when squared
        (``Dataset.check_range``)."""

    def epoch_batches(
        self,
        batch_size: int,
        epoch: int,
        seed: int,
        shuffle: bool,
        group,
        device,
        dtype,
        skip: int = 0,
        in_place: bool = False,
    ) -> Iterator[Batch]:
        """Yield a ``batching.Batch`` per batch of training epoch ``epoch`` (1, 2, ...), after the first
        ``skip`` (already done, before a resume): ``group.share(rows, size)`` of each where ``group`` is a
        data-parallel process group (``fit.run.parallel``). The order is the source's to choose; drawn from
        (``seed``, ``epoch``) alone, a resumed fit reads the batches an uninterrupted one reads.
        ``in_place``: the caller's pass reads rows where they lie (``kernel.fused.PlainPass``), so a batch
        may name its rows in memory and gather them only when read (``batching.GatheredOnRead``)."""

    def scan(self, rows: slice, batch_size: int, device, dtype) -> Iterator[tuple]:
        """Yield (first row, x, S, R or None, float64 weights or None, observed or None) over ``rows`` in
        order, about ``batch_size`` rows at a time: the evaluation passes that score a model."""

    def sample(self, rows: torch.Tensor, name: str):
        """The rows ``rows`` (sorted row numbers) as a ``Dataset`` in memory, in float64: what k-means and
        split-and-merge's judge see."""

    def digest_bytes(self, rows: torch.Tensor) -> Iterator[bytes]:
        """Yield what identifies these data for a checkpoint (``fit.run.checkpoint.data_digest``), so that a
        checkpoint is never resumed on other data."""
