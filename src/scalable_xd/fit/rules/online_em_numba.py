"""Online EM's update as one numba loop over the components: its form on the CPU, on the pass's arrays.

A minibatch step's float64 update (online EM's, or SGD's gradient and Adam step) is a few hundred numbers
per component; written as torch calls it is dozens of small operations whose dispatch costs several times
the arithmetic (as much as the statistics pass itself: docs/performance.md). Here each is one compiled
call. The arithmetic follows ``online_em`` operation for operation, so the results agree with the torch
update to rounding (the matrix products' summation order differs); ``online_em`` stays the definition and
the path on other devices. What is rare stays in torch: the eigenvalue clipping of a covariance that
rounding left indefinite (``em.clip_rounding``) runs on the components this loop flags.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import numba
import numpy as np
import torch

from ...mixture import Mixture
from .arrays import ArrayRule, CachedViews, dimensions, ridge_array
from .em import clip_rounding, e_step_covariances, ridge_vector, share_weights
from .numba_jit import jit, jit_inline, jit_parallel
from .online_em import OnlineEMFitter

# Components from which online EM's update is shared among threads (``threads`` parts below 128 components,
# four a thread from there): right after the pass, whose threads still spin (``GOMP_SPINCOUNT``), a parallel
# region starts in about the time of ten components' updates (docs/performance.md, "The minibatch step").
PARALLEL_COMPONENTS = 64


LANES = 64  # components updated together: their scratch (~150 kB) stays in the L2 cache


TINY = float(np.finfo(np.float64).tiny)


@jit
def _online_em_loop(weights, means, cov, q, U, UU, P, n, step, w, data_size, fixed_means, fixed_cov, tiny, dims):
    """``online_em.online_em_update`` per component, returning the new running state, the E-step's
    covariances (``em.e_step_covariances``; ``w`` (D,) the diagonal of W, zeros for none;
    ``data_size`` 0 for the paper's W added), which components' new covariance failed a Cholesky
    factorisation and whether any did; ``dims``: ``dimensions(D)``."""
    args = (weights, means, cov, q, U, UU, P, n, step, w, data_size, fixed_means, fixed_cov, tiny)
    out = _online_em_outputs(means)
    _online_em_components(0, means.shape[0], args, out, dims)
    return _with_any_suspect(out)


@jit_parallel
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


@jit_parallel
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


@jit
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


@jit_inline
def _online_em_job(job, parts, args, out, dims):
    """Part ``job % parts`` of fit ``job // parts``'s components, updated as ``_online_em_loop`` updates them."""
    weights, means, cov, q, U, UU, P, n, steps, w, data_size, fixed_means, fixed_cov, tiny = args
    s, part, K = job // parts, job % parts, means.shape[1]
    fit_args = (weights[s], means[s], cov[s], q[s], U[s], UU[s], P[s], n, steps[s], w[s], data_size[s])
    fit_out = (out[0][s], out[1][s], out[2][s], out[3][s], out[4][s])
    first, last = part * K // parts, (part + 1) * K // parts
    _online_em_components(first, last, (*fit_args, fixed_means[s], fixed_cov[s], tiny), fit_out, dims)


@jit
def _with_any_suspect_fits(out):
    """``_with_any_suspect`` for each of S fits."""
    any_suspect = np.zeros(out[4].shape[0], np.bool_)
    for s in range(out[4].shape[0]):
        any_suspect[s] = out[4][s].any()
    return (*out, any_suspect)


@jit
def _online_em_outputs(means):
    """Empty outputs for the components of ``means``, (K, D) or (S, K, D) for S fits: weights, means,
    covariances, the E-step's covariances and which components are suspect."""
    lead, D = means.shape[:-1], means.shape[-1]
    square = means.shape + (D,)
    return np.empty(lead), np.empty(means.shape), np.empty(square), np.empty(square), np.zeros(lead, np.bool_)


@jit
def _with_any_suspect(out):
    """The outputs and whether any component is suspect (compiled: asked of numpy it costs a fifth of the loop)."""
    weights, means, cov, e_step_cov, suspect = out
    return weights, means, cov, e_step_cov, suspect, suspect.any()


@jit
def _online_em_lanes(first, last, args, out, dims):
    """The update of components ``first`` to ``last`` - 1 as lanes: each quantity is held as (D, D, lanes)
    or (lanes,), and every loop runs over the lanes innermost, so that LLVM vectorises the arithmetic
    across components (the divisions above all). Each lane's arithmetic is ``online_em``'s in the same order
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


@jit_inline
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


@jit_inline
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


@jit
def _online_em_components(first, last, args, out, dims):
    """The update of components ``first`` to ``last`` - 1 (``_online_em_loop``'s arguments and outputs),
    LANES at a time."""
    for lane in range(first, last, LANES):
        _online_em_lanes(lane, min(lane + LANES, last), args, out, dims)


@jit
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
    views: CachedViews | None = None,
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """``online_em.online_em_update`` and ``em.regularised`` in one compiled call, on arrays: the running
    state's (weights, means, covariances) and a batch's sums (n points, q, U, UU, P; ``sums_of``) in, (the
    new state's arrays, the E-step mixture's) out, new arrays that no later step writes to. ``fixed``: a
    ``FixedParameters``; ``views`` keeps the arrays of W and of the fixed masks from step to step (a
    fitter's own, or made afresh). No tensor is made unless a covariance needs ``clip_rounding`` or weights
    are fixed."""
    loop, k = _online_em_loop, state[1].shape[0]
    if k >= PARALLEL_COMPONENTS and (threads := torch.get_num_threads()) > 1:
        loop = partial(_online_em_loop_parallel, parts=threads if k < 2 * PARALLEL_COMPONENTS else 4 * threads)
    held = (w, fixed.means, fixed.covariances, state[1].shape[1], torch.float64)  # the state is float64
    w_array, prior_size, fixed_means, fixed_cov, dims = (views or CachedViews())(held, _em_arrays)
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
    that rounding left indefinite clipped (``em.clip_rounding``) and fixed weights shared."""
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
    ridge = ridge_array(w, dim, dtype)
    w_array = np.zeros(dim) if ridge is None else ridge
    return w_array, 0.0 if ridge is None else 1.0, fixed_means.numpy(), fixed_cov.numpy(), dimensions(dim)


def _rows(parameters, rows: torch.Tensor):
    """The components ``rows`` of a ``Mixture`` or ``FixedParameters``."""
    return type(parameters)(*(getattr(parameters, f.name)[rows] for f in dataclasses.fields(parameters)))


class OnlineEMArrays(ArrayRule):
    """Online EM's centred update (``online_em.online_em_update``, then ``regularised``) as one compiled call
    (``online_em_step``) on a ``MinibatchEM``'s arrays."""

    fitter: OnlineEMFitter

    @staticmethod
    def accepts(fitter: OnlineEMFitter) -> bool:
        return not fitter.naive  # the paper's eq. 7 is kept for study, in torch alone

    def arrays(self) -> tuple:
        return self.fitter.e_step_arrays()

    def observe_sums(self, n: float, q, U, UU, P) -> None:
        f = self.fitter
        held = online_em_step(
            f.state_arrays(), n, q, U, UU, P, f.next_step_size(), f.w, f.fixed_parameters, f.data_size, self.views
        )
        f.hold(*held)

    @staticmethod
    def update_together(rules: list[OnlineEMArrays], n: float, sums: tuple) -> None:
        """``online_em_steps`` for these fits' rules, each fitter holding its new state."""
        fitters = [rule.fitter for rule in rules]
        fits = [
            (f.next_step_size(), f.w, f.fixed_parameters, f.data_size, rule.views) for f, rule in zip(fitters, rules)
        ]
        for fitter, new in zip(fitters, online_em_steps([f.state_arrays() for f in fitters], n, sums, fits)):
            fitter.hold(*new)
