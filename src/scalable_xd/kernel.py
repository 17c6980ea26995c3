"""The one statistics pass that every fitter, the scorer and the posterior stand on.

For a batch of points and every component j, with T_ij = R_i V_j R_i^T + S_i, d_ij = x_i - R_i m_j and
u_ij = T_ij^-1 d_ij::

    log N_ij = -(d.u + log det T + d log 2 pi) / 2,     r_ij = softmax_j(log alpha_j + log N_ij)
    q_j = sum_i r_ij                 U_j  = sum_i r_ij R_i^T u_ij
    UU_j = sum_i r_ij R_i^T u u^T R_i    P_j = sum_i r_ij R_i^T T_ij^-1 R_i

These sums are all that batch EM, minibatch EM and SGD need (see ``updates``): the posterior mean and
covariance of each point's true value, b_ij = m_j + V_j R^T u and B_ij = V_j - V_j R^T T^-1 R V_j, enter
only through ``sum r b = q m + V U`` and ``sum r [(b - m)(b - m)^T + B] = q V + V (UU - P) V``, so no per-pair
B_ij is ever formed.

The pass runs over the batch in chunks of at most ``max_pairs`` (point, component) pairs, so memory is
bounded whatever the batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import NotPositiveDefiniteError
from .mixture import Mixture

LOG_2PI = math.log(2.0 * math.pi)

# (point, component) pairs per chunk: bounds the (pairs, D, D) temporaries to ~25 MB in float64 at D = 7.
DEFAULT_MAX_PAIRS = 1 << 16


@dataclass
class Statistics:
    """Per-component sums over a batch, and the per-point log-likelihoods they came with."""

    loglik: torch.Tensor  # (B,)
    q: torch.Tensor  # (K,)
    U: torch.Tensor  # (K, D)
    UU: torch.Tensor  # (K, D, D)
    P: torch.Tensor  # (K, D, D)

    @property
    def n_points(self) -> int:
        return self.loglik.shape[0]

    def combine(self, other: "Statistics") -> "Statistics":
        return Statistics(
            torch.cat([self.loglik, other.loglik]),
            self.q + other.q,
            self.U + other.U,
            self.UU + other.UU,
            self.P + other.P,
        )


def _raise_for_failed_pairs(failed: torch.Tensor, row_offset: int) -> None:
    if failed.any():
        row, component = (int(v) for v in torch.nonzero(failed)[0])
        raise NotPositiveDefiniteError(row_offset + row, component)


def convolved_terms(x, S, mixture: Mixture, R=None, row_offset: int = 0):
    """Per-pair Cholesky factors of T_ij (B, K, d, d), u_ij = T_ij^-1 d_ij (B, K, d) and
    log alpha_j N(x_i | R_i m_j, T_ij) (B, K), by batched LAPACK calls."""
    V, m = mixture.covariances, mixture.means
    if R is None:
        T = V.unsqueeze(0) + S.unsqueeze(1)
        diff = x.unsqueeze(1) - m.unsqueeze(0)
    else:
        T = R.unsqueeze(1) @ V.unsqueeze(0) @ R.mT.unsqueeze(1) + S.unsqueeze(1)
        diff = x.unsqueeze(1) - torch.einsum("bij,kj->bki", R, m)
    chol, info = torch.linalg.cholesky_ex(T)
    _raise_for_failed_pairs(info > 0, row_offset)
    u = torch.cholesky_solve(diff.unsqueeze(-1), chol).squeeze(-1)
    half_logdet = torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)
    log_dens = mixture.log_weights - half_logdet - 0.5 * ((diff * u).sum(-1) + x.shape[1] * LOG_2PI)
    _raise_for_failed_pairs(torch.isnan(log_dens), row_offset)
    return chol, u, log_dens


def _linalg_chunk(x, S, mixture: Mixture, R, with_stats: bool, row_offset: int):
    """Batched-LAPACK evaluation of one chunk: log alpha_j N_ij (B, K) and, if asked, the sums."""
    chol, u, log_dens = convolved_terms(x, S, mixture, R, row_offset)
    loglik = torch.logsumexp(log_dens, dim=1)
    if not with_stats:
        return loglik, log_dens, None
    resp = torch.exp(log_dens - loglik.unsqueeze(1))
    t_inv = torch.cholesky_inverse(chol)
    if R is not None:
        u = torch.einsum("bij,bki->bkj", R, u)
        t_inv = R.mT.unsqueeze(1) @ t_inv @ R.unsqueeze(1)
    ru = resp.unsqueeze(-1) * u
    stats = Statistics(
        loglik,
        resp.sum(0),
        ru.sum(0),
        torch.einsum("bki,bkj->kij", ru, u),
        torch.einsum("bk,bkij->kij", resp, t_inv),
    )
    return loglik, log_dens, stats


def chunks(n_points: int, n_components: int, max_pairs: int):
    step = max(1, max_pairs // max(1, n_components))
    for start in range(0, n_points, step):
        yield slice(start, min(start + step, n_points))


def log_densities(x, S, mixture: Mixture, R=None, max_pairs: int = DEFAULT_MAX_PAIRS):
    """Per-point log-likelihood (B,) and log alpha_j N(x_i | R_i m_j, T_ij) (B, K) for one batch."""
    logliks, dens = [], []
    for part in chunks(x.shape[0], mixture.n_components, max_pairs):
        loglik, log_dens, _ = _linalg_chunk(
            x[part], S[part], mixture, None if R is None else R[part], False, part.start
        )
        logliks.append(loglik)
        dens.append(log_dens)
    return torch.cat(logliks), torch.cat(dens)


def batch_statistics(x, S, mixture: Mixture, R=None, max_pairs: int = DEFAULT_MAX_PAIRS) -> Statistics:
    """The per-component sums q, U, UU, P and the per-point log-likelihoods for one batch."""
    total = None
    for part in chunks(x.shape[0], mixture.n_components, max_pairs):
        _, _, stats = _linalg_chunk(x[part], S[part], mixture, None if R is None else R[part], True, part.start)
        total = stats if total is None else total.combine(stats)
    return total
