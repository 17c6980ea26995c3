"""Batch EM's update (Bovy, Hogg & Roweis 2011) from the kernel's per-component sums (q, U, UU, P), and what
every rule shares: the regularisation W, the fixed parameters, the E-step mixture's prior, and the clipping of
covariances that rounding left indefinite.

Rounding. The scatter V + V (...) V is positive semi-definite in exact arithmetic. Where a component holds
a handful of stars whose scatter is nearly singular in some direction (and the noise there is tiny, like
Gaia's positions), the float32 sums leave it indefinite by rounding: the update cancels terms of the size
of V, so the error is ~eps ‖V‖, which can exceed w. Such eigenvalues (down to -1e-4 times V's largest
variance) are clipped to zero before the regularisation is added; anything more negative is not rounding
and is left for the divergence check to report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch

from ... import deferred_checks
from ...kernel.statistics import Statistics
from ...mixture import Mixture


def symmetrise(a: torch.Tensor) -> torch.Tensor:
    return 0.5 * (a + a.mT)


def ridge_vector(w, like: torch.Tensor) -> torch.Tensor | None:
    """The regularisation's diagonal W (D,) in ``like``'s dtype and device (D its last dimension): a number
    w gives Bovy et al.'s w I, a (D,) tensor is W itself (``driver.regularisation``); None for none (w = 0)."""
    if w is None:
        return None
    if isinstance(w, torch.Tensor):
        return w.to(like)
    return None if w == 0 else torch.full(like.shape[-1:], float(w), dtype=like.dtype, device=like.device)


_ROUNDING = 1e-4  # negative eigenvalues down to this fraction of V's largest variance count as rounding


