"""Validated training data: the observed points, their noise covariances and optional projections.

Checks run once, up front, and name the first bad row; after that every batch is assumed clean.
"""

from __future__ import annotations

import math

import torch

from .noise import CHECK_CHUNK, as_float_tensor, as_noise, check_rows, first_bad_row


class Dataset:
    """X (N, d), noise covariances (N, d, d) in any container from ``noise``, projections R (N, d, D) or None."""

    def __init__(self, X, Xcov=None, R=None, *, name: str = "X", validate: bool = True):
        self.X = as_float_tensor(X, name)
        if self.X.ndim != 2:
            raise ValueError(f"{name} must have shape (N, d), got {tuple(self.X.shape)}")
        n, d = self.X.shape
        if n == 0:
            raise ValueError(f"{name} is empty")
        if d == 0:
            raise ValueError(f"{name} has no columns (shape {tuple(self.X.shape)})")
        self.noise = as_noise(Xcov, n, d)
        self.R = None
        if R is not None:
            self.R = as_float_tensor(R, "R")
            if self.R.ndim != 3 or self.R.shape[:2] != (n, d):
                raise ValueError(f"R must have shape (N, d, D) = ({n}, {d}, D), got {tuple(self.R.shape)}")
        if validate:
            self.validate(name)

    def validate(self, name: str = "X") -> None:
        check_rows(self.X, lambda v: ~torch.isfinite(v), name + " row {row} contains NaN or inf")
        if self.R is not None:
            check_rows(self.R, lambda v: ~torch.isfinite(v), "R row {row} contains NaN or inf")
        self.noise.validate()

    def check_range(self, dtype: torch.dtype, name: str = "X") -> None:
        """Refuse values whose squares overflow ``dtype``, naming the first such row.

        The statistics pass forms squared distances (x - m)^2 summed over d features and factorises
        V + S; beyond sqrt(max / 4d) in X (max / 4d in S) these overflow, and would surface as a NaN deep
        inside k-means++ or as a silent -inf score.
        """
        limit = math.sqrt(torch.finfo(dtype).max / (4 * self.obs_dim))
        cure = "fit in float64 or rescale the features" if dtype != torch.float64 else "rescale the features"
        dtype_name = str(dtype).removeprefix("torch.")
        check_rows(self.X, lambda v: v.abs() > limit,
                   f"{name} row {{row}} has a value beyond {limit:.3g}, whose squares overflow {dtype_name}; {cure}")  # fmt: skip
        for start in range(0, len(self), CHECK_CHUNK):
            S = self.noise.batch(slice(start, start + CHECK_CHUNK), "cpu", torch.float64)
            bad = S.abs() > limit**2
            if bad.any():
                row = start + first_bad_row(bad)
                raise ValueError(f"the noise covariance of {name} row {row} has an entry beyond {limit**2:.3g}, "
                                 f"where sums of such entries overflow {dtype_name}; {cure}")  # fmt: skip

    def __len__(self) -> int:
        return self.X.shape[0]

    @property
    def obs_dim(self) -> int:
        return self.X.shape[1]

    @property
    def model_dim(self) -> int:
        return self.obs_dim if self.R is None else self.R.shape[2]

    def batch(self, index, device, dtype):
        """(x, S, R) of the rows ``index`` (a slice or an index tensor) on ``device`` in ``dtype``."""
        x = self.X[index].to(device=device, dtype=dtype, non_blocking=True)
        S = self.noise.batch(index, device, dtype)
        R = None if self.R is None else self.R[index].to(device=device, dtype=dtype, non_blocking=True)
        return x, S, R
