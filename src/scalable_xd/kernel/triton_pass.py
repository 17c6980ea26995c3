"""The statistics pass as Triton kernels over tiles of (component, star) pairs, R_i = I: the GPU's
hand-written path, and one that runs on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``), so
that CI checks it on every commit.

A program takes one component j and a block of BLOCK stars (with several fits' batches in one launch,
``ensemble_statistics``, one component of one fit and that fit's stars). The first kernel factorises
T_ij = V_j + S_i (Cholesky, unrolled entry by entry for the dimension D, a compile-time constant), solves
z = L^-1 d and writes log alpha_j N_ij and a failed-factorisation flag, one (K, B) array each; nothing of
size (K, B, D, D) ever exists. A third kernel (``combine``) takes each star's log-sum-exp over its fit's
components, reading the (K, B) array in tiles along the stars. The second
kernel factorises again (cheaper than storing the factors), forms each pair's responsibility from its log
density and its star's log-likelihood (times the star's weight), so that no (K, B) array of
responsibilities is written or read, forms u = T^-1 d and T^-1, and reduces r, r u, r u u^T and r T^-1
over its block of stars, writing one row of partial sums per (block, component); the blocks' rows are
summed in float64 by torch. Stochastic EM's draws (``statistics.assign``) reach it as one-hot
responsibilities written as log densities of 0 and -inf about a log-likelihood of 0. Every reduction has
a fixed order, so the same input gives the same bits. The split-and-merge criteria come from the (K, B)
log-densities through ``statistics.criteria_sums``.

The source is generated per D, as ``fused``'s is, and written into the kernel cache folder, since Triton
compiles a kernel from its source file.
"""

from __future__ import annotations

from functools import cache

import torch

from ..mixture import Mixture
from .statistics import (
    LOG_2PI,
    Criteria,
    Statistics,
    assign,
    criteria_sums,
    n_points,
    raise_for_failed_pairs,
    summed_loglik,
    symmetric_from_triangle,
)
from .unrolled_source import factorise_and_solve, import_generated, invert_factor, t_inv_entry, tri, u_entry

BLOCK = 128  # stars per program
# One warp a program: the sums kernel's 63 block reductions then stay within a warp (shuffles, no shared
# memory or barriers); on an H100 it ran several times faster than with four, and 2, 8 and blocks of 64
# and 256 stars were slower (benchmarks/bench_triton_launch.py, bench_triton_launch_cuda.json).
NUM_WARPS = 1
MAX_DIM = 8


def n_sums(dim: int) -> int:
    """Sums per (block of stars, component) the sums kernel writes: r u, the lower triangles of r u u^T and
    r T^-1, and r."""
    return dim + dim * (dim + 1) + 1


def n_par(dim: int) -> int:
    """Parameters per component in the flat array the kernels read: V's lower triangle, the mean, log alpha.
    Written into the source as a literal: a compiled Triton kernel reads no module globals."""
    return dim * (dim + 1) // 2 + dim + 1


def _factorise(dim: int) -> list[str]:
    """Statements that load star block ``offs`` and component ``k`` and factorise T = V_k + S_i."""
    n_tri = dim * (dim + 1) // 2
    lines = [
        "k = tl.program_id(0)  # fit k // n_comp's component k % n_comp: the fits' components one after another",
        "first = (k // n_comp) * n  # the fit's first star among every fit's, n a fit",
        "offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)",
        "live = offs < n",
    ]
    for i in range(dim):
        mean = f"tl.load(par_ptr + k * {n_par(dim)} + {n_tri + i})"
        lines.append(f"d{i} = tl.load(x_ptr + {i} * n_all + first + offs, mask=live, other=0.0) - {mean}")

    def v(i: int, j: int) -> str:
        return f"tl.load(par_ptr + k * {n_par(dim)} + {tri(i, j)})"

    def s(i: int, j: int) -> str:  # padding stars see S = I, so that every lane stays finite
        entry = f"s_ptr + {i * dim + j} * n_all + first + offs"
        return f"tl.load({entry}, mask=live, other={1.0 if i == j else 0.0})"

    lines += factorise_and_solve(dim, v, s, "tl.sqrt", "1.0")
    return lines


