"""SGD's gradient and Adam's step as one numba loop over the components: its form on the CPU, on the pass's
arrays, following ``sgd.CholeskyParameters.loss_gradients`` and ``sgd.Adam.step`` operation for operation."""

from __future__ import annotations

import numpy as np
import torch

from .arrays import ArrayRule, CachedViews, dimensions, ridge_array
from .numba_jit import jit
from .sgd import Adam, SGDFitter


@jit
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


@jit
def _adam_step(param, grad, exp_avg, exp_avg_sq, beta1, beta2, eps, step_size, bias_correction2_sqrt):
    """``sgd.Adam.step`` on one flattened parameter, in place."""
    for i in range(param.shape[0]):
        exp_avg[i] = exp_avg[i] + (1.0 - beta1) * (grad[i] - exp_avg[i])
        exp_avg_sq[i] = exp_avg_sq[i] * beta2 + (1.0 - beta2) * grad[i] * grad[i]
        denom = np.sqrt(exp_avg_sq[i]) / bias_correction2_sqrt + eps
        param[i] = param[i] + -step_size * (exp_avg[i] / denom)


@jit
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
    _adam_step(logits, grad_logits, m1[0], m2[0], beta1, beta2, eps, step_size, bias_correction2_sqrt)
    _adam_step(
        means.reshape(-1), grad_means.reshape(-1), m1[1], m2[1], beta1, beta2, eps, step_size, bias_correction2_sqrt
    )
    _adam_step(raw.reshape(-1), grad_raw.reshape(-1), m1[2], m2[2], beta1, beta2, eps, step_size, bias_correction2_sqrt)
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


@jit
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
    ridge = ridge_array(w, dim, dtype)
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
    views: CachedViews | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gradient of ``params`` (a ``CholeskyParameters``) from a batch's sums (n points, q, U, UU, P;
    ``sums_of``), ``adam``'s step along it (its state updated in place, as ``Adam.step`` would) and the new
    mixture's (weights, means, covariances), new arrays that no later step writes to, in one compiled call;
    ``views`` keeps the arrays of the tensors that live from step to step (a fitter's own, or made afresh)."""
    (logits, means, raw, scale, moments, w_array, fixed_weights, fixed_means, fixed_cov, initial), steps = (
        _sgd_arguments(params, adam, w, views or CachedViews())
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


def _sgd_arguments(params, adam: Adam, w, views: CachedViews) -> tuple[tuple, tuple]:
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


@jit
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


class AdamArrays(ArrayRule):
    """SGD's gradient (``CholeskyParameters.loss_gradients``) and Adam's step as one compiled call
    (``sgd_step``) on an ``SGD``'s parameters, updated in place."""

    fitter: SGDFitter

    @staticmethod
    def accepts(fitter: SGDFitter) -> bool:
        return True

    def arrays(self) -> tuple:
        return self.fitter.mixture_arrays()

    def observe_sums(self, n: float, q, U, UU, P) -> None:
        f = self.fitter
        f.hold(sgd_step(f.params, f.optimizer, n, q, U, UU, P, f.w, self.views))

    @staticmethod
    def update_together(rules: list[AdamArrays], n: float, sums: tuple) -> None:
        """``sgd_steps`` for these fits' rules, each fitter holding its new mixture."""
        sgds = [rule.fitter for rule in rules]
        for sgd, mixture in zip(
            sgds, sgd_steps([(f.params, f.optimizer, f.w, r.views) for f, r in zip(sgds, rules)], n, sums)
        ):
            sgd.hold(mixture)
