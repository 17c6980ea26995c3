"""Validated training data: the observed points, their noise covariances and optional projections.

Checks run once, up front, and name the first bad row; after that every batch is assumed clean.
"""

from __future__ import annotations

import torch

from .noise import as_float_tensor, as_noise, check_rows


class Dataset:
    """X (N, d), noise covariances (N, d, d) in any container from ``noise``, projections R (N, d, D) or None."""

    def __init__(self, X, Xcov=None, R=None, *, name: str = "X", validate: bool = True):
        self.X = as_float_tensor(X, name)
        if self.X.ndim != 2:
            raise ValueError(f"{name} must have shape (N, d), got {tuple(self.X.shape)}")
        n, d = self.X.shape
        if n == 0:
            raise ValueError(f"{name} is empty")
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
