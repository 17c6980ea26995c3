"""Parameter updates from the kernel's per-component sums (q, U, UU, P): EM, online EM and SGD gradients.

Centred covariance update. With b_ij = m_j + V_j u_ij the posterior mean of point i's true value under
component j and B_ij its covariance, the sums the paper's eq. 5 needs are, per component,

    sum r b = q m + V U,      sum r [(b - m)(b - m)^T + B] = q V + V (UU - P) V.

An online-EM step of size lambda from (qhat, m, V), with sums normalised by the batch size, is then exactly

    qhat' = (1 - lambda) qhat + lambda q,       g = lambda U / qhat',
    m'    = m + V g,                            V' = V + V [lambda (UU - P) / qhat' - g g^T] V,

which equals the paper's eq. 7 (V = S/q - m m^T) in exact arithmetic but never subtracts the large m m^T
terms, so it stays accurate when the means are far larger than the spread. With lambda = 1 it is one
batch-EM step. (The paper's appendix A writes adjust(V, s, c, d) as sV + (c-d)(c+d)^T/2 + (c+d)(c-d)^T/2
= sV + cc^T - dd^T, which differs from its stated identity s(V + cc^T) - dd^T whenever s != 1; the form
above needs no such recentring.)

Rounding. The scatter V + V (...) V is positive semi-definite in exact arithmetic. Where a component holds
a handful of stars whose scatter is nearly singular in some direction (and the noise there is tiny, like
Gaia's positions), the float32 sums leave it indefinite by rounding: the update cancels terms of the size
of V, so the error is ~eps ‖V‖, which can exceed w. Such eigenvalues (down to -1e-4 times V's largest
variance) are clipped to zero before the regularisation is added; anything more negative is not rounding
and is left for the divergence check to report.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .. import deferred_checks
from ..kernel.statistics import Statistics
from ..mixture import Mixture


def _symmetrise(a: torch.Tensor) -> torch.Tensor:
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


def _psd(a: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Symmetrise ``a`` (K, D, D), computed from covariances ``V``, and clip the eigenvalues that rounding
    pushed below zero (see above)."""
    a = _symmetrise(a)
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
    return torch.where(rounding[:, None, None], _symmetrise(clipped), a)


def _live(q: torch.Tensor) -> torch.Tensor:
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
    live = _live(q)
    q_safe = torch.where(live, q, torch.ones_like(q))
    u_bar = stats.U.to(V.dtype) / q_safe[:, None]
    recentre = torch.where(fixed.means[:, None, None], 0.0, u_bar[:, :, None] * u_bar[:, None, :])
    inner = (stats.UU - stats.P).to(V.dtype) / q_safe[:, None, None] - recentre
    scatter = _psd(V + V @ inner @ V, V)  # sum r [(b - m')(b - m')^T + B] / q, m' the new (or fixed) mean
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


def online_em_update(
    state: Mixture,
    stats: Statistics,
    step: float | torch.Tensor,
    w: float | torch.Tensor | None,
    fixed: FixedParameters | None = None,
    data_size: float | None = None,
) -> Mixture:
    """One minibatch (online) EM step in the centred form above; returns the new running state.

    ``state`` holds the running weights, means and unregularised covariances Vr; the statistics were
    computed with the E-step covariance V (``e_step_covariances``: Vr + W, or the prior's with
    ``data_size``). The posterior scatter of the batch about m is then q V + V (UU - P) V, so the running
    centred scatter updates exactly as

        Vr' = Vr + (lambda q_b / qhat') (V - Vr) + V [lambda (UU - P) / qhat' - g g^T] V,

    which is the module docstring's form when V = Vr. A fixed mean drops the recentring term g g^T (the
    scatter is kept about it); a fixed covariance keeps Vr, which then holds the fixed covariance itself
    (``regularised`` adds no W to it). The running weights always update: they normalise the means'
    and covariances' running sums; fixed weights are restored only in the mixture ``regularised`` gives.
    """
    Vr, m = state.covariances, state.means
    fixed = fixed or FixedParameters.none(len(m), m.device)
    w = ridge_vector(w, m)
    V = e_step_covariances(state, w, fixed, data_size)
    n = stats.n_points
    q_b = stats.q / n
    q_new = (1.0 - step) * state.weights + step * q_b
    live = _live(q_new)
    q_safe = torch.where(live, q_new, torch.ones_like(q_new))
    g = step * stats.U / (n * q_safe[:, None])
    recentre = torch.where(fixed.means[:, None, None], 0.0, g[:, :, None] * g[:, None, :])
    inner = step * (stats.UU - stats.P) / (n * q_safe[:, None, None]) - recentre
    if w is None:  # V = Vr
        shift = torch.zeros_like(Vr)
    elif data_size is None:  # V - Vr = W
        shift = (step * q_b / q_safe)[:, None, None] * torch.diag(w)
    else:
        shift = (step * q_b / q_safe)[:, None, None] * (V - Vr)
    new_cov = _psd(Vr + shift + V @ inner @ V, V)
    new_mean = m + (V @ g.unsqueeze(-1)).squeeze(-1)
    return Mixture(
        weights=q_new,
        means=torch.where((live & ~fixed.means)[:, None], new_mean, m),
        covariances=torch.where((live & ~fixed.covariances)[:, None, None], new_cov, Vr),
    )


