"""Posterior moments of each point's true value v_i given its noisy observation x_i ("denoising").

Under component j, v_i | x_i is Gaussian with mean b_ij = m_j + V_j R_i^T u_ij and covariance
B_ij = V_j - V_j R_i^T T_ij^-1 R_i V_j, which for R_i = I is computed as V_j T_ij^-1 S_i (the same matrix,
without the subtraction that loses a posterior 1e18 times narrower than V_j); mixing over j with
responsibilities r_ij gives the mean sum_j r_ij b_ij and the covariance
sum_j r_ij [B_ij + (b_ij - mean)(b_ij - mean)^T]. Unlike the fitting pass this forms per-pair D x D
matrices, so it runs in chunks of bounded size.
"""

from __future__ import annotations

import math

import torch

from .data.noise_mixture import NoiseMixture
from .kernel.dispatch import chunks, log_densities, patterns
from .kernel.linalg import convolved_terms
from .kernel.noise_mixture_pass import row_shares
from .mixture import Mixture

# Pairs per chunk: the (pairs, D, D) temporaries stay near 10 MB in float64 at D = 7.
_MAX_PAIRS = 1 << 14


def posterior_summary(x, S, mixture: Mixture, R=None, observed=None, quantiles=None, background=None):
    """(mean (B, D), covariance (B, D, D), quantiles (B, D, Q) or None) of p(v_i | x_i) for a batch; with
    ``observed`` (B, d), given the observed entries only (R_i selecting them, per pattern of observed
    entries). ``quantiles``, a sequence of probabilities in (0, 1), asks for those quantiles of each
    feature's marginal posterior, a mixture of Gaussians N(b_ijd, B_ijdd) with weights r_ij
    (``marginal_quantiles``). With a uniform ``background`` (``background.Background``), the posterior of a
    point that is the background's is its likelihood N(x_i, S_i) (a flat prior, inside the box), one more
    term of the mixture with weight r_i."""
    if background is not None and (R is not None or observed is not None):
        raise ValueError("posterior: a model with a background takes data without R or missing entries")
    if isinstance(S, NoiseMixture):
        if quantiles is not None or background is not None:
            raise ValueError("posterior: noise mixtures give the posterior's moments, not quantiles, and no background")
        return (*_mixture_noise_moments(x, S, mixture, R), None)
    probs = None if quantiles is None else torch.as_tensor(quantiles, dtype=torch.float64, device=x.device)
    if observed is not None:
        mean = torch.empty(x.shape[0], mixture.dim, dtype=x.dtype, device=x.device)
        cov = torch.empty(x.shape[0], mixture.dim, mixture.dim, dtype=x.dtype, device=x.device)
        quant = (
            None if probs is None else torch.empty(x.shape[0], mixture.dim, len(probs), dtype=x.dtype, device=x.device)
        )
        eye = torch.eye(mixture.dim, dtype=x.dtype, device=x.device)
        for rows, dims in patterns(observed):
            R_rows = eye[dims].expand(len(rows), -1, -1)
            m, c, q = posterior_summary(x[rows][:, dims], S[rows][:, dims][:, :, dims], mixture, R_rows, None, probs)
            mean[rows], cov[rows] = m, c
            if quant is not None:
                quant[rows] = q
        return mean, cov, quant
    mixture = mixture.to(dtype=x.dtype)
    V = mixture.covariances
    means, covs, quants = [], [], []
    for part in chunks(x.shape[0], mixture.n_components, _MAX_PAIRS):
        Rp = None if R is None else R[part]
        chol, u, log_dens = convolved_terms(x[part], S[part], mixture, Rp, part.start)
        if background is not None:  # the background's term beside the components'
            log_background = background.log_weighted_density(x[part])[:, None].to(x.dtype)
            log_dens = torch.cat([log_dens + math.log1p(-background.weight), log_background], 1)
        resp = torch.softmax(log_dens, dim=1)
        if Rp is None:
            v_rt = V.unsqueeze(0).expand(u.shape[0], -1, -1, -1)  # V R^T with R = I
        else:
            v_rt = V.unsqueeze(0) @ Rp.mT.unsqueeze(1)  # (B, K, D, d)
        b = mixture.means + (v_rt @ u.unsqueeze(-1)).squeeze(-1)
        if Rp is None:  # B = V T^-1 S: no subtraction, so exact where S is 1e-18 of V (Gaia's positions)
            Sp = S[part].unsqueeze(1).expand(-1, V.shape[0], -1, -1)
            B = V @ torch.cholesky_solve(Sp, chol)
            B = 0.5 * (B + B.mT)
        else:
            B = V - v_rt @ torch.cholesky_solve(v_rt.mT, chol)  # V - V R^T T^-1 R V
        if background is not None:
            b, B = torch.cat([b, x[part].unsqueeze(1)], 1), torch.cat([B, S[part].unsqueeze(1)], 1)
        mean, cov = mixed_moments(resp, b, B)
        means.append(mean)
        covs.append(cov)
        if probs is not None:
            sds = torch.diagonal(B, dim1=-2, dim2=-1).clamp_min(0.0).sqrt()
            quants.append(marginal_quantiles(resp, b, sds, probs).to(x.dtype))
    return torch.cat(means), torch.cat(covs), (torch.cat(quants) if probs is not None else None)


