"""The statistics pass for noise given as per-point Gaussian mixtures (``data.noise_mixture``; Bovy 2014).

Each point stands for its M rows (x_i - o_im, S_im). A first pass gives each row's Gaussian-noise
likelihood p_im = sum_j alpha_j N(x_i - o_im | m_j, V_j + S_im), hence p(x_i) = sum_m beta_im p_im and
each row's share w_im = beta_im p_im / p(x_i) of its point. The second pass is the ordinary one over the
rows with point weights w_im: its responsibilities alpha_j N_ijm / p_im times w_im are the note's
responsibilities of the (component, noise component) pairs, r_ijm = alpha_j beta_im N_ijm / p(x_i), so
its sums are the EM step's. A pass costs two Gaussian passes over N M rows.
"""

from __future__ import annotations

import torch

from ..data.noise_mixture import NoiseMixture
from ..mixture import Mixture
from .statistics import Statistics, n_points, summed_loglik


def log_densities(x, S: NoiseMixture, mixture: Mixture, R, gaussian_log_densities, **options):
    """Per-point log p(x_i) (B,) and log sum_m beta_im alpha_j N_ijm (B, K), in x's dtype, from
    ``gaussian_log_densities`` over the rows (``dispatch.log_densities``, with ``options``)."""
    rows_x, rows_S, rows_R, log_beta = S.rows(x, R)
    b, m = log_beta.shape
    row_loglik, row_dens = gaussian_log_densities(rows_x, rows_S, mixture, rows_R, **options)
    loglik = torch.logsumexp(log_beta + row_loglik.view(b, m).double(), dim=1)
    log_dens = torch.logsumexp(log_beta.unsqueeze(-1) + row_dens.view(b, m, -1).double(), dim=1)
    return loglik.to(x.dtype), log_dens.to(x.dtype)


def row_shares(x, S: NoiseMixture, mixture: Mixture, R, gaussian_log_densities, **options):
    """The rows of each point (``NoiseMixture.rows``: x, S, R), log p(x_i) (B,) and each row's share
    w_im = beta_im p_im / p(x_i) (B, M), each point's summing to 1, in float64, from the first pass
    (``gaussian_log_densities``, ``dispatch.log_densities``, run with ``options``)."""
    rows_x, rows_S, rows_R, log_beta = S.rows(x, R)
    b, m = log_beta.shape
    row_loglik, _ = gaussian_log_densities(rows_x, rows_S, mixture, rows_R, **options)
    joint = log_beta + row_loglik.view(b, m).double()
    loglik = torch.logsumexp(joint, dim=1)
    return (rows_x, rows_S, rows_R), loglik, torch.exp(joint - loglik.unsqueeze(1))


def batch_statistics(
    x, S: NoiseMixture, mixture: Mixture, R, point_weights, gaussian_log_densities, gaussian_statistics, **options
) -> Statistics:
    """The per-component sums of a batch whose noise is a mixture (see the module), with the batch's
    log-likelihood sum_i w_i log p(x_i); ``gaussian_*`` are ``dispatch``'s passes, run with ``options``."""
    (rows_x, rows_S, rows_R), loglik, shares = row_shares(x, S, mixture, R, gaussian_log_densities, **options)
    if point_weights is not None:
        shares = shares * point_weights.double().unsqueeze(1)
    stats = gaussian_statistics(
        rows_x, rows_S, mixture, rows_R, point_weights=shares.reshape(-1).to(x.dtype), **options
    )
    stats.n_points = n_points(x, point_weights)
    stats.loglik = summed_loglik(loglik, point_weights)
    return stats
