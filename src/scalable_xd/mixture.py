"""The parameters of a Gaussian mixture over the true (noise-free) values, and what follows from them alone."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Mixture:
    """Weights (K,), means (K, D) and covariances (K, D, D) of the deconvolved density, as tensors."""

    weights: torch.Tensor
    means: torch.Tensor
    covariances: torch.Tensor

    @property
    def n_components(self) -> int:
        return self.means.shape[0]

    @property
    def dim(self) -> int:
        return self.means.shape[1]

    @property
    def log_weights(self) -> torch.Tensor:
        # A weight of exactly zero (a frozen, empty component) gives -inf, which logsumexp handles.
        return torch.log(self.weights)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights, means, covariances), the tensors themselves (``dataclasses.astuple`` would copy them)."""
        return self.weights, self.means, self.covariances

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A CPU mixture's (weights, means, covariances) as C-contiguous numpy arrays (views where they are so)."""
        weights, means, covariances = (t.contiguous().numpy() for t in self.tensors())
        return weights, means, covariances

    @classmethod
    def from_arrays(cls, arrays: tuple[np.ndarray, ...]) -> Mixture:
        """The mixture of (weights, means, covariances) numpy arrays, as tensors sharing their memory."""
        return cls(*map(torch.from_numpy, arrays))

    def to(self, device=None, dtype=None) -> Mixture:
        return Mixture(
            self.weights.to(device=device, dtype=dtype),
            self.means.to(device=device, dtype=dtype),
            self.covariances.to(device=device, dtype=dtype),
        )

    @classmethod
    def placeholder(cls, k: int, dim: int, device) -> Mixture:
        """Valid float64 parameters of the right shape, to be overwritten by a checkpoint's state."""
        eye = torch.eye(dim, dtype=torch.float64, device=device)
        return cls(
            torch.full((k,), 1.0 / k, dtype=torch.float64, device=device),
            torch.zeros(k, dim, dtype=torch.float64, device=device),
            eye.expand(k, dim, dim).clone(),
        )

    def first_invalid_component(self) -> tuple[int, str] | None:
        """(component, reason) for the first component with non-finite or non-positive-definite parameters."""
        finite = (
            torch.isfinite(self.weights)
            & torch.isfinite(self.means).all(dim=1)
            & torch.isfinite(self.covariances).all(dim=(1, 2))
        )
        if not finite.all():
            return int(torch.nonzero(~finite)[0, 0]), "has non-finite parameters"
        _, info = torch.linalg.cholesky_ex(self.covariances)
        if (info > 0).any():
            return int(torch.nonzero(info > 0)[0, 0]), "has a covariance that is not positive definite"
        singular = self._singular_to_working_precision()
        if singular.any():
            reason = "has a covariance that is not positive definite (singular to working precision)"
            return int(torch.nonzero(singular)[0, 0]), reason
        return None

    def _singular_to_working_precision(self) -> torch.Tensor:
        """(K,) bool: covariances whose unit-diagonal form has a Cholesky pivot below D times the dtype's
        resolution, a variance along some direction (given the others) that the dtype cannot tell from 0.
        Whether the factorisation of such a matrix succeeds is decided by rounding, so by the CPU and its
        vector width: judged on the pivots, every machine refuses it alike."""
        covariances = self.covariances
        diagonal = torch.diagonal(covariances, dim1=-2, dim2=-1)
        unit = covariances / torch.sqrt(diagonal[..., :, None] * diagonal[..., None, :])
        factor, info = torch.linalg.cholesky_ex(unit)
        pivots = torch.diagonal(factor, dim1=-2, dim2=-1) ** 2
        return (info > 0) | (pivots < self.dim * torch.finfo(covariances.dtype).eps).any(-1)

    def check(self, what: str, weights_sum_tol: float | None = 1e-6) -> None:
        """Raise ValueError naming ``what`` unless the parameters are a valid mixture: shapes (K,), (K, D),
        (K, D, D) that agree, finite values, non-negative weights summing to 1 (within ``weights_sum_tol``;
        None skips it, for weights that are normalised afterwards) and symmetric positive-definite covariances."""
        k = self.weights.shape[0] if self.weights.ndim == 1 else None
        if k is None or self.means.ndim != 2 or self.means.shape[0] != k:
            raise ValueError(
                f"{what}: weights {tuple(self.weights.shape)} and means {tuple(self.means.shape)} must "
                "have shapes (K,) and (K, D) with the same K"
            )
        if tuple(self.covariances.shape) != (k, self.dim, self.dim):
            raise ValueError(
                f"{what}: covariances must have shape (K, D, D) = ({k}, {self.dim}, {self.dim}), "
                f"got {tuple(self.covariances.shape)}"
            )
        for name, value in (("weights", self.weights), ("means", self.means), ("covariances", self.covariances)):
            if not torch.isfinite(value).all():
                row = int(torch.nonzero(~torch.isfinite(value).reshape(k, -1).all(dim=1))[0, 0])
                raise ValueError(f"{what}: {name} of component {row} contain NaN or inf")
        if (self.weights < 0).any():
            raise ValueError(f"{what}: weight of component {int(torch.nonzero(self.weights < 0)[0, 0])} is negative")
        total = float(self.weights.sum())
        if weights_sum_tol is not None and abs(total - 1) > weights_sum_tol:
            raise ValueError(f"{what}: weights sum to {total:.6g}, not 1")
        diagonal = torch.diagonal(self.covariances, dim1=1, dim2=2).abs()
        scale = torch.sqrt(diagonal[:, :, None] * diagonal[:, None, :])
        asymmetric = ((self.covariances - self.covariances.transpose(1, 2)).abs() > 1e-8 * scale).any(dim=(1, 2))
        if asymmetric.any():
            raise ValueError(f"{what}: covariance of component {int(torch.nonzero(asymmetric)[0, 0])} is not symmetric")
        problem = self.first_invalid_component()
        if problem is not None:
            raise ValueError(f"{what}: component {problem[0]} {problem[1]}")

    def n_parameters(self) -> int:
        """Free parameters: K-1 weights, K*D means, K*D(D+1)/2 covariance entries."""
        k, d = self.n_components, self.dim
        return (k - 1) + k * d + k * d * (d + 1) // 2

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw n points from the mixture on the CPU; returns (samples (n, D), component labels (n,))."""
        cpu = self.to(device="cpu")
        labels = torch.multinomial(cpu.weights, n, replacement=True, generator=generator)
        chol = torch.linalg.cholesky(cpu.covariances)
        z = torch.randn(n, self.dim, generator=generator, dtype=cpu.means.dtype)
        samples = cpu.means[labels] + (chol[labels] @ z.unsqueeze(-1)).squeeze(-1)
        return samples, labels
