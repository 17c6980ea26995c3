"""The minibatch rules as single numba loops over the components: the CPU engine's compiled forms.

A minibatch step's float64 update (online EM's, or SGD's gradient and Adam step) is a few hundred numbers
per component; written as torch calls it is dozens of small operations whose dispatch costs several times
the arithmetic (as much as the statistics pass itself: docs/performance.md). Here each is one compiled
call. The arithmetic follows ``updates`` operation for operation, so the results agree with the torch
updates to rounding (the matrix products' summation order differs); ``updates`` stays the definition and
the path on other devices. What is rare stays in torch: the eigenvalue clipping of a covariance that
rounding left indefinite (``updates.clip_rounding``) runs on the components this loop flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import numba
import numpy as np
import torch

from ...kernel.statistics import Statistics
from ...mixture import Mixture
from ..adam import Adam
from ..updates import clip_rounding, e_step_covariances, ridge_vector, share_weights

# Typed as what they make of a function: numba's stubs give a compiled function's call no arguments.
_jit: Callable[[Callable[..., Any]], Callable[..., Any]] = numba.njit(cache=True, error_model="numpy")
# Helpers of the update loops, inlined into them as numba compiles them: called, they cost a fifth of the step
_jit_inline: Callable[[Callable[..., Any]], Callable[..., Any]] = numba.njit(
    cache=True, error_model="numpy", inline="always"
)
_jit_parallel: Callable[[Callable[..., Any]], Callable[..., Any]] = numba.njit(
    cache=True, error_model="numpy", parallel=True
)
# Components from which online EM's update is shared among threads (``threads`` parts below 128 components,
# four a thread from there): right after the pass, whose threads still spin (``GOMP_SPINCOUNT``), a parallel
# region starts in about the time of ten components' updates (docs/performance.md, "The minibatch step").
PARALLEL_COMPONENTS = 64
LANES = 64  # components updated together: their scratch (~150 kB) stays in the L2 cache
TINY = float(np.finfo(np.float64).tiny)


def dimensions(dim: int) -> tuple[int, ...]:
    """D as the length of a tuple, which numba knows when it compiles a loop (one compilation per D): its
    D x D loops then unroll (a quarter off online EM's update at D = 7: docs/performance.md), with the same
    arithmetic in the same order, so the same results to the bit."""
    return (0,) * dim


@_jit
def _online_em_loop(weights, means, cov, q, U, UU, P, n, step, w, data_size, fixed_means, fixed_cov, tiny, dims):
    """``updates.online_em_update`` per component, returning the new running state, the E-step's
    covariances (``updates.e_step_covariances``; ``w`` (D,) the diagonal of W, zeros for none;
    ``data_size`` 0 for the paper's W added), which components' new covariance failed a Cholesky
    factorisation and whether any did; ``dims``: ``dimensions(D)``."""
    args = (weights, means, cov, q, U, UU, P, n, step, w, data_size, fixed_means, fixed_cov, tiny)
    out = _online_em_outputs(means)
    _online_em_components(0, means.shape[0], args, out, dims)
    return _with_any_suspect(out)


@_jit_parallel
def _online_em_loop_parallel(
    weights, means, cov, q, U, UU, P, n, step, w, data_size, fixed_means, fixed_cov, tiny, dims, parts
):
    """``_online_em_loop`` with the components shared among numba's threads in ``parts`` parts (each
    component's arithmetic is the same: so are the results)."""
    args = (weights, means, cov, q, U, UU, P, n, step, w, data_size, fixed_means, fixed_cov, tiny)
    out = _online_em_outputs(means)
    K = means.shape[0]
    for part in numba.prange(parts):
        _online_em_components(part * K // parts, (part + 1) * K // parts, args, out, dims)
    return _with_any_suspect(out)


@_jit_parallel
def _online_em_fits(
    weights, means, cov, q, U, UU, P, n, steps, w, data_size, fixed_means, fixed_cov, tiny, dims, parts
):
    """``_online_em_loop`` for S fits, every argument but ``n``, ``tiny`` and ``dims`` stacked on a leading
    fit axis (so each output too), each fit's components shared among numba's threads in ``parts`` parts."""
    S = means.shape[0]
    args = (weights, means, cov, q, U, UU, P, n, steps, w, data_size, fixed_means, fixed_cov, tiny)
    out = _online_em_outputs(means)
    for job in numba.prange(S * parts):
        _online_em_job(job, parts, args, out, dims)
    return _with_any_suspect_fits(out)


@_jit
def _online_em_fits_serial(
    weights, means, cov, q, U, UU, P, n, steps, w, data_size, fixed_means, fixed_cov, tiny, dims
):
    """``_online_em_fits`` on this thread: for few components in all, where a parallel region would cost
    more than the update (as ``online_em_step`` keeps one fit's below ``PARALLEL_COMPONENTS``)."""
    args = (weights, means, cov, q, U, UU, P, n, steps, w, data_size, fixed_means, fixed_cov, tiny)
    out = _online_em_outputs(means)
    for job in range(means.shape[0]):
        _online_em_job(job, 1, args, out, dims)
    return _with_any_suspect_fits(out)


@_jit_inline
def _online_em_job(job, parts, args, out, dims):
    """Part ``job % parts`` of fit ``job // parts``'s components, updated as ``_online_em_loop`` updates them."""
    weights, means, cov, q, U, UU, P, n, steps, w, data_size, fixed_means, fixed_cov, tiny = args
    s, part, K = job // parts, job % parts, means.shape[1]
    fit_args = (weights[s], means[s], cov[s], q[s], U[s], UU[s], P[s], n, steps[s], w[s], data_size[s])
    fit_out = (out[0][s], out[1][s], out[2][s], out[3][s], out[4][s])
    first, last = part * K // parts, (part + 1) * K // parts
    _online_em_components(first, last, (*fit_args, fixed_means[s], fixed_cov[s], tiny), fit_out, dims)


@_jit
def _with_any_suspect_fits(out):
    """``_with_any_suspect`` for each of S fits."""
    any_suspect = np.zeros(out[4].shape[0], np.bool_)
    for s in range(out[4].shape[0]):
        any_suspect[s] = out[4][s].any()
    return (*out, any_suspect)


@_jit
def _online_em_outputs(means):
    """Empty outputs for the components of ``means``, (K, D) or (S, K, D) for S fits: weights, means,
    covariances, the E-step's covariances and which components are suspect."""
    lead, D = means.shape[:-1], means.shape[-1]
    square = means.shape + (D,)
    return np.empty(lead), np.empty(means.shape), np.empty(square), np.empty(square), np.zeros(lead, np.bool_)


@_jit
def _with_any_suspect(out):
    """The outputs and whether any component is suspect (compiled: asked of numpy it costs a fifth of the loop)."""
    weights, means, cov, e_step_cov, suspect = out
    return weights, means, cov, e_step_cov, suspect, suspect.any()


@_jit
def _online_em_lanes(first, last, args, out, dims):
    """The update of components ``first`` to ``last`` - 1 as lanes: each quantity is held as (D, D, lanes)
    or (lanes,), and every loop runs over the lanes innermost, so that LLVM vectorises the arithmetic
    across components (the divisions above all). Each lane's arithmetic is ``updates``' in the same order
    as a loop over one component at a time does it, so the results are the same to the bit, in about
    two thirds of the time (docs/performance.md)."""
    weights, means, cov, q, U, UU, P, n, step, w, data_size, fixed_means, fixed_cov, tiny = args
    D, L = len(dims), last - first  # D known when compiled: the D x D loops unroll
    C = np.empty((D, D, L))  # the running covariances
    V = np.empty((D, D, L))  # the E-step's covariances
    inner = np.empty((D, D, L))  # the centred second-moment step; then the new covariances' factors
    t = np.empty((D, D, L))  # V inner; then the new covariances
    a = np.empty((D, D, L))  # the new covariances before symmetrising
    e = np.empty((D, D, L))  # the next E-step's covariances
    g, mean = np.empty((D, L)), np.empty((D, L))  # the mean's step (times V^-1), the new means
    free, count, q_new, q_safe = np.empty(L), np.empty(L), np.empty(L), np.empty(L)
    pull, nq, new_count = np.empty(L), np.empty(L), np.empty(L)
    unprior, live, centre = np.empty(L, np.bool_), np.empty(L, np.bool_), np.empty(L, np.bool_)
    update_cov, finite, factorises = np.empty(L, np.bool_), np.ones(L, np.bool_), np.ones(L, np.bool_)
    for c in range(L):
        k = first + c
        free[c] = 0.0 if fixed_cov[k] else 1.0
        unprior[c] = data_size == 0.0 or fixed_cov[k]  # V = Vr + W, no prior (see e_step_covariances)
        count[c] = weights[k] * data_size
        q_b = q[k] / n
        q_new[c] = (1.0 - step) * weights[k] + step * q_b
        live[c] = q_new[c] > tiny
        q_safe[c] = q_new[c] if live[c] else 1.0
        pull[c] = step * q_b / q_safe[c]
        nq[c] = n * q_safe[c]
        new_count[c] = q_new[c] * data_size
        centre[c] = not fixed_means[k]
        update_cov[c] = live[c] and not fixed_cov[k]
    for i in range(D):
        for c in range(L):
            g[i, c] = step * np.float64(U[first + c, i]) / nq[c]
            mean[i, c] = means[first + c, i]
        for j in range(D):
            for c in range(L):
                C[i, j, c] = cov[first + c, i, j]
                inner[i, j, c] = np.float64(UU[first + c, i, j]) - np.float64(P[first + c, i, j])
    for i in range(D):
        for j in range(D):
            w_ij = w[i] if i == j else 0.0
            for c in range(L):
                unprior_V = C[i, j, c] + free[c] * w_ij  # free is 0 or 1: free * 0 adds +0, as 0.0 would
                prior_V = (count[c] * C[i, j, c] + w_ij) / (count[c] + 1.0)
                V[i, j, c] = unprior_V if unprior[c] else prior_V
                inner[i, j, c] = step * inner[i, j, c] / nq[c] - (g[i, c] * g[j, c] if centre[c] else 0.0)
    _product_lanes(V, inner, t)
    for i in range(D):
        for j in range(D):
            for c in range(L):
                s = 0.0
                for m in range(D):
                    s += t[i, m, c] * V[m, j, c]
                if data_size == 0.0:
                    a[i, j, c] = C[i, j, c] + (pull[c] * w[i] if i == j else 0.0) + s
                else:
                    a[i, j, c] = C[i, j, c] + pull[c] * (V[i, j, c] - C[i, j, c]) + s
    for i in range(D):
        for c in range(L):
            s = 0.0
            for m in range(D):
                s += V[i, m, c] * g[m, c]
            mean[i, c] = s + mean[i, c] if live[c] and centre[c] else mean[i, c]
    for i in range(D):
        for j in range(D):
            w_ij = w[i] if i == j else 0.0
            for c in range(L):
                value = 0.5 * (a[i, j, c] + a[j, i, c]) if update_cov[c] else C[i, j, c]
                t[i, j, c] = value  # t now holds the new covariances
                unprior_V = value + free[c] * w_ij
                prior_V = (new_count[c] * value + w_ij) / (new_count[c] + 1.0)
                e[i, j, c] = unprior_V if unprior[c] else prior_V
                finite[c] = finite[c] and np.isfinite(value)
    _factorise_lanes(t, inner, factorises)
    for c in range(L):
        out[4][first + c] = update_cov[c] and finite[c] and not factorises[c]  # suspect
    _store_lanes(first, q_new, mean, t, e, out)


@_jit_inline
def _product_lanes(x, y, out):
    """out = x y for each lane of the (D, D, lanes) arrays, the lanes innermost."""
    D, L = x.shape[0], x.shape[2]
    for i in range(D):
        for j in range(D):
            for c in range(L):
                s = 0.0
                for m in range(D):
                    s += x[i, m, c] * y[m, j, c]
                out[i, j, c] = s


@_jit_inline
def _store_lanes(first, weights, means, cov, e_step_cov, out):
    """The lanes' new weights (lanes,), means (D, lanes) and covariances (D, D, lanes) written into the
    outputs' components from ``first`` on."""
    D, L = means.shape[0], means.shape[1]
    for c in range(L):
        k = first + c
        out[0][k] = weights[c]
        for i in range(D):
            out[1][k, i] = means[i, c]
            for j in range(D):
                out[2][k, i, j] = cov[i, j, c]
                out[3][k, i, j] = e_step_cov[i, j, c]


@_jit
def _online_em_components(first, last, args, out, dims):
    """The update of components ``first`` to ``last`` - 1 (``_online_em_loop``'s arguments and outputs),
    LANES at a time."""
    for lane in range(first, last, LANES):
        _online_em_lanes(lane, min(lane + LANES, last), args, out, dims)


@_jit
def _factorise_lanes(a, scratch, factorises):
    """Clear ``factorises`` for each lane of the symmetric (D, D, lanes) ``a`` without a Cholesky factor (a
    pivot not positive), as LAPACK's potrf decides; ``scratch`` (D, D, lanes) takes the factors. A lane's
    pivots after its first failure are NaN or garbage, and are not read."""
    D, L = a.shape[0], a.shape[2]
    for j in range(D):
        for c in range(L):
            s = a[j, j, c]
            for m in range(j):
                s -= scratch[j, m, c] * scratch[j, m, c]
            factorises[c] = factorises[c] and s > 0.0
            scratch[j, j, c] = np.sqrt(s)
        for i in range(j + 1, D):
            for c in range(L):
                s = a[i, j, c]
                for m in range(j):
                    s -= scratch[i, m, c] * scratch[j, m, c]
                scratch[i, j, c] = s / scratch[j, j, c]


@_jit
def _softmax(logits, fixed, out):
    """softmax over the components not ``fixed`` (the fixed get zero), as ``torch.softmax`` computes it."""
    top = -np.inf
    for k in range(logits.shape[0]):
        if not fixed[k] and logits[k] > top:
            top = logits[k]
    total = 0.0
    for k in range(logits.shape[0]):
        out[k] = 0.0 if fixed[k] else np.exp(logits[k] - top)
        total += out[k]
    for k in range(logits.shape[0]):
        out[k] = out[k] / total


@_jit
def _adam(param, grad, exp_avg, exp_avg_sq, beta1, beta2, eps, step_size, bias_correction2_sqrt):
    """``adam.Adam.step`` on one flattened parameter, in place."""
    for i in range(param.shape[0]):
        exp_avg[i] = exp_avg[i] + (1.0 - beta1) * (grad[i] - exp_avg[i])
        exp_avg_sq[i] = exp_avg_sq[i] * beta2 + (1.0 - beta2) * grad[i] * grad[i]
        denom = np.sqrt(exp_avg_sq[i]) / bias_correction2_sqrt + eps
        param[i] = param[i] + -step_size * (exp_avg[i] / denom)


@_jit
def _sgd_loop(
    logits, means, raw, scale, adam_state, adam, q, U, UU, P, n, w, fixed_weights, fixed_means, fixed_cov, initial, dims
):
    """``CholeskyParameters.loss_gradients`` and an Adam step on (logits, means, raw) in place, then the
    mixture the new parameters describe (``CholeskyParameters.mixture``) as (weights, means, covariances);
    ``w`` (D,) the diagonal of W, empty for no penalty; ``dims``: ``dimensions(D)``."""
    K, D = means.shape[0], len(dims)
    beta1, beta2, eps, step_size, bias_correction2_sqrt = adam
    weight_values = initial[0]
    any_fixed_weight = False
    for k in range(K):
        any_fixed_weight = any_fixed_weight or fixed_weights[k]
    no_fixed = np.zeros(K, np.bool_)
    grad_logits = np.empty(K)
    grad_means = np.empty((K, D))
    grad_raw = np.zeros((K, D, D))
    unit = np.zeros((D, D))
    chol = np.zeros((D, D))
    beta = np.empty(K)
    _softmax(logits, fixed_weights if any_fixed_weight else no_fixed, beta)
    q_free = 0.0
    for k in range(K):
        q_free += 0.0 if fixed_weights[k] else np.float64(q[k])
    for k in range(K):
        if any_fixed_weight:
            grad_logits[k] = 0.0 if fixed_weights[k] else -(np.float64(q[k]) - beta[k] * q_free)
        else:
            grad_logits[k] = -(np.float64(q[k]) - n * beta[k])
        for i in range(D):
            grad_means[k, i] = 0.0 if fixed_means[k] else -np.float64(U[k, i]) * scale[k, i]
        if fixed_cov[k]:
            continue
        trace = 0.0
        for i in range(D):
            for j in range(i + 1):
                unit[i, j] = np.exp(raw[k, i, i]) if i == j else raw[k, i, j]
                chol[i, j] = scale[k, i] * unit[i, j]
        for i in range(D):
            s = 0.0
            for j in range(i + 1):
                s += chol[i, j] * chol[i, j]
            trace += s / w[i] if w.shape[0] else 0.0
        for i in range(D):
            ridge = 1.0 / (trace**2 * w[i]) if w.shape[0] else 0.0
            for j in range(i + 1):
                s = 0.0
                for m in range(j, D):  # chol[m, j] is 0 above the diagonal: the terms skipped added +0 to +0
                    grad_cov = -0.5 * (np.float64(UU[k, i, m]) - np.float64(P[k, i, m])) - (ridge if i == m else 0.0)
                    s += 2.0 * grad_cov * chol[m, j]
                g = scale[k, i] * s
                grad_raw[k, i, j] = g * unit[i, i] if i == j else g
    m1, m2 = adam_state
    _adam(logits, grad_logits, m1[0], m2[0], beta1, beta2, eps, step_size, bias_correction2_sqrt)
    _adam(means.reshape(-1), grad_means.reshape(-1), m1[1], m2[1], beta1, beta2, eps, step_size, bias_correction2_sqrt)
    _adam(raw.reshape(-1), grad_raw.reshape(-1), m1[2], m2[2], beta1, beta2, eps, step_size, bias_correction2_sqrt)
    weights = np.empty(K)
    _softmax(logits, fixed_weights if any_fixed_weight else no_fixed, weights)
    if any_fixed_weight:
        free_total, fixed_total = 0.0, 0.0
        for k in range(K):
            free_total += 0.0 if fixed_weights[k] else weights[k]
            fixed_total += weight_values[k] if fixed_weights[k] else 0.0
        divisor = free_total if free_total > 0 else 1.0
        for k in range(K):
            weights[k] = weight_values[k] if fixed_weights[k] else weights[k] / divisor * (1.0 - fixed_total)
    return weights, *_cholesky_mixture(means, raw, scale, fixed_means, fixed_cov, initial[1:], unit, chol)


@_jit
def _cholesky_mixture(means, raw, scale, fixed_means, fixed_cov, initial, unit, chol):
    """The means (K, D) and covariances (K, D, D) that SGD's parameters describe
    (``CholeskyParameters.mixture``), the fixed ones the ``initial`` (means, covariances); ``unit`` and
    ``chol`` (D, D) are scratch."""
    K, D = means.shape
    initial_means, initial_cov = initial
    out_means = np.empty((K, D))
    out_cov = np.empty((K, D, D))
    for k in range(K):
        for i in range(D):
            out_means[k, i] = initial_means[k, i] if fixed_means[k] else means[k, i] * scale[k, i]
        if fixed_cov[k]:
            out_cov[k] = initial_cov[k]
            continue
        for i in range(D):
            for j in range(i + 1):
                unit[i, j] = np.exp(raw[k, i, i]) if i == j else raw[k, i, j]
                chol[i, j] = scale[k, i] * unit[i, j]
        for i in range(D):
            for j in range(i + 1):  # (j, i) is the same sum of the same products (a product commutes exactly)
                s = 0.0
                for m in range(j + 1):
                    s += chol[i, m] * chol[j, m]
                out_cov[k, i, j] = out_cov[k, j, i] = s
    return out_means, out_cov


def sums_of(stats: Statistics) -> tuple:
    """A CPU batch's Statistics as the compiled steps take them: (n points, q, U, UU, P) as arrays."""
    return (float(stats.n_points), stats.q.numpy(), stats.U.numpy(), stats.UU.numpy(), stats.P.numpy())


def online_em_step(
    state: tuple[np.ndarray, np.ndarray, np.ndarray],
    n: float,
    q: np.ndarray,
    U: np.ndarray,
    UU: np.ndarray,
    P: np.ndarray,
    step: float,
    w: float | torch.Tensor | None,
    fixed,
    data_size: float | None = None,
    views: ArrayViews | None = None,
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """``updates.online_em_update`` and ``updates.regularised`` in one compiled call, on arrays: the running
    state's (weights, means, covariances) and a batch's sums (n points, q, U, UU, P; ``sums_of``) in, (the
    new state's arrays, the E-step mixture's) out, new arrays that no later step writes to. ``fixed``: a
    ``FixedParameters``; ``views`` keeps the arrays of W and of the fixed masks from step to step (a
    fitter's own, or made afresh). No tensor is made unless a covariance needs ``clip_rounding`` or weights
    are fixed."""
    loop, k = _online_em_loop, state[1].shape[0]
    if k >= PARALLEL_COMPONENTS and (threads := torch.get_num_threads()) > 1:
        loop = partial(_online_em_loop_parallel, parts=threads if k < 2 * PARALLEL_COMPONENTS else 4 * threads)
    held = (w, fixed.means, fixed.covariances, state[1].shape[1], torch.float64)  # the state is float64
    w_array, prior_size, fixed_means, fixed_cov, dims = (views or ArrayViews())(held, _em_arrays)
    weights, means, cov, e_step_cov, suspect, any_suspect = loop(
        *state,
        q,
        U,
        UU,
        P,
        n,
        step,
        w_array,
        0.0 if data_size is None else prior_size * float(data_size),
        fixed_means,
        fixed_cov,
        TINY,
        dims,
    )
    return _finished(state, (weights, means, cov, e_step_cov, suspect, any_suspect), w, fixed, data_size)


def _finished(state: tuple, out: tuple, w, fixed, data_size: float | None) -> tuple[tuple, tuple]:
    """(new state, E-step mixture) from the compiled loop's outputs: in torch, what is rare, the covariances
    that rounding left indefinite clipped (``updates.clip_rounding``) and fixed weights shared."""
    weights, means, cov, e_step_cov, suspect, any_suspect = out
    if any_suspect:  # tensors sharing the arrays' memory: the clipped rows are written into them
        w = ridge_vector(w, torch.from_numpy(state[1]))
        rows = torch.from_numpy(np.flatnonzero(suspect))
        old, new = Mixture.from_arrays(state), Mixture.from_arrays((weights, means, cov))
        V = e_step_covariances(_rows(old, rows), w, _rows(fixed, rows), data_size)
        new.covariances[rows] = clip_rounding(new.covariances[rows], V)
        torch.from_numpy(e_step_cov)[rows] = e_step_covariances(_rows(new, rows), w, _rows(fixed, rows), data_size)
    e_step_weights = weights
    if fixed.any():
        e_step_weights = share_weights(torch.from_numpy(weights), fixed.weight_values, fixed.weights).numpy()
    return (weights, means, cov), (e_step_weights, means, e_step_cov)


def online_em_steps(states: list[tuple], n: float, sums: tuple, fits: list[tuple]) -> list[tuple[tuple, tuple]]:
    """``online_em_step`` for S fits in one compiled call: each fit's running state, its batch's sums
    (stacked: q (S, K), U (S, K, D), UU and P (S, K, D, D)) and its (step size, w, fixed, data_size,
    views) in ``fits``; each fit's (new state, E-step mixture) out. Every component's arithmetic is the
    same as alone, so each fit's result too."""
    n_fits, k, dim = len(states), states[0][1].shape[0], states[0][1].shape[1]
    threads = torch.get_num_threads()
    parts = max(1, min(k // LANES, -(-threads * 4 // n_fits)))  # each fit's components' shares
    if n_fits * k < PARALLEL_COMPONENTS or threads == 1:  # too little work for a parallel region
        update = _online_em_fits_serial
    else:
        update = partial(_online_em_fits, parts=parts)
    held = [
        views((w, fixed.means, fixed.covariances, dim, torch.float64), _em_arrays) for _, w, fixed, _, views in fits
    ]
    prior = [0.0 if fit[3] is None else h[1] * float(fit[3]) for fit, h in zip(fits, held)]
    weights, means, cov, e_step_cov, suspect, any_suspect = update(
        *(np.stack([state[i] for state in states]) for i in range(3)),
        *sums,
        n,
        np.array([fit[0] for fit in fits]),
        np.stack([h[0] for h in held]),
        np.array(prior),
        np.stack([h[2] for h in held]),
        np.stack([h[3] for h in held]),
        TINY,
        held[0][4],
    )
    outputs = zip(weights, means, cov, e_step_cov, suspect, any_suspect)
    return [_finished(state, out, fit[1], fit[2], fit[3]) for state, out, fit in zip(states, outputs, fits)]


def _em_arrays(held: tuple) -> tuple:
    """``online_em_step``'s long-lived arguments (w, the fixed means' and covariances' masks, D and the
    state's dtype) as its loop takes them: W's diagonal (zeros for none), 1 where the E-step's prior scales
    with the data size (0 for V = Vr + W: see e_step_covariances), the masks, ``dimensions(D)``."""
    w, fixed_means, fixed_cov, dim, dtype = held
    ridge = _ridge_array(w, dim, dtype)
    w_array = np.zeros(dim) if ridge is None else ridge
    return w_array, 0.0 if ridge is None else 1.0, fixed_means.numpy(), fixed_cov.numpy(), dimensions(dim)


def _ridge_array(w, dim: int, dtype: torch.dtype) -> np.ndarray | None:
    """W's diagonal (``ridge_vector``) as a (D,) array of ``dtype`` for a compiled update, None for none."""
    ridge = ridge_vector(w, torch.empty(dim, dtype=dtype))
    return None if ridge is None else ridge.numpy()


def _rows(parameters, rows: torch.Tensor):
    """The components ``rows`` of a ``Mixture`` or ``FixedParameters``."""
    return type(parameters)(*(getattr(parameters, f.name)[rows] for f in dataclasses.fields(parameters)))


class ArrayViews:
    """The arrays a compiled step reads from tensors that live from step to step (SGD's parameters, Adam's
    moments, the fixed parameters), made once and made again only where one of those tensors was replaced
    (a state loaded, fixed parameters released): the step updates them in place, so the views stay theirs.
    SGD's step reads 17 of them: made at every step, they added a third to its call (docs/performance.md)."""

    def __init__(self) -> None:
        self._held: tuple[tuple, tuple] = ((), ())

    def __getstate__(self) -> dict:
        """Nothing: a copy (pickled, deep-copied) holds copies of the tensors and arrays that no longer
        share memory, so it makes its own views."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self._held = ((), ())

    def __call__(self, tensors: tuple, make) -> tuple:
        """``make(tensors)``, from the last call where it was given these same tensor objects."""
        held, arrays = self._held
        if len(held) != len(tensors) or any(mine is not theirs for mine, theirs in zip(held, tensors)):
            arrays = make(tensors)
            self._held = (tensors, arrays)  # one assignment: a reader sees the old pair or the new
        return arrays


def _sgd_arrays(tensors: tuple) -> tuple:
    """``sgd_step``'s long-lived tensors (and w, D and the dtype) as ``_sgd_loop``'s array arguments:
    (logits, means, raw, scale, Adam's moments flat, W's diagonal (empty for none), the fixed masks, the
    initial parameters)."""
    logits, means, raw, scale = (t.numpy() for t in tensors[:4])
    moments = tuple(tuple(t.numpy().reshape(-1) for t in tensors[at : at + 3]) for at in (4, 7))
    fixed_weights, fixed_means, fixed_cov, weight_values, initial_means, initial_cov = (
        t.numpy() for t in tensors[10:16]
    )
    w, dim, dtype = tensors[16:]
    ridge = _ridge_array(w, dim, dtype)
    w = np.empty(0) if ridge is None else ridge
    initial = (weight_values, initial_means, initial_cov)
    return logits, means, raw, scale, moments, w, fixed_weights, fixed_means, fixed_cov, initial


def sgd_step(
    params,
    adam: Adam,
    n: float,
    q: np.ndarray,
    U: np.ndarray,
    UU: np.ndarray,
    P: np.ndarray,
    w: float | torch.Tensor | None,
    views: ArrayViews | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gradient of ``params`` (a ``CholeskyParameters``) from a batch's sums (n points, q, U, UU, P;
    ``sums_of``), ``adam``'s step along it (its state updated in place, as ``Adam.step`` would) and the new
    mixture's (weights, means, covariances), new arrays that no later step writes to, in one compiled call;
    ``views`` keeps the arrays of the tensors that live from step to step (a fitter's own, or made afresh)."""
    (logits, means, raw, scale, moments, w_array, fixed_weights, fixed_means, fixed_cov, initial), steps = (
        _sgd_arguments(params, adam, w, views or ArrayViews())
    )
    return _sgd_loop(
        logits,
        means,
        raw,
        scale,
        moments,
        steps,
        q,
        U,
        UU,
        P,
        n,
        w_array,
        fixed_weights,
        fixed_means,
        fixed_cov,
        initial,
        dimensions(params.means.shape[1]),
    )


def _sgd_arguments(params, adam: Adam, w, views: ArrayViews) -> tuple[tuple, tuple]:
    """``_sgd_loop``'s arrays for ``params`` and ``adam`` (``_sgd_arrays``, kept by ``views``), and Adam's
    constants of this step, its count advanced (as ``Adam.step`` advances it)."""
    adam.steps += 1
    beta1, beta2 = adam.betas
    fixed, initial = params.fixed, params.initial
    tensors = (
        *params.tensors(),
        params.scale,
        *adam.exp_avg,
        *adam.exp_avg_sq,
        fixed.weights,
        fixed.means,
        fixed.covariances,
        fixed.weight_values,
        initial.means,
        initial.covariances,
        w,  # with D and the dtype, for W's diagonal (``ridge_vector``)
        params.means.shape[1],
        params.means.dtype,
    )
    return views(tensors, _sgd_arrays), (beta1, beta2, adam.eps, *adam.corrections())


def sgd_steps(fits: list[tuple], n: float, sums: tuple) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``sgd_step`` for S fits in one compiled call: each fit's (params, adam, w, views) in ``fits``, its
    batch's sums stacked in ``sums`` (q (S, K), U (S, K, D), UU and P (S, K, D, D)); each fit's new mixture
    out, its parameters and Adam's state updated in place. Each fit's arithmetic is its own call's."""
    arguments = [_sgd_arguments(params, adam, w, views) for params, adam, w, views in fits]
    columns = list(zip(*(arrays for arrays, _ in arguments)))
    logits, means, raw, scale, moments, w_array, fixed_weights, fixed_means, fixed_cov, initial = columns
    first, second = zip(*moments)
    weights, out_means, out_cov = _sgd_fits(
        (logits, means, raw, scale),
        (tuple(m[0] for m in first), tuple(m[1] for m in first), tuple(m[2] for m in first)),
        (tuple(m[0] for m in second), tuple(m[1] for m in second), tuple(m[2] for m in second)),
        np.array([steps for _, steps in arguments]),
        sums,
        n,
        (w_array, fixed_weights, fixed_means, fixed_cov),
        (tuple(i[0] for i in initial), tuple(i[1] for i in initial), tuple(i[2] for i in initial)),
        dimensions(fits[0][0].means.shape[1]),
    )
    return list(zip(weights, out_means, out_cov))


@_jit
def _sgd_fits(parameters, first, second, constants, sums, n, masks, initial, dims):
    """``_sgd_loop`` for S fits, each argument a tuple over the fits (``constants`` and ``sums`` stacked on
    a leading fit axis), one fit after another (as one fit's update runs, on one thread: numba's parallel
    loops take no tuples of arrays); the new mixtures stacked."""
    logits, means, raw, scale = parameters
    w, fixed_weights, fixed_means, fixed_cov = masks
    q, U, UU, P = sums
    S, K, D = len(logits), means[0].shape[0], means[0].shape[1]
    out = (np.empty((S, K)), np.empty((S, K, D)), np.empty((S, K, D, D)))
    for s in range(S):
        moments = ((first[0][s], first[1][s], first[2][s]), (second[0][s], second[1][s], second[2][s]))
        c = constants[s]
        weights, new_means, new_cov = _sgd_loop(
            logits[s],
            means[s],
            raw[s],
            scale[s],
            moments,
            (c[0], c[1], c[2], c[3], c[4]),
            q[s],
            U[s],
            UU[s],
            P[s],
            n,
            w[s],
            fixed_weights[s],
            fixed_means[s],
            fixed_cov[s],
            (initial[0][s], initial[1][s], initial[2][s]),
            dims,
        )
        out[0][s], out[1][s], out[2][s] = weights, new_means, new_cov
    return out