def _mixture_noise_moments(x, S: NoiseMixture, mixture: Mixture, R=None):
    """(mean (B, D), covariance (B, D, D)) of p(v_i | x_i) where the noise is a mixture: the moments of each
    of a point's rows (x_i - o_im, S_im), mixed with the rows' shares beta_im p_im / p(x_i)
    (``kernel.noise_mixture_pass``)."""
    (rows_x, rows_S, rows_R), _, shares = row_shares(x, S, mixture, R, log_densities, backend="linalg")
    b, m = shares.shape
    row_mean, row_cov, _ = posterior_summary(rows_x, rows_S, mixture, rows_R)
    row_mean, row_cov = row_mean.view(b, m, -1), row_cov.view(b, m, mixture.dim, mixture.dim)
    return mixed_moments(shares.to(x.dtype), row_mean, row_cov)


def mixed_moments(weights, means, covariances):
    """Mean (B, D) and covariance (B, D, D) of mixtures of Gaussians with ``weights`` (B, P), ``means``
    (B, P, D) and ``covariances`` (B, P, D, D): sum_p w_p mu_p, and sum_p w_p [C_p + (mu_p - mean)(..)^T]."""
    mean = (weights.unsqueeze(-1) * means).sum(1)
    centred = means - mean.unsqueeze(1)
    cov = (weights[..., None, None] * (covariances + centred.unsqueeze(-1) * centred.unsqueeze(-2))).sum(1)
    return mean, 0.5 * (cov + cov.mT)


def marginal_quantiles(weights, means, sds, probs, iterations: int = 64) -> torch.Tensor:
    """Quantiles (B, D, Q) at ``probs`` (Q,) of the 1-D Gaussian mixtures with ``weights`` (B, K) and, per
    feature, ``means`` and standard deviations ``sds`` (B, K, D): bisection in float64 between the
    components' 40-sigma bounds, ``iterations`` halvings (64 reach the float64 grid), on the log of the
    mixture's CDF below the median and of its survival function above it, so that tail probabilities
    down to 1e-300 are met (the CDF itself underflows beyond ~8 sigma, where ndtr's relative error grows)."""
    w, m, s = weights.double()[:, :, None, None], means.double()[..., None], sds.double()[..., None]
    lo = (m - 40 * s).amin(dim=1)  # (B, D, 1)
    hi = (m + 40 * s).amax(dim=1)
    lo, hi = lo.expand(-1, -1, len(probs)).clone(), hi.expand(-1, -1, len(probs)).clone()
    target = probs.double().to(lo.device)
    lower = target <= 0.5
    log_target = torch.where(lower, torch.log(target), torch.log1p(-target))
    log_w = torch.log(w)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        z = (mid.unsqueeze(1) - m) / s.clamp_min(torch.finfo(torch.float64).tiny)
        log_cdf = torch.logsumexp(log_w + torch.special.log_ndtr(z), dim=1)  # (B, D, Q)
        log_sf = torch.logsumexp(log_w + torch.special.log_ndtr(-z), dim=1)
        below = torch.where(lower, log_cdf < log_target, log_sf > log_target)
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    return 0.5 * (lo + hi)