def _source(dim: int) -> str:
    """The module of both kernels for dimension ``dim``."""
    n_tri = dim * (dim + 1) // 2
    ok = " & ".join(f"(p{j} > 0) & (w{j}_{j} > 0)" for j in range(dim))  # a pivot in (0, inf), NaN not
    densities = _factorise(dim) + [
        "maha = " + " + ".join(f"z{i} * z{i}" for i in range(dim)),
        "half_logdet = " + " + ".join(f"tl.log(l{j}_{j})" for j in range(dim)),
        f"dens = tl.load(par_ptr + k * {n_par(dim)} + {n_tri + dim}) - half_logdet - 0.5 * (maha + {dim * LOG_2PI!r})",
        "tl.store(dens_ptr + k * n + offs, dens, mask=live)",
        f"tl.store(fail_ptr + k * n + offs, (~({ok})).to(tl.int8), mask=live)",
    ]
    sums = _factorise(dim) + [
        "log_alpha_n = tl.load(dens_ptr + k * n + offs, mask=live, other=0.0)",
        "r = tl.exp(log_alpha_n - tl.load(ll_ptr + first + offs, mask=live, other=0.0))",
        "if WEIGHTED:",
        "    r = r * tl.load(w_ptr + first + offs, mask=live, other=0.0)",
    ]
    sums += invert_factor(dim)
    sums += [f"u{i} = {u_entry(dim, i)}" for i in range(dim)]
    row = f"part_ptr + (tl.program_id(1) * n_fits_comp + k) * {n_sums(dim)}"
    out = 0
    for i in range(dim):
        sums.append(f"tl.store({row} + {out}, tl.sum(tl.where(live, r * u{i}, 0.0), axis=0))")
        out += 1
    for i in range(dim):
        for j in range(i + 1):
            sums.append(f"tl.store({row} + {out}, tl.sum(tl.where(live, r * u{i} * u{j}, 0.0), axis=0))")
            out += 1
    for i in range(dim):  # T^-1's lower triangle
        for j in range(i + 1):
            t_inv = t_inv_entry(dim, i, j)
            sums.append(f"tl.store({row} + {out}, tl.sum(tl.where(live, r * ({t_inv}), 0.0), axis=0))")
            out += 1
    sums.append(f"tl.store({row} + {out}, tl.sum(tl.where(live, r, 0.0), axis=0))")  # q
    indent = lambda lines: ["    " + line for line in lines]  # noqa: E731
    return (
        "\n".join(
            [
                f"# The Triton statistics pass for D = {dim}, written by scalable_xd.kernel.triton_pass.",
                "import triton",
                "import triton.language as tl",
                "",
                "",
                "@triton.jit",
                "def densities(x_ptr, s_ptr, par_ptr, dens_ptr, fail_ptr, n, n_all, n_comp, BLOCK: tl.constexpr):",
                *indent(densities),
                "",
                "",
                "@triton.jit",
                "def sums(",
                "    x_ptr,",
                "    s_ptr,",
                "    par_ptr,",
                "    dens_ptr,",
                "    ll_ptr,",
                "    w_ptr,",
                "    part_ptr,",
                "    n,",
                "    n_all,",
                "    n_comp,",
                "    n_fits_comp,",
                "    WEIGHTED: tl.constexpr,",
                "    BLOCK: tl.constexpr,",
                "):",
                *indent(sums),
                "",
                "",
                *_COMBINE,
            ]
        )
        + "\n"
    )


