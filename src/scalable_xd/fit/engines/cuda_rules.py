"""The minibatch rules' updates as Triton kernels, for the minibatch step the CUDA engine replays (``cuda``).

Written as torch calls, online EM's float64 update (``updates.online_em_update``, then ``regularised``) is
about a hundred small kernels (products, sums, scatters and copies of K 7 x 7 matrices); replayed from a
CUDA graph each still costs the GPU a few microseconds, and together they were two thirds of a step at the
paper's batch of 500 (``profile_batch_cuda_K512_b500.json``: 107 kernels a step). Here the whole update
is one kernel, following ``cpu_rules`` (the CPU's) operation for operation, so the results agree with
the torch update to rounding. It reads the running state and the batch's sums; it writes, in place, the
new running state and the mixture the next E-step uses, and flags the components whose new covariance
rounding left without a Cholesky factor (for ``deferred_checks``). It took a graphed minibatch-EM step's
time down by about a third on an H100 (docs/performance.md).

SGD's gradient (``CholeskyParameters.loss_gradients``), Adam's step (``Adam.step_on_device``) and the
mixture the new parameters describe (``CholeskyParameters.mixture``) are two kernels in the same way
(``sgd_step_in_place``): one for the softmax weights, whose gradient and new values need every
component's logit, and one for the means and Cholesky factors, component by component. In torch they are
about forty kernels a step.

A program takes a few components as (component, D, D) blocks, D padded to a power of two: the products
are broadcast sums, the Cholesky test a right-looking elimination, so that the kernel compiles in seconds
(unrolled entry by entry, as the statistics kernels are, it took 50-75 s). Every kernel takes several
fits at once (the ensemble's step, ``engines.cuda.GraphedEnsemble``), each with its own parameters and
scalars. They run on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``), which is how the
tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernel.statistics import Statistics
from ...mixture import Mixture

BLOCK = 4  # components per program: with the (B, D, D, D) products, 2,048 float64 numbers at D <= 8


@triton.jit
def _components(n_comp, n_all, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr):
    """A program's BLOCK components among the fits' n_all (n_comp a fit): their indices, which are real,
    their fits, the padded dimension's index as a row and a column, and the masks of real vector and matrix
    entries."""
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    on = k < n_all
    idx = tl.arange(0, DP)
    row, col = idx[None, :, None], idx[None, None, :]
    vec_on = on[:, None] & (idx[None, :] < D)
    mat_on = on[:, None, None] & (row < D) & (col < D)
    return k, on, k // n_comp, idx, row, col, vec_on, mat_on


@triton.jit
def _online_em(
    weights_ptr,
    means_ptr,
    cov_ptr,
    e_weights_ptr,
    e_means_ptr,
    e_cov_ptr,
    q_ptr,
    U_ptr,
    UU_ptr,
    P_ptr,
    n_ptr,
    step_ptr,
    w_ptr,
    const_ptr,
    fixed_means_ptr,
    fixed_cov_ptr,
    suspect_ptr,
    n_comp,
    n_all,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``cpu_rules._online_em_components`` for BLOCK components, as (BLOCK, DP, DP) blocks (DP: D padded to a
    power of two, masked, zero), of n_all / n_comp fits one after another, each with its own scalars and W."""
    k, on, fit, idx, row, col, vec_on, mat_on = _components(n_comp, n_all, D, DP, BLOCK)
    step = tl.load(step_ptr + fit, mask=on, other=0.0)
    n = tl.load(n_ptr + fit, mask=on, other=1.0).to(tl.float64)
    data_size = tl.load(const_ptr + 2 * fit, mask=on, other=0.0)  # 0: the paper's W added (or no W)
    tiny = tl.load(const_ptr + 2 * fit + 1, mask=on, other=1.0)
    fixed_mean = tl.load(fixed_means_ptr + k, mask=on, other=0) != 0
    fixed_cov = tl.load(fixed_cov_ptr + k, mask=on, other=0) != 0
    weight = tl.load(weights_ptr + k, mask=on, other=1.0)
    paper = data_size == 0.0
    plain = (paper | fixed_cov)[:, None, None]
    free = tl.where(fixed_cov, 0.0, 1.0)[:, None, None]
    count = (weight * data_size)[:, None, None]
    w = tl.load(w_ptr + fit[:, None] * D + idx[None, :], mask=vec_on, other=0.0)
    ridge = tl.where(row == col, w[:, :, None], 0.0)  # W, (BLOCK, DP, DP)
    vec = k[:, None] * D + idx[None, :]
    at = k[:, None, None] * (D * D) + row * D + col
    m = tl.load(means_ptr + vec, mask=vec_on, other=0.0)
    U = tl.load(U_ptr + vec, mask=vec_on, other=0.0).to(tl.float64)
    c = tl.load(cov_ptr + at, mask=mat_on, other=0.0)
    scatter = tl.load(UU_ptr + at, mask=mat_on, other=0.0).to(tl.float64) - tl.load(
        P_ptr + at, mask=mat_on, other=0.0
    ).to(tl.float64)
    V = tl.where(plain, c + free * ridge, (count * c + ridge) / (count + 1.0))  # the E-step's covariances
    q_b = tl.load(q_ptr + k, mask=on, other=0.0).to(tl.float64) / n
    q_new = (1.0 - step) * weight + step * q_b
    live = q_new > tiny
    q_safe = tl.where(live, q_new, 1.0)
    pull = (step * q_b / q_safe)[:, None, None]
    g = step[:, None] * U / (n[:, None] * q_safe[:, None])
    centre = tl.where(fixed_mean[:, None, None], 0.0, g[:, :, None] * g[:, None, :])
    inner = step[:, None, None] * scatter / (n[:, None, None] * q_safe[:, None, None]) - centre
    t = tl.sum(V[:, :, :, None] * inner[:, None, :, :], axis=2)  # V inner
    tv = tl.sum(t[:, :, :, None] * V[:, None, :, :], axis=2)  # V inner V
    a = tl.where(paper[:, None, None], c + pull * ridge, c + pull * (V - c)) + tv
    move_mean = live & ~fixed_mean
    update_cov = live & ~fixed_cov
    new_mean = tl.where(move_mean[:, None], tl.sum(V * g[:, None, :], axis=2) + m, m)
    new_cov = tl.where(update_cov[:, None, None], 0.5 * (a + tl.permute(a, (0, 2, 1))), c)
    new_count = (q_new * data_size)[:, None, None]
    e_cov = tl.where(plain, new_cov + free * ridge, (new_count * new_cov + ridge) / (new_count + 1.0))
    tl.store(weights_ptr + k, q_new, mask=on)
    tl.store(e_weights_ptr + k, q_new, mask=on)
    tl.store(means_ptr + vec, new_mean, mask=vec_on)
    tl.store(e_means_ptr + vec, new_mean, mask=vec_on)
    tl.store(cov_ptr + at, new_cov, mask=mat_on)
    tl.store(e_cov_ptr + at, e_cov, mask=mat_on)
    finite, factors = _factorises(new_cov, on, mat_on, idx, D)
    tl.store(suspect_ptr + k, (update_cov & finite & ~factors).to(tl.int8), mask=on)


