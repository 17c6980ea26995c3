"""SGD's step as two Triton kernels, for the minibatch step the CUDA engine replays.

SGD's gradient (``CholeskyParameters.loss_gradients``), Adam's step (``Adam.step_on_device``) and the
mixture the new parameters describe (``CholeskyParameters.mixture``) are two kernels in the same way
(``sgd_step_in_place``): one for the softmax weights, whose gradient and new values need every
component's logit, and one for the means and Cholesky factors, component by component. In torch they are
about forty kernels a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernel.statistics import Statistics
from ...mixture import Mixture
from .triton_common import BLOCK, _components, _points_per_fit


@triton.jit
def _adam_kernel(param, grad, m1, m2, step_size, bias_correction2_sqrt, beta1, beta2, eps):
    """``sgd.Adam.step_on_device``'s arithmetic: (new parameter, first moment, second moment)."""
    m1 = m1 + (1.0 - beta1) * (grad - m1)
    m2 = m2 * beta2 + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(m2) / bias_correction2_sqrt + eps
    return param - step_size * (m1 / denom), m1, m2


@triton.jit
def _adam_at(param_ptr, grad, m1_ptr, m2_ptr, at, mask, step_size, bias_correction2_sqrt, beta1, beta2, eps):
    """``_adam_kernel`` on the entries ``at`` (``mask``) of a parameter and its moments, in place; the new values."""
    param, m1, m2 = _adam_kernel(
        tl.load(param_ptr + at, mask=mask, other=0.0),
        grad,
        tl.load(m1_ptr + at, mask=mask, other=0.0),
        tl.load(m2_ptr + at, mask=mask, other=0.0),
        step_size,
        bias_correction2_sqrt,
        beta1,
        beta2,
        eps,
    )
    tl.store(param_ptr + at, param, mask=mask)
    tl.store(m1_ptr + at, m1, mask=mask)
    tl.store(m2_ptr + at, m2, mask=mask)
    return param


@triton.jit
def _factor(raw, s, lower, row, col):
    """(Lt, L = diag(s) Lt): SGD's raw factors (BLOCK, DP, DP) with their diagonal exponentiated, the strict
    upper triangle and the padding zero (``CholeskyParameters.cholesky``)."""
    unit = tl.where(lower, tl.where(row == col, tl.exp(tl.where(row == col, raw, 0.0)), raw), 0.0)
    return unit, s[:, :, None] * unit


@triton.jit
def _adam_constants(adam_ptr, fit, on):
    """The fits' (step size, sqrt(1 - beta2^t), beta1, beta2, eps) from their rows of the (F, 5) array."""
    row = adam_ptr + fit * 5
    return (
        tl.load(row, mask=on, other=1.0),
        tl.load(row + 1, mask=on, other=1.0),
        tl.load(row + 2, mask=on, other=0.0),
        tl.load(row + 3, mask=on, other=0.0),
        tl.load(row + 4, mask=on, other=1.0),
    )


@triton.jit
def _sgd_weights(logits_ptr, m1_ptr, m2_ptr, q_ptr, n_ptr, adam_ptr, weights_ptr, n_comp, KP: tl.constexpr):
    """The softmax logits' gradient and Adam step, and the new weights, of one fit a program (no fixed
    weights): every component's logit in one block of KP (K padded to a power of two)."""
    fit = tl.program_id(0)
    k = tl.arange(0, KP)
    on = k < n_comp
    at = fit * n_comp + k
    z = tl.load(logits_ptr + at, mask=on, other=-float("inf"))
    e = tl.where(on, tl.exp(z - tl.max(z, axis=0)), 0.0)
    beta = e / tl.sum(e, axis=0)
    q = tl.load(q_ptr + at, mask=on, other=0.0).to(tl.float64)
    grad = -(q - tl.load(n_ptr + fit).to(tl.float64) * beta)
    step_size, bias_correction2_sqrt, beta1, beta2, eps = _adam_constants(adam_ptr, fit, True)
    m1 = tl.load(m1_ptr + at, mask=on, other=0.0)
    m2 = tl.load(m2_ptr + at, mask=on, other=0.0)
    z, m1, m2 = _adam_kernel(z, grad, m1, m2, step_size, bias_correction2_sqrt, beta1, beta2, eps)
    tl.store(logits_ptr + at, z, mask=on)
    tl.store(m1_ptr + at, m1, mask=on)
    tl.store(m2_ptr + at, m2, mask=on)
    e = tl.where(on, tl.exp(z - tl.max(tl.where(on, z, -float("inf")), axis=0)), 0.0)
    tl.store(weights_ptr + at, e / tl.sum(e, axis=0), mask=on)