# The log-sum-exp of each star's log alpha_j N_ij over its fit's components, one fit's block of stars a
# program, reading the (fits x K, n) array in (BLOCK_K, BLOCK) tiles along the stars (coalesced): twice, for
# the largest and then the sum, as torch.logsumexp does (an infinite largest shifts by 0), where torch's
# reduction across the rows of that array took several passes and temporaries of its size.
_COMBINE = [
    "@triton.jit",
    "def combine(dens_ptr, ll_ptr, n, n_comp, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr):",
    "    fit = tl.program_id(0)",
    "    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)",
    "    live = offs < n",
    "    rows = tl.arange(0, BLOCK_K)",
    "    first = dens_ptr + fit * n_comp * n",
    "    top = tl.full([BLOCK], float('-inf'), dens_ptr.dtype.element_ty)",
    "    for start in range(0, n_comp, BLOCK_K):",
    "        k = start + rows",
    "        on = (k[:, None] < n_comp) & live[None, :]",
    "        tile = tl.load(first + k[:, None] * n + offs[None, :], mask=on, other=float('-inf'))",
    "        top = tl.maximum(top, tl.max(tile, axis=0))",
    "    shift = tl.where((top == float('inf')) | (top == float('-inf')), 0.0, top)",
    "    total = tl.zeros([BLOCK], dens_ptr.dtype.element_ty)",
    "    for start in range(0, n_comp, BLOCK_K):",
    "        k = start + rows",
    "        on = (k[:, None] < n_comp) & live[None, :]",
    "        tile = tl.load(first + k[:, None] * n + offs[None, :], mask=on, other=float('-inf'))",
    "        total += tl.sum(tl.exp(tile - shift[None, :]), axis=0)",
    "    tl.store(ll_ptr + fit * n + offs, tl.log(total) + shift, mask=live)",
]
COMBINE_ROWS, COMBINE_STARS = 32, 32  # a combine program's tile: components by stars (one warp)


@cache
def kernels(dim: int):
    """The (densities, sums, combine) kernels for dimension ``dim``, from their generated module
    (``unrolled_source.import_generated``: Triton reads a kernel's source from its file)."""
    if not 1 <= dim <= MAX_DIM:
        raise ValueError(f"the triton kernel handles 1 to {MAX_DIM} dimensions, not {dim}")
    module = import_generated(f"triton_d{dim}", _source(dim))
    return module.densities, module.sums, module.combine