@triton.jit
def _factorises(cov, on, mat_on, idx, D: tl.constexpr):
    """Whether each of the (BLOCK, DP, DP) covariances is finite, and whether it has a Cholesky factor
    (every pivot positive, NaN not) as LAPACK decides: right-looking elimination, the padding an identity."""
    row, col = idx[None, :, None], idx[None, None, :]
    finite = tl.min(tl.min(tl.where(mat_on, cov - cov == 0.0, True).to(tl.int32), axis=2), axis=1) == 1
    A = tl.where(mat_on, cov, tl.where(row == col, 1.0, 0.0))
    factors = on
    for j in tl.static_range(D):
        column = tl.sum(tl.where(col == j, A, 0.0), axis=2)  # A[:, :, j]
        pivot = tl.sum(tl.where(idx[None, :] == j, column, 0.0), axis=1)
        factors = factors & (pivot > 0.0)
        below = tl.where(idx[None, :] > j, column / tl.sqrt(tl.where(pivot > 0.0, pivot, 1.0))[:, None], 0.0)
        A = A - below[:, :, None] * below[:, None, :]
    return finite, factors


def _points_per_fit(stats: Statistics, n_fits: int, device) -> torch.Tensor:
    """The batch's (weighted) number of points for each of ``n_fits`` fits, (F,), on the device: a fill, not a
    copy from the host, so that a CUDA graph captures it (every fit's batch is of one size)."""
    n = stats.n_points
    return (
        n.expand(n_fits) if torch.is_tensor(n) else torch.full((n_fits,), float(n), dtype=torch.float64, device=device)
    )


