"""The minibatch updates as single numba loops over the components, for the CPU.

A minibatch step's float64 update (online EM's, or SGD's gradient and Adam step) is a few hundred numbers
per component; written as torch calls it is dozens of small operations whose dispatch costs several times
the arithmetic (~0.3 ms a step at K = 64, as much as the statistics pass itself). Here each is one compiled
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

from ..kernel.statistics import Statistics
from ..mixture import Mixture
from .adam import Adam
from .updates import clip_rounding, e_step_covariances, ridge_vector, share_weights

# Typed as what they make of a function: numba's stubs give a compiled function's call no arguments.
_jit: Callable[[Callable[..., Any]], Callable[..., Any]] = numba.njit(cache=True, error_model="numpy")
_jit_parallel: Callable[[Callable[..., Any]], Callable[..., Any]] = numba.njit(
    cache=True, error_model="numpy", parallel=True
)
# Components from which online EM's update is shared among threads: ~1 us a component, against ~10-20 us
# to start a parallel region
PARALLEL_COMPONENTS = 128
TINY = float(np.finfo(np.float64).tiny)


def dimensions(dim: int) -> tuple[int, ...]:
    """D as the length of a tuple, which numba knows when it compiles a loop (one compilation per D): its
    D x D loops then unroll, ~25% off online EM's update at D = 7 (40 -> 30 us at K = 64), with the same
    arithmetic in the same order, so the same results to the bit."""
    return (0,) * dim


@_jit
def _online_em_loop(weights, means, cov, q, U, UU, P, n, step, w, data_size, fixed_means, fixed_cov, tiny, dims):
    """``updates.online_em_update`` per component, returning the new running state, the E-step's
    covariances (``updates.e_step_covariances``; ``w`` (D,) the diagonal of W, zeros for none;
    ``data_size`` 0 for the paper's W added) and which components' new covariance failed a Cholesky
    factorisation; ``dims``: ``dimensions(D)``."""
    args = (weights, means, cov, q, U, UU, P, n, step, w, data_size, fixed_means, fixed_cov, tiny)
    out = _online_em_outputs(means)
    _online_em_components(0, means.shape[0], args, out, dims)
    return out


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
    return out


@_jit
def _online_em_outputs(means):
    K, D = means.shape
    return np.empty(K), np.empty((K, D)), np.empty((K, D, D)), np.empty((K, D, D)), np.zeros(K, np.bool_)


@_jit
def _online_em_components(first, last, args, out, dims):
    """The update of components ``first`` to ``last`` - 1 (``_online_em_loop``'s arguments and outputs)."""
    weights, means, cov, q, U, UU, P, n, step, w, data_size, fixed_means, fixed_cov, tiny = args
    new_weights, new_means, new_cov, e_step_cov, suspect = out
    D = len(dims)  # known when compiled: the D x D loops unroll
    V = np.empty((D, D))
    inner = np.empty((D, D))
    t = np.empty((D, D))
    a = np.empty((D, D))
    g = np.empty(D)
    for k in range(first, last):
        free = 0.0 if fixed_cov[k] else 1.0
        count = weights[k] * data_size
        for i in range(D):
            for j in range(D):
                if data_size == 0.0 or fixed_cov[k]:
                    V[i, j] = cov[k, i, j] + (free * w[i] if i == j else 0.0)
                else:
                    V[i, j] = (count * cov[k, i, j] + (w[i] if i == j else 0.0)) / (count + 1.0)
        q_b = q[k] / n
        q_new = (1.0 - step) * weights[k] + step * q_b
        live = q_new > tiny
        q_safe = q_new if live else 1.0
        for i in range(D):
            g[i] = step * np.float64(U[k, i]) / (n * q_safe)
        for i in range(D):
            for j in range(D):
                centre = 0.0 if fixed_means[k] else g[i] * g[j]
                inner[i, j] = step * (np.float64(UU[k, i, j]) - np.float64(P[k, i, j])) / (n * q_safe) - centre
        for i in range(D):
            for j in range(D):
                s = 0.0
                for m in range(D):
                    s += V[i, m] * inner[m, j]
                t[i, j] = s
        pull = step * q_b / q_safe
        for i in range(D):
            for j in range(D):
                s = 0.0
                for m in range(D):
                    s += t[i, m] * V[m, j]
                if data_size == 0.0:
                    a[i, j] = cov[k, i, j] + (pull * w[i] if i == j else 0.0) + s
                else:
                    a[i, j] = cov[k, i, j] + pull * (V[i, j] - cov[k, i, j]) + s
        new_weights[k] = q_new
        for i in range(D):
            s = 0.0
            for m in range(D):
                s += V[i, m] * g[m]
            new_means[k, i] = s + means[k, i] if live and not fixed_means[k] else means[k, i]
        update_cov = live and not fixed_cov[k]
        finite = True
        new_count = q_new * data_size
        for i in range(D):
            for j in range(D):
                value = 0.5 * (a[i, j] + a[j, i]) if update_cov else cov[k, i, j]
                new_cov[k, i, j] = value
                if data_size == 0.0 or fixed_cov[k]:
                    e_step_cov[k, i, j] = value + (free * w[i] if i == j else 0.0)
                else:
                    e_step_cov[k, i, j] = (new_count * value + (w[i] if i == j else 0.0)) / (new_count + 1.0)
                finite = finite and np.isfinite(value)
        if update_cov and finite and not _factorises(new_cov[k], t):
            suspect[k] = True


@_jit
def _factorises(a, scratch):
    """Whether the symmetric ``a`` has a Cholesky factor (every pivot positive), as LAPACK's potrf decides."""
    D = a.shape[0]
    for j in range(D):
        s = a[j, j]
        for m in range(j):
            s -= scratch[j, m] * scratch[j, m]
        if not s > 0.0:
            return False
        scratch[j, j] = np.sqrt(s)
        for i in range(j + 1, D):
            s = a[i, j]
            for m in range(j):
                s -= scratch[i, m] * scratch[j, m]
            scratch[i, j] = s / scratch[j, j]
    return True


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
    weight_values, initial_means, initial_cov = initial
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
                for m in range(D):
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
            for j in range(D):
                s = 0.0
                for m in range(min(i, j) + 1):
                    s += chol[i, m] * chol[j, m]
                out_cov[k, i, j] = s
    return weights, out_means, out_cov


def _arrays(stats: Statistics) -> tuple:
    return (stats.q.numpy(), stats.U.numpy(), stats.UU.numpy(), stats.P.numpy(), float(stats.n_points))


def online_em_step(
    state: Mixture,
    stats: Statistics,
    step: float,
    w: float | torch.Tensor | None,
    fixed,
    data_size: float | None = None,
) -> tuple[Mixture, Mixture]:
    """``updates.online_em_update`` and ``updates.regularised`` in one compiled call: (the new running
    state, the mixture the E-step uses). ``fixed``: a ``FixedParameters``."""
    w = ridge_vector(w, state.means)
    threads = torch.get_num_threads()
    parallel = state.n_components >= PARALLEL_COMPONENTS and threads > 1
    loop = partial(_online_em_loop_parallel, parts=4 * threads) if parallel else _online_em_loop
    weights, means, cov, e_step_cov, suspect = loop(
        state.weights.numpy(),
        state.means.numpy(),
        state.covariances.numpy(),
        *_arrays(stats),
        step,
        np.zeros(state.means.shape[1]) if w is None else w.numpy(),
        0.0 if data_size is None or w is None else float(data_size),  # 0: V = Vr + W (see e_step_covariances)
        fixed.means.numpy(),
        fixed.covariances.numpy(),
        TINY,
        dimensions(state.means.shape[1]),
    )
    weights, means, cov, e_step_cov = map(torch.from_numpy, (weights, means, cov, e_step_cov))
    if suspect.any():
        rows = torch.from_numpy(np.flatnonzero(suspect))
        V = e_step_covariances(_rows(state, rows), w, _rows(fixed, rows), data_size)
        cov[rows] = clip_rounding(cov[rows], V)
        e_step_cov[rows] = e_step_covariances(
            Mixture(weights[rows], means[rows], cov[rows]), w, _rows(fixed, rows), data_size
        )
    e_step_weights = weights
    if fixed.any():
        e_step_weights = share_weights(weights, fixed.weight_values, fixed.weights)
    return Mixture(weights, means, cov), Mixture(e_step_weights, means, e_step_cov)


def _rows(parameters, rows: torch.Tensor):
    """The components ``rows`` of a ``Mixture`` or ``FixedParameters``."""
    return type(parameters)(*(getattr(parameters, f.name)[rows] for f in dataclasses.fields(parameters)))


def sgd_step(params, adam: Adam, stats: Statistics, w: float | torch.Tensor | None) -> Mixture:
    """The gradient of ``params`` (a ``CholeskyParameters``) from ``stats``, ``adam``'s step along it (its
    state updated in place, as ``Adam.step`` would) and the new mixture, in one compiled call."""
    w = ridge_vector(w, params.means)
    adam.steps += 1
    beta1, beta2 = adam.betas
    fixed, initial = params.fixed, params.initial
    weights, means, cov = _sgd_loop(
        *(t.numpy() for t in params.tensors()),
        params.scale.numpy(),
        (tuple(t.numpy().reshape(-1) for t in adam.exp_avg), tuple(t.numpy().reshape(-1) for t in adam.exp_avg_sq)),
        (beta1, beta2, adam.eps, *adam.corrections()),
        *_arrays(stats),
        np.empty(0) if w is None else w.numpy(),
        fixed.weights.numpy(),
        fixed.means.numpy(),
        fixed.covariances.numpy(),
        (fixed.weight_values.numpy(), initial.means.numpy(), initial.covariances.numpy()),
        dimensions(params.means.shape[1]),
    )
    return Mixture(torch.from_numpy(weights), torch.from_numpy(means), torch.from_numpy(cov))
