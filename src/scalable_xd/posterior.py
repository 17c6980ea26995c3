"""Posterior moments of each point's true value v_i given its noisy observation x_i ("denoising").

Under component j, v_i | x_i is Gaussian with mean b_ij = m_j + V_j R_i^T u_ij and covariance
B_ij = V_j - V_j R_i^T T_ij^-1 R_i V_j; mixing over j with responsibilities r_ij gives the mean
sum_j r_ij b_ij and the covariance sum_j r_ij [B_ij + (b_ij - mean)(b_ij - mean)^T]. Unlike the fitting
pass this forms per-pair D x D matrices, so it runs in chunks of bounded size.
"""

from __future__ import annotations

import torch

from .kernel.dispatch import chunks, patterns
from .kernel.linalg import convolved_terms
from .mixture import Mixture

# Pairs per chunk: the (pairs, D, D) temporaries stay near 10 MB in float64 at D = 7.
_MAX_PAIRS = 1 << 14


def posterior_moments(x, S, mixture: Mixture, R=None, observed=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (B, D) and covariance (B, D, D) of p(v_i | x_i) for a batch; with ``observed`` (B, d), given the
    observed entries only (R_i selecting them, per pattern of observed entries)."""
    if observed is not None:
        mean = torch.empty(x.shape[0], mixture.dim, dtype=x.dtype, device=x.device)
        cov = torch.empty(x.shape[0], mixture.dim, mixture.dim, dtype=x.dtype, device=x.device)
        eye = torch.eye(mixture.dim, dtype=x.dtype, device=x.device)
        for rows, dims in patterns(observed):
            R_rows = eye[dims].expand(len(rows), -1, -1)
            mean[rows], cov[rows] = posterior_moments(x[rows][:, dims], S[rows][:, dims][:, :, dims], mixture, R_rows)
        return mean, cov
    mixture = mixture.to(dtype=x.dtype)
    V = mixture.covariances
    means, covs = [], []
    for part in chunks(x.shape[0], mixture.n_components, _MAX_PAIRS):
        Rp = None if R is None else R[part]
        chol, u, log_dens = convolved_terms(x[part], S[part], mixture, Rp, part.start)
        resp = torch.softmax(log_dens, dim=1)
        if Rp is None:
            v_rt = V.unsqueeze(0).expand(u.shape[0], -1, -1, -1)  # V R^T with R = I
        else:
            v_rt = V.unsqueeze(0) @ Rp.mT.unsqueeze(1)  # (B, K, D, d)
        b = mixture.means + (v_rt @ u.unsqueeze(-1)).squeeze(-1)
        solved = torch.cholesky_solve(v_rt.mT, chol)  # T^-1 R V, (B, K, d, D)
        B = V - v_rt @ solved
        mean = (resp.unsqueeze(-1) * b).sum(1)
        centred = b - mean.unsqueeze(1)
        cov = (resp[..., None, None] * (B + centred.unsqueeze(-1) * centred.unsqueeze(-2))).sum(1)
        means.append(mean)
        covs.append(0.5 * (cov + cov.mT))
    return torch.cat(means), torch.cat(covs)