def online_em_step_in_place(
    state: Mixture,
    e_step: Mixture,
    stats: Statistics,
    step: torch.Tensor,
    w: torch.Tensor | None,
    fixed,
    constants: torch.Tensor,
) -> torch.Tensor:
    """``updates.online_em_update`` then ``updates.regularised``, written into ``state``'s and ``e_step``'s
    tensors (float64, contiguous), for a ``step`` on the device. ``fixed``: a ``FixedParameters``; where
    any parameter is fixed, the caller shares the E-step's weights afterwards, as ``regularised`` does.
    ``constants``: (data_size, or 0 for the paper's W added, and float64's smallest normal number) on the
    device. Returns which components' new covariance has no Cholesky factor (int8, (K,)), for the caller
    to note or clip.

    F fits at once (``engines.cuda``'s ensemble step): every tensor with a leading fit axis, the mixtures'
    and the sums' (F, K, ...), ``step`` (F,), ``constants`` (F, 2), ``w`` (F, D), ``fixed``'s masks (F, K)
    and ``stats.n_points`` one fit's; the suspects are then (F, K)."""
    k, dim = state.means.shape[-2:]
    n_all = state.weights.numel()
    n_fits, device = n_all // k, state.means.device
    n = _points_per_fit(stats, n_fits, device)
    w = torch.zeros((n_fits, dim), dtype=torch.float64, device=device) if w is None else w
    suspect = torch.empty(state.weights.shape, dtype=torch.int8, device=device)
    grid = (triton.cdiv(n_all, BLOCK),)
    _online_em[grid](
        *state.tensors(),
        *e_step.tensors(),
        *(t.contiguous() for t in (stats.q, stats.U, stats.UU, stats.P)),
        n.contiguous(),
        step,
        w.expand(n_fits, dim).contiguous(),
        constants,
        fixed.means,
        fixed.covariances,
        suspect,
        k,
        n_all,
        D=dim,
        DP=triton.next_power_of_2(dim),
        BLOCK=BLOCK,
    )
    return suspect


@triton.jit
def _adam(param, grad, m1, m2, step_size, bias_correction2_sqrt, beta1, beta2, eps):
    """``adam.Adam.step_on_device``'s arithmetic: (new parameter, first moment, second moment)."""
    m1 = m1 + (1.0 - beta1) * (grad - m1)
    m2 = m2 * beta2 + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(m2) / bias_correction2_sqrt + eps
    return param - step_size * (m1 / denom), m1, m2


@triton.jit
def _adam_at(param_ptr, grad, m1_ptr, m2_ptr, at, mask, step_size, bias_correction2_sqrt, beta1, beta2, eps):
    """``_adam`` on the entries ``at`` (``mask``) of a parameter and its moments, in place; the new values."""
    param, m1, m2 = _adam(
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
    z, m1, m2 = _adam(z, grad, m1, m2, step_size, bias_correction2_sqrt, beta1, beta2, eps)
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