def online_em_update_naive(
    state: Mixture, stats: Statistics, step: float, w: float | torch.Tensor | None, data_size: float | None = None
) -> Mixture:
    """The same step written as the paper's eq. 6-7: running raw sums, then Vr = S/q - m m^T.

    Kept for comparison (``covariance_update="naive"``): subtracting m m^T loses the covariance once the
    means exceed the spread ~1e4 times in float32 arithmetic, ~1e8 times in float64 (the fits' precision).
    As in ``online_em_update``, ``state`` is unregularised and the statistics used ``e_step_covariances``.
    """
    Vr, m = state.covariances, state.means
    V = e_step_covariances(state, w, FixedParameters.none(len(m), m.device), data_size)
    n = stats.n_points
    q_old = state.weights
    q_b = stats.q / n
    vu = (V @ (stats.U / n).unsqueeze(-1)).squeeze(-1)
    mm = m[:, :, None] * m[:, None, :]
    s_b = q_b[:, None] * m + vu
    second_b = (
        q_b[:, None, None] * (V + mm)
        + m[:, :, None] * vu[:, None, :]
        + vu[:, :, None] * m[:, None, :]
        + V @ ((stats.UU - stats.P) / n) @ V
    )
    q_new = (1.0 - step) * q_old + step * q_b
    s_new = (1.0 - step) * q_old[:, None] * m + step * s_b
    second_new = (1.0 - step) * q_old[:, None, None] * (Vr + mm) + step * second_b
    live = _live(q_new)
    q_safe = torch.where(live, q_new, torch.ones_like(q_new))
    new_mean = s_new / q_safe[:, None]
    new_cov = _symmetrise(second_new / q_safe[:, None, None] - new_mean[:, :, None] * new_mean[:, None, :])
    return Mixture(
        weights=q_new,
        means=torch.where(live[:, None], new_mean, m),
        covariances=torch.where(live[:, None, None], new_cov, Vr),
    )


def component_scale(mixture: Mixture) -> torch.Tensor:
    """Each component's spread in each feature, sqrt(diag V_j), (K, D): SGD's units with ``"component"``."""
    return torch.sqrt(torch.diagonal(mixture.covariances, dim1=-2, dim2=-1))


def feature_scale(mixture: Mixture) -> torch.Tensor:
    """Each feature's spread under the mixture: the square root of the diagonal of its total covariance
    sum_j alpha_j (V_j + m_j m_j^T) - mbar mbar^T. SGD's parameters are measured in these units."""
    alpha = mixture.weights / mixture.weights.sum()
    mean = alpha @ mixture.means
    second = torch.einsum("k,kd->d", alpha, torch.diagonal(mixture.covariances, dim1=-2, dim2=-1) + mixture.means**2)
    return torch.sqrt((second - mean**2).clamp_min(torch.finfo(mean.dtype).tiny))


