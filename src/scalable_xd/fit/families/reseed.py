"""Dead components re-seeded: a component whose weight falls below one star's worth is capacity the user
asked for and no longer gets, so at an epoch's end it takes half of the heaviest component, split along
that one's principal axis, as split-and-merge splits (Ueda et al. 2000; ``split_merge.apply_move``) and
as scikit-learn's ``MiniBatchKMeans`` reassigns its empty centres. Minibatch EM's step sizes can leave a
component with no star's responsibility within an epoch (its weight then decays geometrically to 1e-100
and below); batch EM's and SGD's components rarely die so.
"""

from __future__ import annotations

import torch

from ...mixture import Mixture


def dead_components(weights: torch.Tensor, below: float, held: torch.Tensor | None = None) -> torch.Tensor:
    """The indices of the components of weight below ``below`` (1/N: fewer than one star's worth), those
    ``held`` (fixed parameters) left out."""
    dead = weights < below
    if held is not None:
        dead &= ~held
    return torch.nonzero(dead).flatten()


def reseeded(mixture: Mixture, dead: torch.Tensor, held: torch.Tensor | None = None) -> Mixture:
    """The mixture with each ``dead`` component, in turn, made one half of the heaviest component not
    ``held``: that one's weight shared between the two, its mean moved half a standard deviation each way
    along its principal axis, each half's covariance that one's less the shift's outer product."""
    weights, means, covs = mixture.weights.clone(), mixture.means.clone(), mixture.covariances.clone()
    donors = torch.ones_like(weights, dtype=torch.bool) if held is None else ~held
    donors[dead] = False
    for j in dead.tolist():
        l = int(torch.argmax(torch.where(donors, weights, torch.full_like(weights, -1.0))))  # noqa: E741
        eigenvalues, eigenvectors = torch.linalg.eigh(covs[l])
        delta = 0.5 * torch.sqrt(eigenvalues[-1]) * eigenvectors[:, -1]
        half_cov = covs[l] - torch.outer(delta, delta)
        weights[j] = weights[l] = weights[l] / 2
        means[j], means[l] = means[l] + delta, means[l] - delta
        covs[j], covs[l] = half_cov, half_cov.clone()
        donors[j] = True
    return Mixture(weights / weights.sum(), means, covs)  # the dead weights given up: at most K/N