def psd(a: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Symmetrise ``a`` (K, D, D), computed from covariances ``V``, and clip the eigenvalues that rounding
    pushed below zero (see above)."""
    a = symmetrise(a)
    _, info = torch.linalg.cholesky_ex(a)
    failed = (info > 0) & torch.isfinite(a).all(dim=(1, 2))
    checks = deferred_checks.active()
    if checks is not None:  # rare: the epoch runs again with the test made here
        checks.note(failed)
        return a
    suspects = torch.nonzero(failed).flatten()
    if len(suspects) == 0:
        return a
    a = a.clone()
    a[suspects] = clip_rounding(a[suspects], V[suspects])
    return a


def clip_rounding(a: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """The symmetric ``a`` (n, D, D) with its negative eigenvalues set to zero where they are rounding
    (no lower than ``-_ROUNDING`` times the largest variance of ``V``); the others as they are."""
    eig, vec = torch.linalg.eigh(a)
    scale = torch.diagonal(V, dim1=-2, dim2=-1).amax(dim=-1)
    rounding = (eig[:, 0] < 0) & (eig[:, 0] >= -_ROUNDING * scale)
    clipped = (vec * eig.clamp_min(0.0).unsqueeze(-2)) @ vec.mT
    return torch.where(rounding[:, None, None], symmetrise(clipped), a)


def live_components(q: torch.Tensor) -> torch.Tensor:
    """Components with a usable responsibility sum; the others are frozen, as in Bovy's reference code."""
    return q > torch.finfo(q.dtype).tiny


@dataclass(frozen=True)
class FixedParameters:
    """Which components keep their weight, mean or covariance (Bovy et al.'s fixamp, fixmean, fixcovar),
    as (K,) boolean masks.

    A fixed mean changes the covariance update too: the scatter is then taken about the fixed mean, not
    about the mean the data would give (``sum r [(b - m)(b - m)^T + B] = q V + V (UU - P) V`` without the
    recentring term), as in Bovy's proj_EM_step. Fixed weights stay; the free ones share what is left,
    1 - sum of the fixed ones, in proportion to their own updates.
    """

    weights: torch.Tensor
    means: torch.Tensor
    covariances: torch.Tensor
    weight_values: torch.Tensor  # (K,) the weights the fixed ones keep (the initial weights)

    @classmethod
    def none(cls, k: int, device=None) -> FixedParameters:
        free = torch.zeros(k, dtype=torch.bool, device=device)
        return cls(free, free, free, torch.full((k,), 1.0 / k, dtype=torch.float64, device=device))

    def any(self) -> bool:
        return self.has_fixed_weights or self.has_fixed_means or self.has_fixed_covariances

    # Asked once, not at every step: on a GPU each answer is a wait for the device.
    @cached_property
    def has_fixed_weights(self) -> bool:
        return bool(self.weights.any())

    @cached_property
    def has_fixed_means(self) -> bool:
        return bool(self.means.any())

    @cached_property
    def has_fixed_covariances(self) -> bool:
        return bool(self.covariances.any())


def share_weights(proposed: torch.Tensor, current: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    """Weights that keep ``current`` where ``fixed`` and give the free components 1 - sum(fixed weights) in
    proportion to ``proposed`` (the update's unnormalised weights). With nothing fixed, ``proposed``
    normalised, to the bit; computed without asking the device anything."""
    free = torch.where(fixed, torch.zeros_like(proposed), proposed)
    total = free.sum()
    left = 1.0 - torch.where(fixed, current, torch.zeros_like(current)).sum()
    return torch.where(fixed, current, free / torch.where(total > 0, total, torch.ones_like(total)) * left)


def em_update(
    mixture: Mixture, stats: Statistics, w: float | torch.Tensor | None, fixed: FixedParameters | None = None
) -> Mixture:
    """One batch-EM M-step from sums over the whole data set (Bovy, Hogg & Roweis 2011).

    Regularisation as in their code: V = (sum r [(b - m')(b - m')^T + B] + W) / (q + 1) with W = diag(w)
    (their w I where every feature has the same w, see ``regularisation``), and divided by q alone where
    w is None (their w = 0). A component whose q underflows to zero gets weight zero and keeps
    its mean and covariance (it is frozen, as in the reference implementation). ``fixed``: parameters kept
    as they are (see ``FixedParameters``).
    """
    V, m = mixture.covariances, mixture.means
    fixed = fixed or FixedParameters.none(len(m), m.device)
    w = ridge_vector(w, m)
    q = stats.q.to(V.dtype)
    live = live_components(q)
    q_safe = torch.where(live, q, torch.ones_like(q))
    u_bar = stats.U.to(V.dtype) / q_safe[:, None]
    recentre = torch.where(fixed.means[:, None, None], 0.0, u_bar[:, :, None] * u_bar[:, None, :])
    inner = (stats.UU - stats.P).to(V.dtype) / q_safe[:, None, None] - recentre
    scatter = psd(V + V @ inner @ V, V)  # sum r [(b - m')(b - m')^T + B] / q, m' the new (or fixed) mean
    if w is not None:
        new_cov = (q[:, None, None] * scatter + torch.diag(w)) / (q[:, None, None] + 1.0)
    else:
        new_cov = scatter
    new_mean = m + (V @ u_bar.unsqueeze(-1)).squeeze(-1)
    return Mixture(
        weights=share_weights(q, mixture.weights, fixed.weights) if fixed.has_fixed_weights else q / q.sum(),
        means=torch.where((live & ~fixed.means)[:, None], new_mean, m),
        covariances=torch.where((live & ~fixed.covariances)[:, None, None], new_cov, V),
    )


def regularised(
    state: Mixture, w: float | torch.Tensor | None, fixed: FixedParameters | None = None, data_size: float | None = None
) -> Mixture:
    """The mixture an online-EM state describes: its running weights (the fixed ones restored, see
    ``FixedParameters``) and the E-step's covariances ``e_step_covariances``.

    Online EM keeps its running statistics free of the regularisation and adds it only to the covariance
    the E-step uses and the fit reports. Adding it to the running state instead feeds it back through every
    later step: at the fixed point each covariance then carries about ``W / step`` extra.
    """
    w = ridge_vector(w, state.means)
    if (fixed is None or not fixed.any()) and data_size is None:  # asked of the host once (FixedParameters)
        if w is None:
            return state
        return Mixture(state.weights, state.means, state.covariances + torch.diag(w))
    fixed = fixed or FixedParameters.none(state.n_components, state.means.device)
    weights = share_weights(state.weights, fixed.weight_values, fixed.weights) if fixed.any() else state.weights
    return Mixture(weights, state.means, e_step_covariances(state, w, fixed, data_size))


def e_step_covariances(
    state: Mixture, w: float | torch.Tensor | None, fixed: FixedParameters, data_size: float | None
) -> torch.Tensor:
    """The covariances an online-EM state's E-step uses (fixed ones as they are).

    ``data_size`` None: the running covariances plus ``W = diag(w)``, as the paper's code adds its w I after
    every update; at the fixed point each variance is then ``w`` above the data's. A number N (the training
    data's total weight): the prior that Bovy et al.'s batch-EM update V = (sum + W) / (q + 1) is the
    maximum of, with the component's share of the data, c = qhat N, in place of q:
    V = (c Vr + W) / (c + 1), so that online EM and batch EM have the same fixed point.
    """
    Vr = state.covariances
    w = ridge_vector(w, state.means)
    if w is None:  # with w = 0 Bovy et al. divide by q alone: no prior
        return Vr
    if data_size is None:
        return Vr + (~fixed.covariances).to(Vr.dtype)[:, None, None] * torch.diag(w)
    count = (state.weights * data_size)[:, None, None]
    prior = (count * Vr + torch.diag(w)) / (count + 1.0)
    return torch.where(fixed.covariances[:, None, None], Vr, prior)


def stacked_fixed(fixes: list[FixedParameters]) -> FixedParameters:
    """F fits' fixed parameters with a leading fit axis."""
    return FixedParameters(
        *(torch.stack([getattr(f, field.name) for f in fixes]) for field in dataclasses.fields(FixedParameters))
    )
