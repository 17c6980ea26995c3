"""Reference statistics pass by batched LAPACK calls on (B, K, d, d) stacks; supports projections R_i.

Straightforward and general, but LAPACK on 7x7 matrices tops out near 1 M pairs per second on two cores;
``unrolled`` is the fast path for R = I. This one also serves the posterior, which needs the
per-pair factors.
"""

from __future__ import annotations

import torch

from ..mixture import Mixture
from .statistics import (
    LOG_2PI,
    Criteria,
    Statistics,
    assign,
    criteria_sums,
    n_points,
    raise_for_failed_pairs,
    summed_loglik,
)


def convolved_terms(x, S, mixture: Mixture, R=None, row_offset: int = 0):
    """Per-pair Cholesky factors of T_ij (B, K, d, d), u_ij = T_ij^-1 d_ij (B, K, d) and
    log alpha_j N(x_i | R_i m_j, T_ij) (B, K)."""
    V, m = mixture.covariances, mixture.means
    if R is None:
        T = V.unsqueeze(0) + S.unsqueeze(1)
        diff = x.unsqueeze(1) - m.unsqueeze(0)
    else:
        T = R.unsqueeze(1) @ V.unsqueeze(0) @ R.mT.unsqueeze(1) + S.unsqueeze(1)
        diff = x.unsqueeze(1) - torch.einsum("bij,kj->bki", R, m)
    chol, info = torch.linalg.cholesky_ex(T)
    raise_for_failed_pairs(info > 0, row_offset)
    u = torch.cholesky_solve(diff.unsqueeze(-1), chol).squeeze(-1)
    half_logdet = torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)
    log_dens = mixture.log_weights - half_logdet - 0.5 * ((diff * u).sum(-1) + x.shape[1] * LOG_2PI)
    raise_for_failed_pairs(torch.isnan(log_dens), row_offset)
    return chol, u, log_dens


def linalg_chunk(
    x,
    S,
    mixture: Mixture,
    R,
    with_stats: bool,
    row_offset: int,
    point_weights=None,
    uniforms=None,
    with_criteria: bool = False,
):
    """(log p(x_i) (B,), log alpha_j N_ij (B, K), Statistics or None) for one chunk (``point_weights`` and
    ``uniforms`` as in ``statistics.assign``)."""
    chol, u, log_dens = convolved_terms(x, S, mixture, R, row_offset)
    loglik = torch.logsumexp(log_dens, dim=1)
    if not with_stats:
        return loglik, log_dens, None
    resp = assign(torch.exp(log_dens - loglik.unsqueeze(1)), point_weights, uniforms, dim=1)
    t_inv = torch.cholesky_inverse(chol)
    if R is not None:
        u = torch.einsum("bij,bki->bkj", R, u)
        t_inv = R.mT.unsqueeze(1) @ t_inv @ R.unsqueeze(1)
    ru = resp.unsqueeze(-1) * u
    stats = Statistics(
        n_points(x, point_weights),
        resp.sum(0),
        ru.sum(0),
        torch.einsum("bki,bkj->kij", ru, u),
        torch.einsum("bk,bkij->kij", resp, t_inv),
        summed_loglik(loglik, point_weights),
        Criteria(*criteria_sums(log_dens, loglik, mixture.log_weights, point_weights, dim=1))
        if with_criteria
        else None,
    )
    return loglik, log_dens, stats