class CholeskyParameters:
    """Unconstrained SGD parameters (paper eq. 8): softmax logits, means, and Cholesky factors whose
    diagonal is stored as its logarithm, all in units of a ``scale`` s_j per component and feature (K, D):

        m_j = s_j * mu_j,    L_j = diag(s_j) Lt_j,    V_j = L_j L_j^T,

    where ``raw`` holds the strictly-lower part and log-diagonal of Lt_j. With s = 1 this is the paper's
    parametrisation, in which Adam moves a mean by about ``lr`` per step whatever the feature's units: 1e-2
    degrees of right ascension (spread ~100 deg) or mas of parallax (spread ~0.3 mas) alike, so the wide
    features take thousands of steps to move. With s the data's spread (``feature_scale``, the same for
    every component) a step of ``lr`` is the same fraction of every feature's range; with s_j component
    j's own starting spread (``component_scale``) the same fraction of the component's width, so that a
    component a thousand times narrower than the data is not shaken off its place by steps of the data's
    size.
    """

    def __init__(self, mixture: Mixture, scale: torch.Tensor | None = None, fixed: FixedParameters | None = None):
        self.scale = (
            torch.ones_like(mixture.means) if scale is None else scale.to(mixture.means).expand_as(mixture.means)
        )
        # Fixed parameters get zero gradients, and are reported as given (not through a round trip that
        # could change their last bit); fixed weights keep their values and the free ones share the rest.
        self.fixed = fixed or FixedParameters.none(mixture.n_components, mixture.means.device)
        self.initial = mixture
        chol = torch.linalg.cholesky(mixture.covariances) / self.scale[:, :, None]
        self.logits = torch.log(mixture.weights.clamp_min(torch.finfo(mixture.weights.dtype).tiny)).clone()
        self.means = mixture.means / self.scale
        self.raw = torch.tril(chol, -1) + torch.diag_embed(torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)))

    def tensors(self) -> list[torch.Tensor]:
        return [self.logits, self.means, self.raw]

    def _unit_cholesky(self) -> torch.Tensor:
        return torch.tril(self.raw, -1) + torch.diag_embed(torch.exp(torch.diagonal(self.raw, dim1=-2, dim2=-1)))

    def cholesky(self) -> torch.Tensor:
        return self.scale[:, :, None] * self._unit_cholesky()

    def _free_softmax(self) -> torch.Tensor:
        """Softmax over the free components' logits (the fixed ones get zero)."""
        if not self.fixed.has_fixed_weights:
            return torch.softmax(self.logits, dim=0)
        return torch.softmax(self.logits.masked_fill(self.fixed.weights, -torch.inf), dim=0)

    def mixture(self) -> Mixture:
        chol = self.cholesky()
        fixed, initial = self.fixed, self.initial
        weights = self._free_softmax()
        if fixed.has_fixed_weights:
            weights = share_weights(weights, fixed.weight_values, fixed.weights)
        means = torch.where(fixed.means[:, None], initial.means, self.means * self.scale)
        covariances = torch.where(fixed.covariances[:, None, None], initial.covariances, chol @ chol.mT)
        return Mixture(weights, means, covariances)

    def loss_gradients(self, stats: Statistics, w: float | torch.Tensor | None) -> list[torch.Tensor]:
        """Gradients of loss = -sum_batch log p(x_i) + sum_j 1 / tr(W^-1 V_j) for (logits, means, raw), the
        penalty the paper's sum_j w / tr(V_j) where W = w I, and nothing where w is None.

        From the sums: dLL/dm_j = U_j, dLL/dV_j = (UU_j - P_j)/2, dLL/dz_j = q_j - B alpha_j, chained through
        V = L L^T (dV/dL: 2 G L for symmetric G), L = diag(s) Lt (row i times s_i), Lt_qq = exp(raw_qq) and
        m = s mu.
        """
        w = ridge_vector(w, self.means)
        unit = self._unit_cholesky()
        chol = self.scale[:, :, None] * unit
        cov = chol @ chol.mT
        weights = torch.softmax(self.logits, dim=0)
        grad_cov = -0.5 * (stats.UU - stats.P)
        if w is not None:  # d(1 / T)/dV_dd = -1 / (T^2 w_d), T = tr(W^-1 V)
            trace = (torch.diagonal(cov, dim1=-2, dim2=-1) / w).sum(-1)
            grad_cov = grad_cov - torch.diag_embed(1.0 / (trace[:, None] ** 2 * w))
        grad_unit = self.scale[:, :, None] * torch.tril(2.0 * grad_cov @ chol)
        diag = torch.diagonal(grad_unit, dim1=-2, dim2=-1) * torch.diagonal(unit, dim1=-2, dim2=-1)
        grad_raw = torch.tril(grad_unit, -1) + torch.diag_embed(diag)
        fixed = self.fixed
        if fixed.has_fixed_weights:  # free alpha_j = (1 - fixed sum) softmax_free(z)_j: dLL/dz_j = q_j - beta_j q_free
            beta = self._free_softmax()
            grad_logits = -(stats.q - beta * stats.q[~fixed.weights].sum()).masked_fill(fixed.weights, 0.0)
        else:
            grad_logits = -(stats.q - stats.n_points * weights)
        grad_means = (-stats.U * self.scale).masked_fill(fixed.means[:, None], 0.0)
        return [grad_logits, grad_means, grad_raw.masked_fill(fixed.covariances[:, None, None], 0.0)]
