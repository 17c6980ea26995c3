"""Each point's noise as a Gaussian mixture, for measurements whose errors are skewed, multi-modal or given as
samples (Bovy 2014, "XD with non-Gaussian uncertainties", the note on the ngerrors branch of his code).

Point i's noise has M components: weights beta_im (summing to 1), offsets o_im (the components' means) and
covariances S_im; samples of a noise distribution are M components of zero width and weight 1/M. Then

    p(x_i) = sum_j sum_m alpha_j beta_im N(x_i - o_im | m_j, V_j + S_im),

which is the Gaussian-noise likelihood of M rows per point, (x_i - o_im, S_im), weighted by beta_im: the
kernel sees the rows (``kernel.noise_mixture_pass``), and EM goes through with (component, noise component)
pairs. M is fixed per data set; M = 1 with zero offset is Gaussian noise.
"""

from __future__ import annotations

import torch

from .noise import CHECK_CHUNK, as_float_tensor, take_rows

# How far a point's noise weights may sum from 1 (they are checked, not normalised: a typo should not fit).
WEIGHT_SUM_TOL = 1e-6


class NoiseMixture:
    """Per-point noise mixtures: ``weights`` (N, M), ``covariances`` (N, M, d, d) or variances (N, M, d), and
    ``offsets`` (N, M, d), the components' means (None: zero). Given as ``Xcov`` wherever a fit or a
    fitted model takes noise."""

    def __init__(self, weights, covariances, offsets=None):
        self.weights = as_float_tensor(weights, "the noise mixture's weights")
        covariances = as_float_tensor(covariances, "the noise mixture's covariances")
        if self.weights.ndim != 2:
            raise ValueError(f"the noise mixture's weights must have shape (N, M), got {tuple(self.weights.shape)}")
        n, m = self.weights.shape
        if covariances.ndim == 3 and covariances.shape[:2] == (n, m):
            covariances = torch.diag_embed(covariances)
        if covariances.ndim != 4 or covariances.shape[:2] != (n, m) or covariances.shape[2] != covariances.shape[3]:
            raise ValueError(
                f"the noise mixture's covariances must have shape (N, M, d, d) = ({n}, {m}, d, d) (or variances "
                f"(N, M, d)), got {tuple(covariances.shape)}"
            )
        self.covariances = covariances
        d = covariances.shape[2]
        if offsets is None:
            offsets = torch.zeros(n, m, d, dtype=covariances.dtype)
        self.offsets = as_float_tensor(offsets, "the noise mixture's offsets")
        if tuple(self.offsets.shape) != (n, m, d):
            raise ValueError(
                f"the noise mixture's offsets must have shape (N, M, d) = ({n}, {m}, {d}), "
                f"got {tuple(self.offsets.shape)}"
            )

    def __len__(self) -> int:
        return self.weights.shape[0]

    @property
    def dim(self) -> int:
        return self.covariances.shape[2]

    @property
    def n_noise(self) -> int:
        """M, the components of each point's noise."""
        return self.weights.shape[1]

    def __getitem__(self, index) -> NoiseMixture:
        return NoiseMixture(self.weights[index], self.covariances[index], self.offsets[index])

    def batch(self, index, device, dtype) -> NoiseMixture:
        """The rows ``index`` on ``device``, offsets and covariances in ``dtype``, weights in float64."""
        return NoiseMixture(
            take_rows(self.weights, index, device, torch.float64),
            take_rows(self.covariances, index, device, dtype),
            take_rows(self.offsets, index, device, dtype),
        )

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.weights, self.covariances, self.offsets

    def rows(self, x: torch.Tensor, R: torch.Tensor | None = None):
        """The M rows of each point as Gaussian-noise data, point by point: (x_i - o_im (B M, d), S_im
        (B M, d, d), R_i repeated (B M, d, D) or None, log beta_im (B, M) in float64)."""
        b, m = self.weights.shape
        values = (x.unsqueeze(1) - self.offsets.to(x.dtype)).reshape(b * m, -1)
        covariances = self.covariances.to(x.dtype).reshape(b * m, self.dim, self.dim)
        projections = None if R is None else R.repeat_interleave(m, dim=0)
        return values, covariances, projections, torch.log(self.weights.to(torch.float64))

    def validate(self) -> None:
        """Raise ValueError naming the first point (and noise component) whose weights are not finite,
        non-negative and summing to 1, or whose offset or covariance is not finite, symmetric and
        positive semi-definite."""
        for start in range(0, len(self), CHECK_CHUNK):
            weights, covariances, offsets = (t[start : start + CHECK_CHUNK].double() for t in self.tensors())
            _first(~torch.isfinite(weights) | (weights < 0), start, "has a weight that is NaN, inf or negative")
            sums = weights.sum(1)
            _first((sums - 1).abs() > WEIGHT_SUM_TOL, start, "has weights that do not sum to 1")
            _first(~torch.isfinite(offsets).all(-1), start, "has an offset with NaN or inf")
            _first(~torch.isfinite(covariances).all((-2, -1)), start, "has a covariance with NaN or inf")
            scale = (
                torch.diagonal(covariances, dim1=-2, dim2=-1).abs().amax(-1).clamp_min(torch.finfo(torch.float64).tiny)
            )
            asymmetric = (covariances - covariances.mT).abs().amax((-2, -1)) > 1e-8 * scale
            _first(asymmetric, start, "has a covariance that is not symmetric")
            lowest = torch.linalg.eigvalsh(covariances).amin(-1)
            _first(lowest < -1e-8 * scale, start, "has a covariance that is not positive semi-definite")


def _first(bad: torch.Tensor, offset: int, problem: str) -> None:
    """Raise naming the first True entry of ``bad`` ((B,) per point or (B, M) per noise component)."""
    if not bad.any():
        return
    row = int(torch.nonzero(bad.reshape(bad.shape[0], -1).any(1))[0, 0])
    where = f"row {offset + row}"
    if bad.ndim == 2:
        where += f", noise component {int(torch.nonzero(bad[row])[0, 0])}"
    raise ValueError(f"the noise mixture of {where} {problem}")
