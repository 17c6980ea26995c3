"""The parameters of a Gaussian mixture over the true (noise-free) values, and what follows from them alone."""

from __future__ import annotations

from dataclasses import dataclass

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

    def to(self, device=None, dtype=None) -> Mixture:
        return Mixture(
            self.weights.to(device=device, dtype=dtype),
            self.means.to(device=device, dtype=dtype),
            self.covariances.to(device=device, dtype=dtype),
        )

    def clone(self) -> Mixture:
        return Mixture(self.weights.clone(), self.means.clone(), self.covariances.clone())

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
        return None

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