@triton.jit
def _sgd_components(
    mu_ptr,
    raw_ptr,
    scale_ptr,
    m1_mu_ptr,
    m1_raw_ptr,
    m2_mu_ptr,
    m2_raw_ptr,
    U_ptr,
    UU_ptr,
    P_ptr,
    adam_ptr,
    w_ptr,
    penalised_ptr,
    fixed_means_ptr,
    fixed_cov_ptr,
    initial_means_ptr,
    initial_cov_ptr,
    means_ptr,
    cov_ptr,
    n_comp,
    n_all,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``CholeskyParameters.loss_gradients``' means and Cholesky factors, Adam's step on them and the new
    means and covariances (``CholeskyParameters.mixture``), for BLOCK components as (BLOCK, DP, DP) blocks
    of n_all / n_comp fits one after another; a factor's strict upper triangle stays zero, as torch's."""
    k, on, fit, idx, row, col, vec_on, mat_on = _components(n_comp, n_all, D, DP, BLOCK)
    lower = mat_on & (col <= row)
    fixed_mean = tl.load(fixed_means_ptr + k, mask=on, other=0) != 0
    fixed_cov = tl.load(fixed_cov_ptr + k, mask=on, other=0) != 0
    step_size, bias_correction2_sqrt, beta1, beta2, eps = _adam_constants(adam_ptr, fit, on)
    vec = k[:, None] * D + idx[None, :]
    at = k[:, None, None] * (D * D) + row * D + col
    s = tl.load(scale_ptr + vec, mask=vec_on, other=0.0)
    unit, chol = _factor(tl.load(raw_ptr + at, mask=lower, other=0.0), s, lower, row, col)
    w = tl.load(w_ptr + fit[:, None] * D + idx[None, :], mask=vec_on, other=1.0)
    trace = tl.sum(tl.where(vec_on, tl.sum(chol * chol, axis=2) / w, 0.0), axis=1)  # tr(W^-1 V)
    trace = tl.where(on, trace, 1.0)  # the padding's, 0, not divided by
    penalised = tl.load(penalised_ptr + fit, mask=on, other=0) != 0
    ridge = tl.where(penalised[:, None], 1.0 / (trace[:, None] * trace[:, None] * w), 0.0)
    scatter = tl.load(UU_ptr + at, mask=mat_on, other=0.0).to(tl.float64) - tl.load(
        P_ptr + at, mask=mat_on, other=0.0
    ).to(tl.float64)
    grad_cov = -0.5 * scatter - tl.where(row == col, ridge[:, :, None], 0.0)
    product = tl.sum((2.0 * grad_cov)[:, :, :, None] * chol[:, None, :, :], axis=2)  # 2 G L
    grad_unit = s[:, :, None] * product
    free = lower & ~fixed_cov[:, None, None]
    grad_raw = tl.where(free, tl.where(row == col, grad_unit * unit, grad_unit), 0.0)
    c3 = (
        step_size[:, None, None],
        bias_correction2_sqrt[:, None, None],
        beta1[:, None, None],
        beta2[:, None, None],
        eps[:, None, None],
    )
    raw = _adam_at(raw_ptr, grad_raw, m1_raw_ptr, m2_raw_ptr, at, lower, c3[0], c3[1], c3[2], c3[3], c3[4])
    U = tl.load(U_ptr + vec, mask=vec_on, other=0.0).to(tl.float64)
    grad_mu = tl.where(fixed_mean[:, None], 0.0, -U * s)
    c2 = (step_size[:, None], bias_correction2_sqrt[:, None], beta1[:, None], beta2[:, None], eps[:, None])
    mu = _adam_at(mu_ptr, grad_mu, m1_mu_ptr, m2_mu_ptr, vec, vec_on, c2[0], c2[1], c2[2], c2[3], c2[4])
    initial_mean = tl.load(initial_means_ptr + vec, mask=vec_on, other=0.0)
    tl.store(means_ptr + vec, tl.where(fixed_mean[:, None], initial_mean, mu * s), mask=vec_on)
    _, chol = _factor(raw, s, lower, row, col)
    cov = tl.sum(chol[:, :, None, :] * chol[:, None, :, :], axis=3)  # L L^T
    initial_cov = tl.load(initial_cov_ptr + at, mask=mat_on, other=0.0)
    tl.store(cov_ptr + at, tl.where(fixed_cov[:, None, None], initial_cov, cov), mask=mat_on)


def sgd_step_in_place(
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: torch.Tensor,
    moments: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
    stats: Statistics,
    adam: torch.Tensor,
    w: torch.Tensor,
    penalised: torch.Tensor,
    fixed,
    initial: tuple[torch.Tensor, torch.Tensor],
    mixture: Mixture,
) -> None:
    """SGD's gradient from a batch's sums, Adam's step and the new mixture, written in place: into the
    ``params`` (logits (K,), means (K, D), raw Cholesky factors (K, D, D); ``CholeskyParameters``),
    Adam's ``moments`` (first, second: one per parameter) and ``mixture`` (float64, contiguous), without
    asking the host. ``adam``: (step size, sqrt(1 - beta2^t), beta1, beta2, eps) on the device; ``w``
    W's diagonal (D,) and ``penalised`` (int8) whether the penalty applies; ``fixed`` a
    ``FixedParameters`` with no fixed weights; ``initial``: the (means, covariances) of the fixed ones.

    F fits at once (``engines.cuda``'s ensemble step): every tensor with a leading fit axis, the
    parameters', moments', mixture's and sums' (F, K, ...), ``adam`` (F, 5), ``w`` (F, D), ``penalised``
    (F,), ``fixed``'s masks (F, K) and ``stats.n_points`` one fit's."""
    k, dim = mixture.means.shape[-2:]
    n_all = mixture.weights.numel()
    n_fits, device = n_all // k, mixture.means.device
    n = _points_per_fit(stats, n_fits, device)
    (m1_logits, m1_means, m1_raw), (m2_logits, m2_means, m2_raw) = moments
    logits, means, raw = params
    _sgd_weights[(n_fits,)](
        logits,
        m1_logits,
        m2_logits,
        stats.q.contiguous(),
        n.contiguous(),
        adam,
        mixture.weights,
        k,
        KP=triton.next_power_of_2(k),
    )
    _sgd_components[(triton.cdiv(n_all, BLOCK),)](
        means,
        raw,
        scale.contiguous(),
        m1_means,
        m1_raw,
        m2_means,
        m2_raw,
        *(t.contiguous() for t in (stats.U, stats.UU, stats.P)),
        adam,
        w.expand(n_fits, dim).contiguous(),
        penalised.expand(n_fits).contiguous(),
        fixed.means,
        fixed.covariances,
        *(t.contiguous() for t in initial),
        mixture.means,
        mixture.covariances,
        k,
        n_all,
        D=dim,
        DP=triton.next_power_of_2(dim),
        BLOCK=BLOCK,
    )
