"""Validated training data in memory: the observed points, their noise covariances and optional projections.

Checks run once, up front, and name the first bad row; after that every batch is assumed clean.

It is one of the sources a fit reads through the ``source.DataSource`` protocol.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ..settings import MISSING_MODES
from .batching import GatheredOnRead, RowsInMemory, batch_views, epoch_order
from .missing import MISSING_VARIANCE
from .noise import (
    CHECK_CHUNK,
    CompactCovariance,
    DenseNoise,
    DiagonalNoise,
    ZeroNoise,
    as_float_tensor,
    as_noise,
    check_rows,
    first_bad,
    take_rows,
)
from .noise_mixture import NoiseMixture

# Rows gathered and converted at once for an epoch's batches (``Dataset.epoch_batches``): 65,536 rows of
# dense float64 noise are 26 MB
GATHER_ROWS = 65_536

# Data a fit scores after every epoch (its validation set, its training sample) are held on the fitting
# device in the fit's dtype up to this size (x and dense noise): read and converted once, not at every
# scoring. 200,000 rows of 7-D float32 data are 45 MB.
RESIDENT_BYTES = 512 * 2**20


class Dataset:
    """X (N, d), noise covariances (N, d, d) in any container from ``noise``, projections R (N, d, D) or None,
    and per-point weights (N,) or None (``sample_weight``: a point of weight 2 counts as two copies).

    ``missing="marginalise"``: an entry that is NaN in X or has noise variance >= ``MISSING_VARIANCE`` is
    missing, and the point is scored and updated on its other entries (``observed``, (N, d) bool; None
    when every entry is observed). ``"variance"``: every entry counts as measured (the paper's
    convention gives missing ones variance 1e12), and NaN is an error."""

    def __init__(
        self,
        X,
        Xcov=None,
        R=None,
        *,
        sample_weight=None,
        name: str = "X",
        validate: bool = True,
        missing: str = "variance",
    ):
        if missing not in MISSING_MODES:
            raise ValueError(f"unknown missing {missing!r}: choose one of {', '.join(MISSING_MODES)}")
        self.missing = missing
        self.X = as_float_tensor(X, name)
        if self.X.ndim != 2:
            raise ValueError(f"{name} must have shape (N, d), got {tuple(self.X.shape)}")
        n, d = self.X.shape
        if n == 0:
            raise ValueError(f"{name} is empty")
        if d == 0:
            raise ValueError(f"{name} has no columns (shape {tuple(self.X.shape)})")
        self.noise = _noise(Xcov, n, d)
        self.R = None
        if R is not None:
            self.R = as_float_tensor(R, "R")
            if self.R.ndim != 3 or self.R.shape[:2] != (n, d):
                raise ValueError(f"R must have shape (N, d, D) = ({n}, {d}, D), got {tuple(self.R.shape)}")
        self.weights = None if sample_weight is None else _checked_weights(sample_weight, n, name)
        self.observed = None
        self._residents: dict[tuple[str, torch.dtype], Dataset] = {}  # ``resident``'s copies, made once
        if missing == "marginalise":
            if isinstance(self.noise, NoiseMixture):
                raise ValueError("missing='marginalise' takes Gaussian noise: not a NoiseMixture")
            if self.R is not None:
                raise ValueError("missing='marginalise' marginalises through its own projections: R cannot be given")
            self.observed = self.observed_entries()
        if validate:
            self.validate(name)

    def observed_entries(self) -> torch.Tensor | None:
        """(N, d) True where X is not NaN and the noise variance is below ``MISSING_VARIANCE``; None when
        every entry is (what ``missing="marginalise"`` fits; the paper's convention fits every entry, but
        a starting spread should not count its placeholders)."""
        parts = []
        for start in range(0, len(self), CHECK_CHUNK):
            rows = slice(start, start + CHECK_CHUNK)
            S = self.noise.batch(rows, "cpu", torch.float64)
            if isinstance(S, NoiseMixture):  # an entry is a placeholder where every noise component says so
                variances = torch.diagonal(S.covariances, dim1=-2, dim2=-1).amin(1)
            else:
                variances = torch.diagonal(S, dim1=1, dim2=2)
            parts.append(~torch.isnan(self.X[rows]) & (variances < MISSING_VARIANCE))
        observed = torch.cat(parts)
        return None if bool(observed.all()) else observed

    def least_noise_variances(self) -> torch.Tensor:
        """(d,) each feature's least noise variance over the stars (of a noise mixture, its least component's),
        float64: 0 where some star measures the feature without noise."""
        least = torch.full((self.X.shape[1],), torch.inf, dtype=torch.float64)
        for start in range(0, len(self), CHECK_CHUNK):
            S = self.noise.batch(slice(start, start + CHECK_CHUNK), "cpu", torch.float64)
            if isinstance(S, NoiseMixture):
                variances = torch.diagonal(S.covariances, dim1=-2, dim2=-1).amin(1)
            else:
                variances = torch.diagonal(S, dim1=1, dim2=2)
            least = torch.minimum(least, variances.amin(0))
        return least

    def validate(self, name: str = "X") -> None:
        marginalise = self.missing == "marginalise"  # NaN marks a missing entry
        check_rows(
            self.X,
            lambda v: torch.isinf(v) if marginalise else ~torch.isfinite(v),
            f"{name} {{where}} contains "
            + ("inf" if marginalise else "NaN or inf; a NaN that marks a missing entry needs missing='marginalise'"),
        )
        if self.R is not None:
            check_rows(self.R, lambda v: ~torch.isfinite(v), "R {where} contains NaN or inf")
        try:
            self.noise.validate()
        except ValueError as err:
            if marginalise and "NaN" in str(err):
                raise ValueError(
                    f"{err}; with missing='marginalise' a missing entry is marked by NaN in X (or a variance "
                    ">= 1e12), not by NaN in Xcov"
                ) from None
            raise

    def check_range(self, dtype: torch.dtype, name: str = "X") -> None:
        """Refuse values whose squares overflow ``dtype``, naming the first such row.

        The statistics pass forms squared distances (x - m)^2 summed over d features and factorises
        V + S; beyond sqrt(max / 4d) in X (max / 4d in S) these overflow, and would surface as a NaN deep
        inside k-means++ or as a silent -inf score.
        """
        limit = math.sqrt(torch.finfo(dtype).max / (4 * self.obs_dim))
        cure = "fit in float64 or rescale the features" if dtype != torch.float64 else "rescale the features"
        dtype_name = str(dtype).removeprefix("torch.")
        check_rows(
            self.X,
            lambda v: v.abs() > limit,
            f"{name} {{where}} has a value beyond {limit:.3g}, whose squares overflow {dtype_name}; {cure}",
        )
        for start in range(0, len(self), CHECK_CHUNK):
            S = self.noise.batch(slice(start, start + CHECK_CHUNK), "cpu", torch.float64)
            S = S.covariances if isinstance(S, NoiseMixture) else S
            bad = S.abs() > limit**2
            if bad.any():
                raise ValueError(
                    f"the noise covariance of {name} {first_bad(bad, start)} has an entry beyond {limit**2:.3g}, "
                    f"where sums of such entries overflow {dtype_name}; {cure}"
                )

    def __len__(self) -> int:
        return self.X.shape[0]

    @property
    def total_weight(self) -> float:
        """What a mean over the data divides by: the number of points, or the sum of their weights."""
        return len(self) if self.weights is None else float(self.weights.sum())

    def batch_weights(self, index, device, dtype):
        """The weights of the rows ``index`` on ``device`` in ``dtype``, or None when unweighted."""
        return None if self.weights is None else take_rows(self.weights, index, device, dtype)

    @property
    def obs_dim(self) -> int:
        return self.X.shape[1]

    @property
    def model_dim(self) -> int:
        return self.obs_dim if self.R is None else self.R.shape[2]

    def batch(self, index, device, dtype):
        """(x, S, R) of the rows ``index`` (a slice or an index tensor) on ``device`` in ``dtype``; missing
        entries of x (``observed``) as 0, which no pass reads."""
        x = take_rows(self.X, index, device, dtype)
        if self.missing == "marginalise":
            x = torch.nan_to_num(x, nan=0.0)
        S = self.noise.batch(index, device, dtype)
        R = None if self.R is None else take_rows(self.R, index, device, dtype)
        return x, S, R

    def resident(self, device, dtype) -> Dataset:
        """These data with x and the noise (dense) on ``device`` in ``dtype``, converted once, the weights
        where they were; the same batches, value for value. Itself where it has projections, missing
        entries or noise mixtures, or would take more than ``RESIDENT_BYTES``. One copy per device and dtype,
        whoever asks (the fits in lockstep score one validation set: ``fit.run.scoring.scores_together``)."""
        if self.R is not None or self.observed is not None or isinstance(self.noise, NoiseMixture):
            return self
        n, d = self.X.shape
        if n * (d + d * d) * dtype.itemsize > RESIDENT_BYTES:
            return self
        key = (str(torch.device(device)), dtype)
        if key not in self._residents:
            x, S, _ = self.batch(slice(None), device, dtype)
            noise = None if isinstance(self.noise, ZeroNoise) else S
            self._residents[key] = Dataset(x, noise, sample_weight=self.weights, validate=False)
        return self._residents[key]

    def batch_observed(self, index, device):
        """The rows' ``observed`` mask on ``device``, or None when every entry is observed."""
        return None if self.observed is None else take_rows(self.observed, index, device)

    def epoch_batches(
        self, batch_size: int, epoch: int, seed: int, shuffle: bool, group, device, dtype, skip=0, in_place=False
    ):
        """Yield a ``Batch`` per global batch of an epoch (``batching.epoch_order``) after the first ``skip``:
        this process's share of it in a process group, the whole of it otherwise. The rows of many batches
        are gathered at once (``GATHER_ROWS``) and each batch is a view of them: the same rows, with a dozen
        small tensor calls a window instead of a batch."""
        arrays = self._in_place(device) if in_place else None
        shares = []  # (the batch's size, this process's rows of it): numpy arrays where read in place
        for index in epoch_order(len(self), batch_size, epoch, seed, shuffle, as_numpy=arrays is not None)[skip:]:
            size = index.stop - index.start if isinstance(index, slice) else len(index)
            shares.append((size, _as_rows(group.share(index, size), arrays is not None)))
        if arrays is not None:  # each batch's rows read where they lie, or gathered when asked for
            X, noise, observed = arrays
            for size, rows in shares:
                gather = functools.partial(self._rows_read, rows, device, dtype)
                yield GatheredOnRead(size, RowsInMemory(X, noise, rows, observed), gather)
            return
        per_window = max(1, GATHER_ROWS // batch_size)
        for first in range(0, len(shares), per_window):
            window = shares[first : first + per_window]
            rows = torch.cat([rows for _, rows in window])
            x, S, R = self.batch(rows, device, dtype)
            weights, observed = self.batch_weights(rows, device, dtype), self.batch_observed(rows, device)
            yield from batch_views([(size, len(part)) for size, part in window], (x, S, R, weights, observed))

    def _in_place(self, device) -> tuple | None:
        """(X, the noise, the observed entries or None) as ``RowsInMemory`` holds them, numpy arrays, where a
        batch of rows can be read in place (``batching.GatheredOnRead``): on the CPU, rows with no R or
        weights, of dense, diagonal or compact noise, C-contiguous; None otherwise."""
        if torch.device(device).type != "cpu" or self.R is not None or self.weights is not None:
            return None
        noise = self.noise
        if isinstance(noise, (DenseNoise, DiagonalNoise)):
            arrays = [self.X, noise.values]
        elif isinstance(noise, CompactCovariance):
            arrays = [self.X, torch.as_tensor(noise.sigma), torch.as_tensor(noise.corr)]
        else:
            return None
        if not all(array.is_contiguous() for array in arrays):
            return None
        X, *values = (array.numpy() for array in arrays)
        observed = None if self.observed is None else self.observed.numpy()
        if isinstance(noise, CompactCovariance):
            return X, (*values, noise.correlation_columns()), observed
        return X, values[0], observed

    def _rows_read(self, rows: np.ndarray, device, dtype) -> tuple:
        """(x, S, observed or None) of a batch read in place, gathered."""
        index = torch.from_numpy(rows)
        return (*self.batch(index, device, dtype)[:2], self.batch_observed(index, device))

    def scan(self, rows: slice, batch_size: int, device, dtype):
        """Yield (first row, x, S, R, weights, observed) over ``rows`` in order, ``batch_size`` rows at a time."""
        for start in range(rows.start, rows.stop, batch_size):
            index = slice(start, min(start + batch_size, rows.stop))
            yield (
                start,
                *self.batch(index, device, dtype),
                self.batch_weights(index, device, torch.float64),
                self.batch_observed(index, device),
            )

    def sample(self, rows: torch.Tensor, name: str) -> Dataset:
        """The rows ``rows`` (sorted indices) as a new data set in memory, in float64."""
        x, S, R = self.batch(rows, "cpu", torch.float64)
        if self.observed is not None:
            x = torch.where(self.observed[rows], x, torch.nan)
        weights = None if self.weights is None else self.weights[rows]
        return Dataset(x, S, R, sample_weight=weights, name=name, validate=False, missing=self.missing)

    @property
    def complete_X(self) -> torch.Tensor:
        """The rows of X with every entry observed (all of X unless ``missing="marginalise"``)."""
        return self.X if self.observed is None else self.X[self.observed.all(1)]

    def digest_bytes(self, rows: torch.Tensor):
        """Yield what identifies these data for a checkpoint: the column sums of X, of the noise covariances
        and of R, a block at a time (one pass: a digest sees all the data it vouches for), the rows
        ``rows`` in full and every weight."""
        for start in range(0, len(self), CHECK_CHUNK):
            for part in _tensors(self.batch(slice(start, start + CHECK_CHUNK), "cpu", torch.float64)):
                yield part.sum(dim=0).numpy().tobytes()
        for part in _tensors((*self.batch(rows, "cpu", torch.float64), self.weights)):
            yield part.contiguous().numpy().tobytes()


def _noise(Xcov, n: int, dim: int):
    """The noise container for ``Xcov``: a ``NoiseMixture`` as it is (of N points and d features), any other
    form through ``noise.as_noise``."""
    if not isinstance(Xcov, NoiseMixture):
        return as_noise(Xcov, n, dim)
    if len(Xcov) != n or Xcov.dim != dim:
        raise ValueError(
            f"the noise mixture describes {len(Xcov)} points of dimension {Xcov.dim}, but X has {n} of dimension {dim}"
        )
    return Xcov


def _tensors(parts):
    """The tensors among ``parts`` (x, S, R, ...: None skipped, a noise mixture's three in its place)."""
    for part in parts:
        if isinstance(part, NoiseMixture):
            yield from part.tensors()
        elif part is not None:
            yield part


def _as_rows(index, as_numpy: bool):
    """Row numbers (int64) of a slice or an index: a numpy array where ``as_numpy``, else a tensor."""
    if isinstance(index, slice):
        return np.arange(index.start, index.stop, dtype=np.int64) if as_numpy else torch.arange(index.start, index.stop)
    return index


def _checked_weights(sample_weight, n: int, name: str) -> torch.Tensor:
    """``sample_weight`` as a float64 tensor (N,): finite, non-negative and not all zero, as Bovy's ``weight``
    and scikit-learn's ``sample_weight`` require; a bad entry is named by its row."""
    weights = torch.as_tensor(as_float_tensor(sample_weight, "sample_weight"), dtype=torch.float64)
    if weights.shape != (n,):
        raise ValueError(
            f"sample_weight must have shape ({n},), one weight per row of {name}, got {tuple(weights.shape)}"
        )
    check_rows(weights, lambda v: ~torch.isfinite(v), "sample_weight {where} is NaN or inf")
    check_rows(weights, lambda v: v < 0, "sample_weight {where} is negative")
    total = weights.sum()
    if not total > 0:
        raise ValueError("sample_weight is zero for every row: no point would count")
    if not torch.isfinite(total):
        raise ValueError(f"sample_weight sums to {float(total)}, beyond float64's range: rescale the weights")
    return weights
