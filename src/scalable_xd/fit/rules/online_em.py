"""Online EM's update (Cappe & Moulines 2009), the rule of the method ``"minibatch_em"``, in torch: its
definition, which the compiled forms beside it (``online_em_numba``, ``online_em_triton``) follow.

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

Rounding: a scatter that float32 sums leave indefinite is clipped as ``em`` says.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ...kernel.statistics import Statistics
from ...mixture import Mixture
from .em import FixedParameters, e_step_covariances, live_components, psd, ridge_vector, symmetrise


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
    live = live_components(q_new)
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
    new_cov = psd(Vr + shift + V @ inner @ V, V)
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
    live = live_components(q_new)
    q_safe = torch.where(live, q_new, torch.ones_like(q_new))
    new_mean = s_new / q_safe[:, None]
    new_cov = symmetrise(second_new / q_safe[:, None, None] - new_mean[:, :, None] * new_mean[:, None, :])
    return Mixture(
        weights=q_new,
        means=torch.where(live[:, None], new_mean, m),
        covariances=torch.where(live[:, None, None], new_cov, Vr),
    )


class OnlineEMFitter(Protocol):
    """What online EM's compiled forms read and write of the fitter they are bound to
    (``fit.families.minibatch_em.MinibatchEM``): its running state and E-step mixture (tensors, or arrays held between
    compiled steps), W, the fixed parameters, the prior's data size and the step-size schedule."""

    naive: bool
    truncation: float | None
    w: torch.Tensor | None
    fixed: FixedParameters | None
    data_size: float | None
    n_updates: int

    @property
    def state(self) -> Mixture: ...

    @property
    def mixture(self) -> Mixture: ...

    @property
    def fixed_parameters(self) -> FixedParameters: ...

    def next_step_size(self) -> float: ...

    def state_arrays(self) -> tuple: ...

    def e_step_arrays(self) -> tuple: ...

    def hold(self, state: tuple, e_step: tuple) -> None: ...

    def bind(self, state: Mixture, e_step: Mixture) -> None: ...
