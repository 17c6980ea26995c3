"""Online EM's update as one Triton kernel, for the minibatch step the CUDA engine replays (``cuda``).

Written as torch calls, online EM's float64 update (``online_em.online_em_update``, then ``regularised``) is
about a hundred small kernels (products, sums, scatters and copies of K 7 x 7 matrices); replayed from a
CUDA graph each still costs the GPU a few microseconds, and together they were two thirds of a step at the
paper's batch of 500 (``profile_batch_cuda_K512_b500.json``: 107 kernels a step). Here the whole update
is one kernel, following ``online_em_numba`` (the CPU's) operation for operation, so the results agree with
the torch update to rounding. It reads the running state and the batch's sums; it writes, in place, the
new running state and the mixture the next E-step uses, and flags the components whose new covariance
rounding left without a Cholesky factor (for ``deferred_checks``). It took a graphed minibatch-EM step's
time down by about a third on an H100 (docs/performance.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernel.statistics import Statistics
from ...mixture import Mixture
from .triton_common import BLOCK, _components, _points_per_fit


@triton.jit
def _online_em_kernel(
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
    """``online_em_numba._online_em_components`` for BLOCK components, as (BLOCK, DP, DP) blocks (DP: D padded to a
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


def online_em_step_in_place(
    state: Mixture,
    e_step: Mixture,
    stats: Statistics,
    step: torch.Tensor,
    w: torch.Tensor | None,
    fixed,
    constants: torch.Tensor,
) -> torch.Tensor:
    """``online_em.online_em_update`` then ``em.regularised``, written into ``state``'s and ``e_step``'s
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
    _online_em_kernel[grid](
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
