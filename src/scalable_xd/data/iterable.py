"""Training data from any re-iterable of batches: a PyTorch ``DataLoader``, a list of arrays, a user's class.

``XDGMM.fit`` wraps such an X in an ``IterableSource``. Each batch is a tuple ``(X, Xcov)`` or
``(X, Xcov, weights)`` of arrays or tensors (Xcov in any form ``fit`` takes, or None for noiseless points),
and is checked as arrays are, in every pass, a bad value named by its batch and its row in the batch.

The iterable is iterated once to open it (every batch checked, the points counted and summed), then once
per epoch and once per evaluation pass, in whatever order it gives: batch sizes and shuffling are its
business, not the fit's (``batch_size`` is ignored). Every pass must give the same points, checked by
their count. Where the iterable, or a ``DataLoader``'s sampler, has PyTorch's ``set_epoch(epoch)``, it is
called before each epoch; an iterable whose order depends only on that epoch can be resumed inside an
epoch (``checkpoint_every``), by passing over the batches already done. Without ``set_epoch`` a checkpoint
is resumed at an epoch's end only, and the resumed fit sees what order the iterable gives it then.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from .dataset import Dataset
from .noise_mixture import NoiseMixture


class IterableSource:
    """The batches of ``batches`` (see the module) as a ``source.DataSource``; opened with one checking pass."""

    def __init__(self, batches, *, name: str = "X", missing: str = "variance"):
        if isinstance(batches, Iterator):  # asked without iter(), which may start a DataLoader's workers
            raise TypeError(
                f"{name} is an iterator, which can be read once, but a fit reads its data once per epoch: give "
                "an object whose iter() starts a fresh pass (a DataLoader, a list of batches, a class with "
                "__iter__)"
            )
        self.batches, self.name, self.missing = batches, name, missing
        self._n, self._dim = 0, 0  # set by the opening pass (``_survey``)
        self._epoch_setters = [
            part
            for part in _parts(batches)
            if callable(getattr(part, "set_epoch", None))  # a DistributedSampler's, or the user's own
        ]
        self._survey()

    @property
    def replays_epochs(self) -> bool:
        """Whether the iterable is told the epoch (``set_epoch``), so that an epoch can be read again: what
        checkpoints inside an epoch need."""
        return bool(self._epoch_setters)

    def _survey(self) -> None:
        """The opening pass: every batch checked; N, d, the total weight and order-free sums for the digest."""
        total, summary = 0.0, None
        for _, first, data in self._pass():
            if isinstance(data.noise, NoiseMixture):
                raise ValueError(
                    f"{self.name}: noise mixtures are fitted from arrays (X and Xcov=NoiseMixture(...)), not from "
                    "an iterable of batches"
                )
            self._n = first + len(data)
            total += data.total_weight
            x = data.X.to(torch.float64)
            S = data.noise.batch(slice(None), "cpu", torch.float64)
            sums = torch.stack([x.nansum(0), (x * x).nansum(0), torch.diagonal(S, dim1=1, dim2=2).sum(0)])
            summary = sums if summary is None else summary + sums
        if summary is None:
            raise ValueError(f"{self.name} gave no batches")
        self._total_weight = total
        # rounded, so that the digest does not change with the order in which the iterable gives the points
        self._summary = np.array([float(f"{v:.10g}") for v in summary.flatten().tolist()])

    def _pass(self, what: str | None = None, skip: int = 0):
        """Yield (batch number, its first point's position in the pass, checked ``Dataset``) over one pass of
        the iterable, from batch ``skip`` on; those before it are iterated but not converted. Every pass
        checks its batches, as the iterable may give other values each time (augmentation, a stream); a
        whole pass named by ``what`` must give the points the opening pass gave."""
        first = 0
        for number, item in enumerate(self.batches):
            if number < skip:
                continue
            with _named(self.name, number):
                if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                    what = f"of {len(item)} items" if isinstance(item, (tuple, list)) else ""
                    raise ValueError(
                        f"it is a {type(item).__name__}{' ' + what if what else ''}, where a batch is a tuple "
                        "(X, Xcov) or (X, Xcov, weights)"
                    )
                x, cov, weights = (*item, None)[:3]
                data = Dataset(x, cov, sample_weight=weights, name="X", missing=self.missing)
                if self._dim == 0:  # the opening pass's first batch (no batch has 0 features)
                    self._dim = data.obs_dim
                elif data.obs_dim != self._dim:
                    raise ValueError(f"it has {data.obs_dim} features, the first batch {self._dim}")
            yield number, first, data
            first += len(data)
        if what is not None and not skip and first != self._n:
            raise ValueError(
                f"{self.name} gave {first} points in {what} but {self._n} when it was opened: a fit needs the same "
                "points in every pass (a DataLoader's drop_last=True drops a varying number under some samplers)"
            )

    # ------------------------------------------------------------------ what a fit asks of its data

    def __len__(self) -> int:
        return self._n

    @property
    def obs_dim(self) -> int:
        return self._dim

    @property
    def model_dim(self) -> int:
        return self._dim

    @property
    def total_weight(self) -> float:
        return self._total_weight

    def check_range(self, dtype: torch.dtype, name: str | None = None) -> None:
        """``Dataset.check_range`` over every batch (one pass), naming the batch and its row."""
        for number, _, data in self._pass("the pass that checked its range"):
            with _named(self.name, number):
                data.check_range(dtype, "X")

    def epoch_batches(
        self, batch_size: int, epoch: int, seed: int, shuffle: bool, group, device, dtype, skip=0, in_place=False
    ):
        """Yield a ``Batch`` per batch the iterable gives in epoch ``epoch`` (after telling it the epoch, where
        it can be told), from batch ``skip`` on. ``batch_size``, ``seed`` and ``shuffle`` are the iterable's
        business; one process only (``fit.driver`` refuses a data-parallel fit). Each batch is in memory
        already, so ``in_place`` changes nothing."""
        for setter in self._epoch_setters:
            setter.set_epoch(epoch)
        for _, _, data in self._pass(f"epoch {epoch}", skip=skip):  # each batch whole, in order
            yield from data.epoch_batches(len(data), epoch, seed, False, group, device, dtype)

    def scan(self, rows: slice, batch_size: int, device, dtype):
        """``Dataset.scan`` over each batch of one pass in turn, rows numbered in the pass; ``rows`` must be
        all of them."""
        if (rows.start, rows.stop) != (0, self._n):
            raise ValueError(
                f"{self.name} is an iterable of batches: it is read whole, not rows {rows.start}-{rows.stop}"
            )
        for _, first, data in self._pass("an evaluation pass"):
            for start, *arrays in data.scan(slice(0, len(data)), batch_size, device, dtype):
                yield (first + start, *arrays)

    def sample(self, rows, name: str) -> Dataset:
        """The points at positions ``rows`` (sorted) of one pass, in memory, in float64."""
        rows = torch.as_tensor(rows, dtype=torch.int64)
        parts = []
        for _, first, data in self._pass("the pass that drew a sample"):
            local = rows[(rows >= first) & (rows < first + len(data))] - first
            if len(local):
                parts.append(data.sample(local, name))
        x = torch.cat([part.X for part in parts])
        S = torch.cat([part.noise.batch(slice(None), "cpu", torch.float64) for part in parts])
        weights = None
        if any(part.weights is not None for part in parts):  # batches without weights weigh 1 a point
            ones = [torch.ones(len(part), dtype=torch.float64) for part in parts]
            weights = torch.cat([one if part.weights is None else part.weights for part, one in zip(parts, ones)])
        return Dataset(x, S, sample_weight=weights, name=name, validate=False, missing=self.missing)

    def digest_bytes(self, rows):
        """Yield what identifies these data for a checkpoint: N, d, the total weight and the column sums of x,
        x² and the noise variances (to 10 digits, which an iterable's order does not change). The rows
        themselves are not hashed: a shuffling iterable gives other rows at each position in every pass."""
        yield repr((self._n, self._dim, float(f"{self._total_weight:.10g}"))).encode()
        yield self._summary.tobytes()


def _parts(batches) -> list:
    """The iterable and, for a ``DataLoader``, its sampler and batch sampler (and the latter's sampler):
    where ``set_epoch`` may be found."""
    parts = [batches]
    for attribute in ("sampler", "batch_sampler"):
        part = getattr(batches, attribute, None)
        if part is not None:
            parts += [part, getattr(part, "sampler", None)]
    unique: list = []
    for part in parts:
        if part is not None and all(part is not seen for seen in unique):
            unique.append(part)
    return unique


@contextlib.contextmanager
def _named(name: str, number: int):
    """Prefix a ValueError raised for one batch with the iterable's name and the batch's number."""
    try:
        yield
    except ValueError as error:
        raise ValueError(f"{name} batch {number}: {error}") from None


def is_batch_iterable(X) -> bool:
    """Whether X is an iterable of batches rather than an array: not array-like, not a data source, and
    iterable; a list or tuple only where its first item is a tuple of arrays (its batches are then checked:
    (X, Xcov[, weights]) with 2-d X)."""
    if isinstance(X, (np.ndarray, torch.Tensor, str, bytes, dict)) or hasattr(X, "__array__"):
        return False
    if hasattr(X, "epoch_batches") or not hasattr(X, "__iter__"):
        return False
    if isinstance(X, (list, tuple)):  # batches hold arrays; rows of numbers are X itself (checked by batch)
        first = X[0] if len(X) else None
        return isinstance(first, (list, tuple)) and len(first) > 0 and np.ndim(first[0]) >= 1
    return True
