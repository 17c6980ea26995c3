"""Per-point noise covariances S_i, stored in whatever form is cheapest and expanded per batch.

A fit only ever needs the (B, d, d) covariances of the batch in hand, on the fitting device. Storing them
densely costs d*d numbers a point; Gaia's astrometry gives them as d standard deviations plus a few
correlation coefficients, 24 numbers a star instead of 49 for d = 7, which matters at 1.7 billion stars.

Every container here answers ``batch(index, device, dtype) -> (B, d, d)`` and ``validate()``, which raises a
``ValueError`` naming the first offending row.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Rows are checked in chunks of this many so that validation memory stays bounded.
CHECK_CHUNK = 65_536


def take_rows(tensor: torch.Tensor, index, device=None, dtype=None) -> torch.Tensor:
    """The rows ``index`` (a slice or a tensor of row numbers) of ``tensor``, on ``device`` in ``dtype``. Row
    numbers go through ``index_select``: on the CPU it gathers (7, 7) covariances several times faster than
    indexing with a tensor."""
    rows = (
        tensor.index_select(0, index)
        if isinstance(index, torch.Tensor) and index.dtype == torch.long
        else tensor[index]
    )
    return rows.to(device=device, dtype=dtype, non_blocking=True)


def as_float_tensor(array, name: str = "array") -> torch.Tensor:
    """A floating-point tensor sharing memory with ``array`` where possible (memory-maps stay on disk).

    Read-only arrays (memory-maps, broadcast views) are wrapped without a copy: this package never writes
    to its inputs, so torch's warning about non-writable arrays does not apply.
    """
    if isinstance(array, torch.Tensor):
        tensor = array.detach()
    else:
        if hasattr(array, "to_numpy") and not isinstance(array, np.ndarray):  # pandas: NA becomes NaN
            try:
                array = array.to_numpy(dtype=np.float64, na_value=np.nan)
            except (TypeError, ValueError) as err:
                raise ValueError(f"{name} must hold numbers only ({err})") from None
        array = np.asarray(array)
        if array.dtype.kind not in "biuf":
            raise ValueError(f"{name} must be a numeric array, got dtype {array.dtype}")
        if array.dtype.kind != "f":  # integers and booleans
            array = array.astype(np.float64)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensor = torch.as_tensor(array)
    if tensor.dtype in (torch.float16, torch.bfloat16):
        warnings.warn(
            f"{name} is {str(tensor.dtype).removeprefix('torch.')}, which keeps only 2-3 significant digits: it is "
            "converted to float32 exactly, but a fit cannot be more precise than the values given; pass float32 "
            "or float64 data where you have them",
            UserWarning,
            stacklevel=3,
        )
        return tensor.to(torch.float32)
    if tensor.is_floating_point():
        return tensor
    if tensor.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool):
        return tensor.to(torch.float64)
    raise ValueError(f"{name} must be a numeric array, got dtype {tensor.dtype}")


def first_bad(bad: torch.Tensor, offset: int = 0) -> str:
    """Where the first True entry of ``bad`` (N, ...) lies, for an error message, rows counted from
    ``offset``: "row 17" (N,), "row 17, column 2" (N, d) or "row 17, entry (1, 2)" (N, d, d)."""
    flat = bad.reshape(bad.shape[0], -1)
    row = int(torch.nonzero(flat.any(dim=1))[0, 0])
    if bad.ndim == 1:
        return f"row {offset + row}"
    index = np.unravel_index(int(torch.nonzero(flat[row])[0, 0]), tuple(bad.shape[1:]))
    if bad.ndim == 2:
        return f"row {offset + row}, column {index[0]}"
    return f"row {offset + row}, entry ({', '.join(str(int(i)) for i in index)})"


def check_rows(values: torch.Tensor, is_bad, message: str) -> None:
    """Raise ValueError(message.format(where=...)) at the first entry where ``is_bad`` (elementwise) holds,
    ``where`` naming its row and column (``first_bad``).

    Runs in chunks, so that checking a memory-mapped billion-row array needs no array of its size.
    """
    for start in range(0, values.shape[0], CHECK_CHUNK):
        bad = is_bad(values[start : start + CHECK_CHUNK])
        if bad.any():
            raise ValueError(message.format(where=first_bad(bad, start)))


def _check_correlation_psd(corr: torch.Tensor, offset: int, what: str, tol: float = 1e-8) -> None:
    """Raise if any correlation matrix in ``corr`` (B, d, d) has an eigenvalue below -tol. Each is first
    factorised as corr + tol I by Cholesky (a quarter of the eigenvalues' time), which succeeds where every
    eigenvalue exceeds -tol; the eigenvalues of those it fails on decide, and name the first bad row."""
    corr = corr.to(torch.float64)
    _, info = torch.linalg.cholesky_ex(corr + tol * torch.eye(corr.shape[-1], dtype=corr.dtype, device=corr.device))
    failed = torch.nonzero(info).flatten()
    if len(failed) == 0:
        return
    smallest = torch.linalg.eigvalsh(corr[failed])[:, 0]
    bad = torch.nonzero(smallest < -tol).flatten()
    if len(bad):
        row, eig = int(failed[bad[0]]), float(smallest[bad[0]])
        raise ValueError(
            f"{what} row {offset + row} is not positive semi-definite "
            f"(smallest eigenvalue of its correlation matrix {eig:.3g})"
        )


class _ArrayNoise:
    """Noise held as one array whose first axis is the point and second the dimension."""

    def __init__(self, values):
        self.values = as_float_tensor(values)

    def __len__(self) -> int:
        return self.values.shape[0]

    @property
    def dim(self) -> int:
        return self.values.shape[1]

    def _rows(self, index, device, dtype) -> torch.Tensor:
        return take_rows(self.values, index, device, dtype)


class DenseNoise(_ArrayNoise):
    """Full covariances, shape (N, d, d)."""

    def __init__(self, covariances):
        super().__init__(covariances)
        if self.values.ndim != 3 or self.values.shape[1] != self.values.shape[2]:
            raise ValueError(f"Xcov must have shape (N, d, d) or (N, d), got {tuple(self.values.shape)}")

    def batch(self, index, device, dtype) -> torch.Tensor:
        return self._rows(index, device, dtype)

    def validate(self) -> None:
        for start in range(0, len(self), CHECK_CHUNK):
            block = self.values[start : start + CHECK_CHUNK].to(torch.float64)
            finite = torch.isfinite(block)
            if not finite.all():
                raise ValueError(f"Xcov {first_bad(~finite, start)} contains NaN or inf")
            # entry by entry against sqrt(|S_ii S_jj|), which bounds |S_ij| where S is a covariance: a row's largest
            # entry would let an upper entry at correlation 5 between features of spread 1e-3 and 1 pass
            variances = torch.diagonal(block, dim1=1, dim2=2).abs()
            scale = torch.sqrt(variances[:, :, None] * variances[:, None, :]).clamp_min(np.finfo(np.float64).tiny)
            asym = (block - block.mT).abs() > 1e-6 * scale
            if asym.any():
                raise ValueError(f"Xcov {first_bad(asym, start)} is not symmetric")
            diag = torch.diagonal(block, dim1=1, dim2=2)
            if (diag < 0).any():
                raise ValueError(f"Xcov {first_bad(diag < 0, start)} has a negative variance")
            # Scale-free check: entries span 1e-16..1e12 in Gaia rows, so test the correlation matrix.
            sd = diag.sqrt()
            outer = sd[:, :, None] * sd[:, None, :]
            zero_var_coupled = (outer == 0) & (block != 0)
            if zero_var_coupled.any():
                raise ValueError(
                    f"Xcov {first_bad(zero_var_coupled, start)} is not positive semi-definite "
                    "(a zero variance with a non-zero covariance)"
                )
            corr = torch.where(outer > 0, block / torch.where(outer > 0, outer, 1.0), torch.zeros_like(block))
            corr = corr + torch.diag_embed((diag == 0).to(block.dtype))
            _check_correlation_psd(corr, start, "Xcov")


class DiagonalNoise(_ArrayNoise):
    """Independent noise: variances of shape (N, d)."""

    def __init__(self, variances):
        super().__init__(variances)
        if self.values.ndim != 2:
            raise ValueError(f"diagonal Xcov must have shape (N, d), got {tuple(self.values.shape)}")

    def batch(self, index, device, dtype) -> torch.Tensor:
        return torch.diag_embed(self._rows(index, device, dtype))

    def validate(self) -> None:
        check_rows(self.values, lambda v: ~torch.isfinite(v), "Xcov {where} contains NaN or inf")
        check_rows(self.values, lambda v: v < 0, "Xcov {where} has a negative variance")


class ZeroNoise:
    """No measurement noise: XD reduces to an ordinary Gaussian mixture."""

    def __init__(self, n: int, dim: int):
        self.n = n
        self._dim = dim

    def __len__(self) -> int:
        return self.n

    @property
    def dim(self) -> int:
        return self._dim

    def batch(self, index, device, dtype) -> torch.Tensor:
        size = len(range(self.n)[index]) if isinstance(index, slice) else len(index)
        return torch.zeros(size, self._dim, self._dim, device=device, dtype=dtype)

    def validate(self) -> None:
        return None


@dataclass
class CompactCovariance:
    """Noise covariances stored as standard deviations plus selected correlation coefficients.

    ``sigma`` has shape (N, d); ``corr`` has shape (N, P) with column p holding the correlation of the
    dimension pair ``pairs[p] = (i, j)``; pairs not listed are uncorrelated. S_i = diag(sigma) C diag(sigma).
    """

    sigma: np.ndarray | torch.Tensor
    corr: np.ndarray | torch.Tensor
    pairs: Sequence[tuple[int, int]]

    def __post_init__(self):
        self.sigma = as_float_tensor(self.sigma)
        self.corr = as_float_tensor(self.corr)
        self.pairs = [(int(i), int(j)) for i, j in self.pairs]
        if self.sigma.ndim != 2:
            raise ValueError(f"sigma must have shape (N, d), got {tuple(self.sigma.shape)}")
        n, d = self.sigma.shape
        if self.corr.shape != (n, len(self.pairs)):
            raise ValueError(
                f"corr must have shape (N, {len(self.pairs)}) to match sigma and pairs, got {tuple(self.corr.shape)}"
            )
        for i, j in self.pairs:
            if not (0 <= i < d and 0 <= j < d and i != j):
                raise ValueError(f"correlation pair ({i}, {j}) is not a pair of distinct dimensions below {d}")
        rows = torch.tensor([p[0] for p in self.pairs], dtype=torch.long)
        cols = torch.tensor([p[1] for p in self.pairs], dtype=torch.long)
        self._rows = torch.cat([rows, cols])
        self._cols = torch.cat([cols, rows])

    def __len__(self) -> int:
        return self.sigma.shape[0]

    @property
    def dim(self) -> int:
        return self.sigma.shape[1]

    def _correlation_matrices(self, corr_rows: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(self.dim, device=corr_rows.device, dtype=corr_rows.dtype)
        corr = eye.expand(corr_rows.shape[0], -1, -1).clone()
        corr[:, self._rows.to(corr.device), self._cols.to(corr.device)] = torch.cat([corr_rows, corr_rows], dim=1)
        return corr

    def batch(self, index, device, dtype) -> torch.Tensor:
        sigma, corr = (take_rows(torch.as_tensor(t), index, device, dtype) for t in (self.sigma, self.corr))
        S = torch.diag_embed(sigma * sigma)
        for p, (i, j) in enumerate(self.pairs):  # exactly symmetric: one product written to both halves
            S[:, i, j] = S[:, j, i] = corr[:, p] * (sigma[:, i] * sigma[:, j])
        return S

    def correlation_columns(self) -> np.ndarray:
        """The column of ``corr`` of each pair of dimensions (``correlation_columns``)."""
        return correlation_columns(self.dim, self.pairs)

    def dense(self) -> torch.Tensor:
        """All covariances at once, (N, d, d); for data that fits in memory."""
        return self.batch(slice(None), self.sigma.device, self.sigma.dtype)

    def validate(self) -> None:
        sigma, corr = torch.as_tensor(self.sigma), torch.as_tensor(self.corr)  # tensors since __post_init__
        for name, values in (("sigma", sigma), ("corr", corr)):
            check_rows(values, lambda v: ~torch.isfinite(v), name + " {where} contains NaN or inf")
        check_rows(sigma, lambda v: v < 0, "sigma {where} has a negative standard deviation")
        check_rows(corr, lambda v: v.abs() > 1, "corr {where} has a correlation outside [-1, 1]")
        for start in range(0, len(self), CHECK_CHUNK):
            stop = start + CHECK_CHUNK
            matrices = self._correlation_matrices(corr[start:stop].to(torch.float64))
            _check_correlation_psd(matrices, start, "noise covariance")


def correlation_columns(dim: int, pairs) -> np.ndarray:
    """(d, d) int64: the column of compact noise's ``corr`` holding the correlation of dimensions (i, j), -1
    for uncorrelated pairs (the last column naming a pair, as ``CompactCovariance.batch`` writes it)."""
    where = np.full((dim, dim), -1, np.int64)
    for p, (i, j) in enumerate(pairs):
        where[i, j] = where[j, i] = p
    return where


def as_noise(Xcov, n: int, dim: int):
    """Wrap user input (None, (N, d), (N, d, d), a tensor or a CompactCovariance) in a noise container."""
    if Xcov is None:
        return ZeroNoise(n, dim)
    if isinstance(Xcov, (CompactCovariance, DenseNoise, DiagonalNoise, ZeroNoise)):
        noise = Xcov
    else:
        ndim = np.ndim(Xcov) if not isinstance(Xcov, torch.Tensor) else Xcov.ndim
        if ndim == 2:
            noise = DiagonalNoise(Xcov)
        elif ndim == 3:
            noise = DenseNoise(Xcov)
        else:
            raise ValueError(f"Xcov must have shape (N, d, d) or (N, d), got an array with {ndim} dimensions")
    if isinstance(noise, DiagonalNoise) and n != dim and tuple(noise.values.shape) == (dim, dim):
        raise ValueError(
            f"Xcov has shape ({dim}, {dim}): one noise covariance, where each of the {n} points needs its own, "
            f"(N, d, d), or its variances, (N, d); for one covariance C shared by every point pass "
            f"np.broadcast_to(C, ({n}, {dim}, {dim}))"
        )
    if len(noise) != n or noise.dim != dim:
        raise ValueError(
            f"Xcov describes {len(noise)} points of dimension {noise.dim}, but X has {n} of dimension {dim}"
        )
    return noise