def log_likelihoods(combine, dens: torch.Tensor, n_fits: int) -> torch.Tensor:
    """Each star's log-likelihood under each of ``n_fits`` fits, (n_fits, n), from ``dens`` (n_fits x K, n),
    the fits' log alpha_j N_ij one after another, by the ``combine`` kernel."""
    import triton

    n = dens.shape[1]
    loglik = torch.empty((n_fits, n), dtype=dens.dtype, device=dens.device)
    grid = (n_fits, triton.cdiv(n, COMBINE_STARS))
    combine[grid](dens, loglik, n, dens.shape[0] // n_fits, BLOCK_K=COMBINE_ROWS, BLOCK=COMBINE_STARS, num_warps=1)
    return loglik


def _parameters(weights: torch.Tensor, means: torch.Tensor, covariances: torch.Tensor, dtype) -> torch.Tensor:
    """Per component (of one fit, or of several stacked: leading axes), V's lower triangle, the mean and
    log alpha, flat (... K * n_par(D),) in the pass's dtype."""
    dim = means.shape[-1]
    rows, cols = torch.tril_indices(dim, dim, device=means.device)
    par = torch.cat([covariances[..., rows, cols], means, torch.log(weights)[..., None]], dim=-1)
    return par.to(dtype).contiguous().reshape(-1)


def triton_chunk(
    x,
    S,
    mixture: Mixture,
    R,
    with_stats: bool,
    row_offset: int,
    point_weights=None,
    uniforms=None,
    with_criteria: bool = False,
):
    """(log p(x_i) (B,), log alpha_j N_ij (B, K), Statistics or None) for one chunk, R = I (``R`` is None)."""
    k = mixture.n_components
    par = _parameters(*mixture.tensors(), x.dtype)
    inputs, dens, failed, loglik = _densities(x, S, par, 1, k)
    raise_for_failed_pairs(failed.T, row_offset)
    loglik = loglik[0]
    if not with_stats:
        return loglik, dens.T, None
    log_resp = (dens, loglik)
    if uniforms is not None:  # stochastic EM's draws: one-hot responsibilities, as log densities 0 and -inf about 0
        drawn = assign(torch.exp(dens - loglik), None, uniforms, dim=0)
        log_resp = (torch.log(drawn).to(x.dtype), torch.zeros_like(loglik))
    weights = None if point_weights is None else point_weights.to(x.dtype).contiguous()
    total = _summed(inputs, par, log_resp, weights, 1, k)[0]
    criteria = None
    if with_criteria:
        criteria = Criteria(*criteria_sums(dens, loglik, mixture.log_weights, point_weights, dim=0))
    sums = _sums(total, x.shape[1])
    stats = Statistics(n_points(x, point_weights), *sums, summed_loglik(loglik, point_weights), criteria)
    return loglik, dens.T, stats


def _densities(x: torch.Tensor, S: torch.Tensor, par: torch.Tensor, n_fits: int, k: int):
    """The densities and combine kernels over F fits' batches (fit f's rows f n to (f + 1) n of ``x`` and
    ``S``, its K components' packed parameters in ``par``): the inputs entry-major (coalesced loads), the
    (F K, n) log alpha_j N_ij and failed-factorisation flags, and each star's log-likelihood (F, n)."""
    import triton

    n_all, dim = x.shape
    n = n_all // n_fits
    densities, _, combine = kernels(dim)
    inputs = (x.T.contiguous(), S.reshape(n_all, dim * dim).T.contiguous())
    dens = torch.empty((n_fits * k, n), dtype=x.dtype, device=x.device)
    failed = torch.empty((n_fits * k, n), dtype=torch.int8, device=x.device)
    grid = (n_fits * k, triton.cdiv(n, BLOCK))
    densities[grid](*inputs, par, dens, failed, n, n_all, k, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return inputs, dens, failed, log_likelihoods(combine, dens, n_fits)


def _summed(inputs: tuple, par: torch.Tensor, log_resp: tuple, weights, n_fits: int, k: int) -> torch.Tensor:
    """The sums kernel's rows (F, K, ``n_sums``) over F fits' batches, in the pass's dtype: each pair's
    responsibility exp(log density - star's log-likelihood) (``log_resp``: (F K, n) and (F, n)), times the
    star's weight where ``weights`` (n,) are given; each block's rows summed in float64."""
    import triton

    xt = inputs[0]
    dim, n_all = xt.shape
    n = n_all // n_fits
    grid = (n_fits * k, triton.cdiv(n, BLOCK))
    partial = torch.empty((grid[1], n_fits * k, n_sums(dim)), dtype=xt.dtype, device=xt.device)
    kernels(dim)[1][grid](
        *inputs,
        par,
        *log_resp,
        log_resp[1] if weights is None else weights,  # not read without weights
        partial,
        n,
        n_all,
        k,
        n_fits * k,
        WEIGHTED=weights is not None,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
    return partial.sum(0, dtype=torch.float64).to(xt.dtype).view(n_fits, k, -1)


def _sums(total: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, U, UU, P) from the sums kernel's summed rows (..., K, ``n_sums``)."""
    n_tri = dim * (dim + 1) // 2
    UU, P = (
        symmetric_from_triangle(total[..., part], dim) for part in (slice(dim, dim + n_tri), slice(dim + n_tri, -1))
    )
    return total[..., -1], total[..., :dim], UU, P


def ensemble_statistics(
    x: torch.Tensor, S: torch.Tensor, weights: torch.Tensor, means: torch.Tensor, covariances: torch.Tensor
) -> tuple[Statistics, torch.Tensor]:
    """The statistics of F fits' plain batches at once (R = I; no weights or draws): fit f's batch is rows
    f n to (f + 1) n of ``x`` (F n, D) and ``S`` (F n, D, D), its mixture ``weights[f]`` (K,), ``means[f]``
    (K, D) and ``covariances[f]`` (K, D, D). One launch of each kernel over the fits' (component, star)
    pairs, where F launches of ``triton_chunk`` would each leave most of a GPU idle at a minibatch's size.
    Returns the sums with a leading fit axis (q (F, K), U (F, K, D), UU and P (F, K, D, D), loglik (F,);
    n_points, n, a fit's), and which fits had a pair that did not factorise (F,), left on the device: it
    asks the host nothing, so that a CUDA graph can replay it (``fit.engines.cuda``). Each fit's sums are
    its own pairs' alone, in the order ``triton_chunk`` takes them."""
    n_fits, k, dim = means.shape
    n = x.shape[0] // n_fits
    par = _parameters(weights, means, covariances, x.dtype)
    inputs, dens, failed, loglik = _densities(x, S, par, n_fits, k)
    total = _summed(inputs, par, (dens, loglik), None, n_fits, k)
    stats = Statistics(n, *_sums(total, dim), loglik.sum(1, dtype=torch.float64))
    return stats, failed.view(n_fits, k * n).amax(1) > 0
