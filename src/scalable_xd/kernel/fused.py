"""The CPU statistics pass as fused loops over (point, component) pairs, compiled by numba (R_i = I).

Threads split the points, each with its own sums. For each point, three loops run over the components,
in tiles of TILE: the first factorises T_ij = V_j + S_i, solves z = L^-1 d and keeps z^T z, the pivots,
u = T^-1 d and the lower triangle of T^-1 in a per-point scratch of a few kB; the second turns them
into log alpha_j N_ij, the point's log-likelihood and its responsibilities (with ``vector_math``'s exp
and log, not the C library's); the third adds r_ij times u, u u^T and T^-1 to the thread's sums, in
float64. Every 7 x 7 entry is a scalar local and every array is read with unit stride across the
components of a tile, so that LLVM vectorises all three loops across components;
nothing of size (K, B) is written but the log-densities, and those only where asked for, where the torch
kernels stream ~40 such intermediates through memory. On two cores at D = 7, K = 64 this is 3-4x
torch.compile's code (``benchmarks/bench_fit.py``).

The kernel reads a point's x and S from the batch, or, given ``rows``, from row ``rows[p]`` of the whole
data set in memory or of a streamed window: dense covariances, diagonal variances or compact noise, in any
float dtype, cast as they are read (``row_access``). A shuffled minibatch is then never gathered, and each
row is fetched while the point before it is computed. In float32 each block runs with subnormal floats
flushed to zero (``float_env``): a collapsed component's covariance would otherwise send every pair through
x86's slow path for them.

The source is written out per dimension D, the algebra unrolled entry by entry as in ``unrolled``, and
compiled on first use for each (D, dtype, with_stats), then cached on disk (``compiled_module``). Above D = 7
(``SPLIT_MIN_DIM``) a tile's work runs as four loops over its components, L and z passed through the
scratch (``_split_component_loops``): as one loop, LLVM's vectoriser gave up at D = 12 and ran it on scalars,
at a quarter of the split form's rate (``benchmarks/bench_roofline.py``). The
unrolled source grows as D^3, and numba's compile time with it: 5 s at D = 2, 9 s at 7, 22 s at 12, 83 s
at 20. Above ``UNROLLED_MAX_DIM`` the algebra runs in loops over D instead (the tile's components still
innermost, so still vectorised), which compiles in 6-7 s at any D and runs 1.5-7x slower than unrolled
code would (``benchmarks/bench_compile.py``). numba installs from wheels; where it is missing the
dispatcher falls back to the torch kernel with a message (``dispatch.choose_backend``).
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import subprocess
import sys
import types
from functools import cache
from pathlib import Path

import numpy as np
import torch

from ..data.batching import Batch
from ..errors import NotPositiveDefiniteError
from ..mixture import Mixture
from . import float_env, row_access
from .statistics import LOG_2PI, Criteria, Statistics, criteria_sums, n_points, summed_loglik
from .unrolled_source import factorise_and_solve, import_generated, invert_factor, t_inv_entry, tri, u_entry
from .vector_math import NO_FAST_MATH, helpers_source

# Fast math's contraction and reassociation let LLVM choose where to fuse a multiply into an add and how to
# group a sum. numba optimises a threaded kernel's body a second time when it builds the module it writes to
# its disk cache, and LLVM then chooses otherwise: the threaded kernel compiled in a process rounds some sums
# otherwise (~1e-16 relative) than the one loaded from the cache. The threaded kernel is therefore compiled in a
# process of its own and always run as the cache holds it (``_compile_elsewhere``); it still differs from the
# serial kernel in its last bits.
# Without contraction and reassociation (SCALABLE_XD_NO_FAST_MATH=1) every build rounds each operation as
# written, so one thread and several give the same bits, at 30-55% more time a pair
# (docs/user-guide/reproducibility.md). Not nnan / ninf: the pivot check needs them.
FASTMATH = {"nsz"} if NO_FAST_MATH else {"nsz", "arcp", "contract", "afn", "reassoc"}
TILE = 16  # components per tile: a compile-time stride, so that LLVM proves the tile loops free of aliasing
SUMS_PER_LOOP = 8  # sums updated per loop: with all 63 in one, LLVM's dependence analysis gives up
# (star, component) pairs below which a chunk runs on one thread, where a parallel region's cost and its
# threads' spinning outweigh what a second thread saves (500 stars x K < 60)
PARALLEL_PAIRS = 30_000
# Dimensions up to which the algebra is unrolled entry by entry; above, it runs in loops over D (see above)
UNROLLED_MAX_DIM = 12
# Dimensions above which the unrolled component loop is cut in two (``_split_component_loops``)
SPLIT_MIN_DIM = 7
# Narrower tiles for the looped form's few components (``tile_for``)
NARROW_TILES = (4, 8)


def tile_for(n_components: int, dim: int) -> int:
    """Components per tile for K components in D dimensions: ``TILE``, or for the looped form (D above
    ``UNROLLED_MAX_DIM``) the narrowest of ``NARROW_TILES`` that holds K. The unrolled form's tile loops
    are vectorised, so a lane of padding costs it little (at D = 7, K = 3: 0.63 us a pair in tiles of 16,
    1.2 in tiles of 4); the looped form's cost a lane each, padding or not (at D = 20, K = 3: 22.7 us a
    pair in tiles of 16, 5.3 in tiles of 4: docs/performance.md)."""
    if dim <= UNROLLED_MAX_DIM:
        return TILE
    return next((tile for tile in NARROW_TILES if n_components <= tile), TILE)


def tiled_sizes(n_components: int, dim: int) -> tuple[int, int, int]:
    """(the tile, the length of ``pack``'s parameters, the length of one block's sums) for K components in
    D dimensions: K padded to whole tiles of ``tile_for``'s width."""
    tile, at = tile_for(n_components, dim), layout(dim)
    padded = -(-n_components // tile) * tile
    return tile, padded * at["n_params"], padded * at["n_sums"]


# exp(x) for x below this is < 1e-304 and is taken as 0 (responsibilities exactly 0): vector_math's exp
# builds 2^n as a normal float, which it no longer is below -708
EXP_CUTOFF = -700.0
log = logging.getLogger(__name__)
DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64"}  # a lookup: numpy's str(dtype) is slow
NO_ROWS = np.empty(0, np.int64)  # the kernel's ``rows`` where x and S are the batch itself
# Rows a block of the pass's sums takes at least, up to four blocks a thread of numba's pool: each block
# zeroes and is summed over K x 63 sums, which costs a minibatch step of 500 rows more in eight blocks
BLOCK_ROWS = 100
PIVOTS_PER_LOG = 7  # pivots multiplied in float64 before a log (``_log_det``)


@cache
def layout(dim: int) -> dict[str, int]:
    """Rows, per tile of components, of the parameters (V's lower triangle, the means, log alpha), of the
    scratch (|z|^2, pivot bounds, the pivots, u, T^-1's lower triangle) and of the sums (q, U, UU's and P's
    lower triangles)."""
    n_tri = dim * (dim + 1) // 2
    return {
        "V": 0,
        "means": n_tri,
        "log_weights": n_tri + dim,
        "n_params": n_tri + dim + 1,
        "maha": 0,
        "lo": 1,
        "hi": 2,
        "pivots": 3,
        "u": 3 + dim,
        "t_inv": 3 + 2 * dim,
        "n_scratch": 3 + 2 * dim + n_tri + (n_tri + dim if dim > SPLIT_MIN_DIM else 0),
        "factor": 3 + 2 * dim + n_tri,  # the split form's L (strictly lower) with 1 / L_jj on the diagonal
        "z": 3 + 3 * dim + 2 * n_tri - dim,  # and its z = L^-1 d (``_split_component_loops``)
        "q": 0,
        "U": 1,
        "UU": 1 + dim,
        "P": 1 + dim + n_tri,
        "n_sums": 1 + dim + 2 * n_tri,
    }


def _tile_parameter(row: int) -> str:
    """Row ``row`` of the tile's parameters (per component: V's triangle, the mean, log alpha), lane c."""
    return f"tile_par[{row} * TILE + c]"


def _tile_scratch(row: int) -> str:
    """Row ``row`` of the tile's per-pair scratch (the Mahalanobis term, the pivots' range, the determinant's
    factors, u and T^-1), lane c."""
    return f"tile_scr[{row} * TILE + c]"


def _residual_and_v(dim: int, masked: bool):
    """The residual d = x - m's statements and the reader of V's entry (i, j), for lane c of a tile; ``masked``:
    both times the point's masks ``o{i}_{j}`` (``_masked_point``)."""
    at = layout(dim)
    if not masked:
        residual = [f"d{i} = x{i} - {_tile_parameter(at['means'] + i)}" for i in range(dim)]
        return residual, lambda i, j: _tile_parameter(tri(i, j))
    residual = [f"d{i} = (x{i} - {_tile_parameter(at['means'] + i)}) * o{i}_{i}" for i in range(dim)]
    return residual, lambda i, j: f"{_tile_parameter(tri(i, j))} * o{i}_{j}"


def _component_loop(dim: int, with_stats: bool, real: str, masked: bool) -> list[str]:
    """Statements for component c of a tile for point p, writing only the tile's scratch; ``masked``: the
    point's missing entries decoupled (``_masked_point``), V's entries and d's times the masks ``o{i}_{j}``."""
    at = layout(dim)
    lines, v = _residual_and_v(dim, masked)
    lines += factorise_and_solve(dim, v, lambda i, j: f"s{i}_{j}", "math.sqrt", f"{real}(1.0)")
    pivots = ", ".join(f"p{j}" for j in range(dim))
    lines += [
        f"{_tile_scratch(at['maha'])} = " + " + ".join(f"z{i} * z{i}" for i in range(dim)),
        f"{_tile_scratch(at['lo'])} = " + (f"min({pivots})" if dim > 1 else "p0"),
        f"{_tile_scratch(at['hi'])} = " + (f"max({pivots})" if dim > 1 else "p0"),
    ]
    lines += [f"{_tile_scratch(at['pivots'] + j)} = p{j}" for j in range(dim)]  # det T: see _log_det
    if not with_stats:
        return lines
    lines += invert_factor(dim)
    lines += [f"{_tile_scratch(at['u'] + i)} = {u_entry(dim, i)}" for i in range(dim)]
    mask = (lambda i, j: f" * o{i}_{j}") if masked else (lambda i, j: "")  # a missing diagonal entry is 1: 0 in P
    lines += [
        f"{_tile_scratch(at['t_inv'] + tri(i, j))} = ({t_inv_entry(dim, i, j)}){mask(i, j)}"
        for i in range(dim)
        for j in range(i + 1)
    ]
    return lines


def _split_component_loops(dim: int, with_stats: bool, real: str, masked: bool) -> list[str]:
    """``_component_loop`` for a whole tile as four loops over its components, which pass L (its strictly
    lower part, 1 / L_jj on the diagonal, then W = L^-1 in its place) and z through the scratch: the
    factorisation; z = L^-1 d; W; u and T^-1. LLVM vectorises a loop only while its body stays within its
    limits: as one loop the work at D = 12 runs on scalars, at a tenth of the vectorised rate."""
    at = layout(dim)
    factor = lambda i, j: _tile_scratch(at["factor"] + tri(i, j))  # noqa: E731
    residual, v = _residual_and_v(dim, masked)
    whole = factorise_and_solve(dim, v, lambda i, j: f"s{i}_{j}", "math.sqrt", f"{real}(1.0)")
    factorise, solve = whole[:-dim], whole[-dim:]
    pivots = ", ".join(f"p{j}" for j in range(dim))
    factorise += [
        f"{_tile_scratch(at['lo'])} = " + (f"min({pivots})" if dim > 1 else "p0"),
        f"{_tile_scratch(at['hi'])} = " + (f"max({pivots})" if dim > 1 else "p0"),
        *(f"{_tile_scratch(at['pivots'] + j)} = p{j}" for j in range(dim)),
        *(f"{factor(i, j)} = l{i}_{j}" for i in range(dim) for j in range(i)),
        *(f"{factor(j, j)} = w{j}_{j}" for j in range(dim)),
    ]
    read_l = [f"l{i}_{j} = {factor(i, j)}" for i in range(dim) for j in range(i)]
    read_w = [f"w{j}_{j} = {factor(j, j)}" for j in range(dim)]
    solve = residual + read_l + read_w + solve
    solve += [f"{_tile_scratch(at['maha'])} = " + " + ".join(f"z{i} * z{i}" for i in range(dim))]
    loops = [factorise, solve]
    if with_stats:
        solve += [f"{_tile_scratch(at['z'] + i)} = z{i}" for i in range(dim)]
        inverse = read_l + read_w + invert_factor(dim)
        inverse += [f"{factor(i, j)} = w{i}_{j}" for i in range(dim) for j in range(i)]
        read_all_w = [f"w{i}_{j} = {factor(i, j)}" for i in range(dim) for j in range(i + 1)]
        mask = (lambda i, j: f" * o{i}_{j}") if masked else (lambda i, j: "")
        products = read_all_w + [f"z{i} = {_tile_scratch(at['z'] + i)}" for i in range(dim)]
        products += [f"{_tile_scratch(at['u'] + i)} = {u_entry(dim, i)}" for i in range(dim)]
        products += [
            f"{_tile_scratch(at['t_inv'] + tri(i, j))} = ({t_inv_entry(dim, i, j)}){mask(i, j)}"
            for i in range(dim)
            for j in range(i + 1)
        ]
        loops += [inverse, products]
    return [line for body in loops for line in ["for c in range(TILE):", *_indent(body)]]


def _looped_residual_and_entry(real: str, means_row: int, masked: bool) -> list[str]:
    """The looped kernel's residual rows ``dv`` and, in its factorisation's loop over (j, i >= j), entry
    (i, j) of T = V + S into ``av`` (``masked``: the missing entries decoupled, as ``_masked_point``)."""
    if not masked:
        return [
            "for i in range(D):",
            f"    xi = {real}(x[r, i])",
            "    for c in range(TILE):",
            f"        dv[i, c] = xi - par2[{means_row} + i, c]",
            "for j in range(D):",
            "    for i in range(j, D):",
            f"        sij, vij = noise_entry(S, r, i, j, {real}), i * (i + 1) // 2 + j",
            "        for c in range(TILE):",
            "            av[c] = par2[vij, c] + sij",
        ]
    return [
        "for i in range(D):",
        f"    xi, oi = ({real}(x[r, i]), {real}(1.0)) if observed[r, i] else ({real}(0.0), {real}(0.0))",
        "    for c in range(TILE):",
        f"        dv[i, c] = (xi - par2[{means_row} + i, c]) * oi",
        "for j in range(D):",
        "    for i in range(j, D):",
        "        seen, vij = observed[r, i] and observed[r, j], i * (i + 1) // 2 + j",
        f"        sij = noise_entry(S, r, i, j, {real}) if seen else {real}(1.0 if i == j else 0.0)",
        f"        oij = {real}(1.0) if seen else {real}(0.0)",
        "        for c in range(TILE):",
        "            av[c] = par2[vij, c] * oij + sij",
    ]


def _component_loop_looped(dim: int, with_stats: bool, real: str, masked: bool) -> list[str]:
    """``_component_loop`` for large D, for a whole tile: the same scratch rows, computed in loops over the
    dimensions with the tile's components innermost, so that LLVM still vectorises across them while the
    source, and numba's compile time, no longer grow with D. The tile's parameters and scratch are read as
    (rows, TILE) arrays (``par2``, ``scr2``); work rows: L and W = L^-1 row-major in ``lf`` and ``wf``, the
    residual ``dv``, z ``zv``, the pivots ``pv``, one row of TILE entries each; ``masked``: as
    ``_component_loop``'s, the masks read from ``observed`` as the loops go."""
    at = layout(dim)
    lines = [
        f"par2, scr2 = tile_par.reshape({at['n_params']}, TILE), tile_scr.reshape({at['n_scratch']}, TILE)",
        *_looped_residual_and_entry(real, at["means"], masked),
        "        for m in range(j):",
        "            for c in range(TILE):",
        "                av[c] -= lf[i * D + m, c] * lf[j * D + m, c]",
        "        if i == j:",
        "            for c in range(TILE):",
        "                pv[j, c] = av[c]",
        "                lf[j * D + j, c] = math.sqrt(av[c])",
        f"                wf[j * D + j, c] = {real}(1.0) / lf[j * D + j, c]",
        "        else:",
        "            for c in range(TILE):",
        "                lf[i * D + j, c] = av[c] * wf[j * D + j, c]",
        "for c in range(TILE):",
        f"    scr2[{at['maha']}, c], scr2[{at['lo']}, c], scr2[{at['hi']}, c] = 0.0, math.inf, -math.inf",
        "for i in range(D):",
        "    for c in range(TILE):",
        "        av[c] = dv[i, c]",
        "    for m in range(i):",
        "        for c in range(TILE):",
        "            av[c] -= lf[i * D + m, c] * zv[m, c]",
        "    for c in range(TILE):",
        "        zv[i, c] = av[c] * wf[i * D + i, c]",
        f"        scr2[{at['maha']}, c] += zv[i, c] * zv[i, c]",
        # -1 where a pivot is not positive (NaN included), so that the density loop's check fails
        f"        scr2[{at['lo']}, c] = min(scr2[{at['lo']}, c], pv[i, c]) if pv[i, c] > 0 else -1.0",
        f"        scr2[{at['hi']}, c] = max(scr2[{at['hi']}, c], pv[i, c])",
        "for i in range(D):",
        "    for c in range(TILE):",
        f"        scr2[{at['pivots']} + i, c] = pv[i, c]",
    ]
    if not with_stats:
        return lines
    return lines + [
        "for i in range(D):",  # W's off-diagonal entries, as invert_factor
        "    for j in range(i):",
        "        for c in range(TILE):",
        "            av[c] = 0.0",
        "        for m in range(j, i):",
        "            for c in range(TILE):",
        "                av[c] += lf[i * D + m, c] * wf[m * D + j, c]",
        "        for c in range(TILE):",
        "            wf[i * D + j, c] = -av[c] * wf[i * D + i, c]",
        "for i in range(D):",  # u = W^T z and T^-1 = W^T W, as u_entry and t_inv_entry
        "    for c in range(TILE):",
        "        av[c] = 0.0",
        "    for m in range(i, D):",
        "        for c in range(TILE):",
        "            av[c] += wf[m * D + i, c] * zv[m, c]",
        "    for c in range(TILE):",
        f"        scr2[{at['u']} + i, c] = av[c]",
        "    for j in range(i + 1):",
        "        for c in range(TILE):",
        "            av[c] = 0.0",
        "        for m in range(i, D):",
        "            for c in range(TILE):",
        "                av[c] += wf[m * D + i, c] * wf[m * D + j, c]",
        *([f"        oij = {real}(1.0) if observed[r, i] and observed[r, j] else {real}(0.0)"] if masked else []),
        "        for c in range(TILE):",
        f"            scr2[{at['t_inv']} + i * (i + 1) // 2 + j, c] = av[c]" + (" * oij" if masked else ""),
    ]


def _accumulate_looped(dim: int) -> list[str]:
    """``_accumulate_loops`` for large D: loops over the dimensions, the tile's components innermost."""
    at = layout(dim)
    return [
        f"scr2, acc2 = tile_scr.reshape({at['n_scratch']}, TILE), tile_acc.reshape({at['n_sums']}, TILE)",
        "for c in range(TILE):",
        f"    acc2[{at['q']}, c] += tile_resp[c]",
        "for i in range(D):",
        "    for c in range(TILE):",
        f"        acc2[{at['U']} + i, c] += tile_resp[c] * scr2[{at['u']} + i, c]",
        "    for j in range(i + 1):",
        "        for c in range(TILE):",
        f"            acc2[{at['UU']} + i * (i + 1) // 2 + j, c] += "
        f"tile_resp[c] * scr2[{at['u']} + i, c] * scr2[{at['u']} + j, c]",
        f"for e in range({dim * (dim + 1) // 2}):",
        "    for c in range(TILE):",
        f"        acc2[{at['P']} + e, c] += tile_resp[c] * scr2[{at['t_inv']} + e, c]",
    ]


def _loop_work(dim: int) -> list[str]:
    """The looped kernel's per-block work rows (``_component_loop_looped``), in the block's prologue."""
    rows = {"lf": dim * dim, "wf": dim * dim, "dv": dim, "zv": dim, "pv": dim}
    work = [f"        {name} = np.empty(({n}, TILE), par.dtype)" for name, n in rows.items()]
    return [f"        D = {dim}", *work, "        av = np.empty(TILE, par.dtype)"]


def _density_loop(dim: int, real: str) -> list[str]:
    """Statements for component c of a tile: log alpha_k N_pk into ``dens[k]``, and a count of the failed
    factorisations into ``n_failed``."""
    at = layout(dim)
    return [
        "k = t * TILE + c",
        f"dens[k] = {_tile_parameter(at['log_weights'])} - {real}(0.5) * ({real}({_log_det(dim)})"
        f" + {_tile_scratch(at['maha'])} + norm)",
        f"n_failed += 0 if k >= n_comp or ({_tile_scratch(at['lo'])} > 0"
        f" and {_tile_scratch(at['hi'])} < math.inf) else 1",
    ]


def _log_det(dim: int) -> str:
    """log det T in float64, from the tile's pivots: multiplied in float64, ``PIVOTS_PER_LOG`` at a time,
    and the logs of those products summed. In float32 a product of two pivots underflows at variances below
    ~1e-19 (data on scales below 3e-10, where Gaia's parallaxes in radians lie) and one of all seven
    overflows at 1e12; float32 pivots lie in 1e-38 to 3e38, and seven of them multiply within float64's
    range."""
    at = layout(dim)
    logs = []
    for first in range(0, dim, PIVOTS_PER_LOG):
        pivots = range(first, min(first + PIVOTS_PER_LOG, dim))
        product = " * ".join(f"np.float64({_tile_scratch(at['pivots'] + j)})" for j in pivots)
        logs.append(f"log_lane({product}, bits, bits_f, k)")
    return " + ".join(logs)


def _first_failure(dim: int) -> list[str]:
    """Statements setting ``failed[p]`` to the first component whose factorisation failed, if any did."""
    at = layout(dim)
    scratch = lambda row: f"scr[k // TILE * {at['n_scratch']} * TILE + {row} * TILE + k % TILE]"  # noqa: E731
    return [
        "failed[p] = -1",
        "if n_failed:",
        "    for k in range(n_comp):",
        f"        if not ({scratch(at['lo'])} > 0 and {scratch(at['hi'])} < math.inf):",
        "            failed[p] = k",
        "            break",
    ]


def _accumulate_loops(dim: int) -> list[str]:
    """Loops over component c of a tile adding r times u, u u^T and T^-1 to the thread's sums, a few sums
    per loop (``SUMS_PER_LOOP``)."""
    at = layout(dim)
    sums = lambda row: f"tile_acc[{row} * TILE + c]"  # noqa: E731
    u = lambda i: _tile_scratch(at["u"] + i)  # noqa: E731
    updates = [(at["q"], "r")] + [(at["U"] + i, f"r * {u(i)}") for i in range(dim)]
    updates += [(at["UU"] + tri(i, j), f"r * {u(i)} * {u(j)}") for i in range(dim) for j in range(i + 1)]
    updates += [(at["P"] + t, f"r * {_tile_scratch(at['t_inv'] + t)}") for t in range(dim * (dim + 1) // 2)]
    lines = []
    for first in range(0, len(updates), SUMS_PER_LOOP):
        lines += ["for c in range(TILE):", "    r = tile_resp[c]"]
        lines += [f"    {sums(row)} += {expr}" for row, expr in updates[first : first + SUMS_PER_LOOP]]
    return lines


def _source(dim: int, with_stats: bool, real: str, masked: bool = False) -> str:
    """The kernel's Python source for dimension ``dim`` and scalar type ``real``: arrays are flat, and
    every index is a tile's base plus a literal offset, so that the strides are compile-time constants.
    ``masked``: the kernel takes each point's observed entries, ``observed`` (n, D), after ``rows``."""
    at = layout(dim)
    looped = dim > UNROLLED_MAX_DIM
    # float32 only: float64 meets subnormals only below 2.2e-308 (a responsibility near exp(-700) times a
    # small number), too rarely to cost time, and its results stay as they were
    flush = real == "np.float32"
    fit_par = f"n_tiles * {at['n_params']} * TILE"  # one fit's parameters in ``par``
    head = [
        f"def kernel(x, S, rows, {'observed, ' if masked else ''}par, point_weights, uniforms, out_loglik, out_dens, "
        "failed, acc, n_blocks, n_fits):",
        "    in_place = rows.shape[0] > 0",
        "    n = rows.shape[0] if in_place else x.shape[0]",
        "    n_fit, fit_blocks = n // n_fits, n_blocks // n_fits  # each fit's points and blocks, fit after fit",
        f"    n_comp, n_tiles = out_dens.shape[1], par.shape[0] // ({at['n_params']} * TILE * n_fits)",
        "    for blk in prange(n_blocks):",
        "        s, b = blk // fit_blocks, blk % fit_blocks  # the block's fit, and its block among the fit's",
        f"        fit_par = par[s * {fit_par}:(s + 1) * {fit_par}]",
        *(
            [f"        acc[blk * n_tiles * {at['n_sums']} * TILE:(blk + 1) * n_tiles * {at['n_sums']} * TILE] = 0.0"]
            if with_stats
            else []
        ),
        f"        scr = np.empty(n_tiles * {at['n_scratch']} * TILE, par.dtype)",
        "        dens = np.empty(n_tiles * TILE, par.dtype)",
        "        bits = np.empty(n_tiles * TILE, np.int64)  # one lane each for exp_lane and log_lane",
        "        bits_f = bits.view(np.float64)",
        *(["        resp = np.empty(n_tiles * TILE, np.float64)"] if with_stats else []),
        *(_loop_work(dim) if looped else []),
        *(["        env = flush_subnormals()  # restored at the block's end (float_env)"] if flush else []),
        "        for p in range(s * n_fit + b * n_fit // fit_blocks, s * n_fit + (b + 1) * n_fit // fit_blocks):",
    ]
    point = _point_source(dim, with_stats, real, _tiles(at), masked)
    return "\n".join(head + _indent(point, 3) + (["        restore_float_env(env)"] if flush else [])) + "\n"


def _indent(lines: list[str], n: int = 1) -> list[str]:
    return ["    " * n + line for line in lines]


def _tiles(at: dict[str, int]):
    """``tiles(body, names, loop=True)``: ``body`` for every tile, with the tile's views of the arrays
    ``names`` (inside a loop over the tile's components c where ``loop``)."""

    def span(rows: int, first: str = "t") -> str:
        return f"{first} * {rows} * TILE:({first} + 1) * {rows} * TILE"

    # Each tile's arrays are views, indexed from 0 by literal offsets: with a computed base, numba's
    # negative-index wraparound turns every access into a select, and nothing vectorises.
    views = {
        "par": f"tile_par = fit_par[{span(at['n_params'])}]",
        "scr": f"tile_scr = scr[{span(at['n_scratch'])}]",
        "acc": f"tile_acc = acc[{span(at['n_sums'], '(blk * n_tiles + t)')}]",
        "resp": f"tile_resp = resp[{span(1)}]",
    }

    def tiles(body: list[str], names: list[str], loop: bool = True) -> list[str]:
        inner = ["for c in range(TILE):", *_indent(body)] if loop else body
        return ["for t in range(n_tiles):", *_indent([views[v] for v in names] + inner)]

    return tiles


def _masked_point(dim: int, real: str, looped: bool) -> list[str]:
    """Point p's missing entries (``observed[r, i]`` 0) marginalised in the full dimension: with its missing
    rows and columns of T = V_j + S_i replaced by the identity's and its residual's missing entries by 0, T is
    T_oo (+) I, whose factor, log det, z^T z and u = T^-1 d are T_oo's (u 0 off the observed entries), and
    whose inverse is T_oo^-1 (+) I, the identity's part masked out of P. Only the normalising constant
    counts the observed entries: ``norm`` = n_obs log 2 pi. A point with nothing observed has density alpha_j:
    p(x) = 1, responsibilities alpha_j. The unrolled form reads the masks here, ``o{i}_{j}`` = 1 where entries
    i and j are both observed, else 0, and the observed entries of x and S; the looped form as it goes."""
    count = " + ".join(f"({real}(1.0) if observed[r, {i}] else {real}(0.0))" for i in range(dim))
    lines = [f"norm = {real}({LOG_2PI!r}) * ({count})"]
    if looped:
        return lines
    for i in range(dim):
        lines += [
            f"o{i}_{i} = {real}(1.0) if observed[r, {i}] else {real}(0.0)",
            f"x{i} = {real}(x[r, {i}]) if observed[r, {i}] else {real}(0.0)",
        ]
    for i in range(dim):
        for j in range(i + 1):
            both = f"observed[r, {i}] and observed[r, {j}]"
            lines += [f"s{i}_{j} = noise_entry(S, r, {i}, {j}, {real}) if {both} else {real}({float(i == j)})"]
            if j < i:
                lines += [f"o{i}_{j} = o{i}_{i} * o{j}_{j}"]
    return lines


def _point_source(dim: int, with_stats: bool, real: str, tiles, masked: bool) -> list[str]:
    """The kernel's work on point p: its densities under every component, its log-likelihood and, with
    ``with_stats``, its responsibilities added into the block's sums (``masked``: see ``_masked_point``)."""
    looped = dim > UNROLLED_MAX_DIM
    # the point's row: its own, or row rows[p] of the data in place, the next point's row asked for ahead
    point = [
        "r = rows[p] if in_place else p",
        "if in_place and p + 1 < n:",
        "    prefetch_row(x, rows[p + 1])",
        "    prefetch_row(S, rows[p + 1])",
    ]
    if masked:
        point += _masked_point(dim, real, looped)
    else:
        point += [f"norm = {real}({dim * LOG_2PI!r})"]
    if looped:
        point += tiles(_component_loop_looped(dim, with_stats, real, masked), ["par", "scr"], loop=False)
    else:
        if not masked:  # a masked point's x and S are read in _masked_point
            point += [f"x{i} = {real}(x[r, {i}])" for i in range(dim)]
            point += [f"s{i}_{j} = noise_entry(S, r, {i}, {j}, {real})" for i in range(dim) for j in range(i + 1)]
        if dim > SPLIT_MIN_DIM:
            point += tiles(_split_component_loops(dim, with_stats, real, masked), ["par", "scr"], loop=False)
        else:
            point += tiles(_component_loop(dim, with_stats, real, masked), ["par", "scr"])
    point += ["n_failed = 0", *tiles(_density_loop(dim, real), ["par", "scr"]), *_first_failure(dim)]
    # the point's log-likelihood, log sum_k exp(dens_k - top) + top; exp(dens_k - top) / the sum are its
    # responsibilities (the padding's dens is -inf: 0)
    point += [
        "top = -math.inf",
        "for k in range(n_comp):",
        "    top = max(top, dens[k])",
        "total = 0.0",
        "for k in range(n_tiles * TILE):",
        "    share = exp_lane(dens[k] - top, bits, bits_f, k)",
        *(["    resp[k] = share"] if with_stats else []),
        "    total += share",
        "loglik = top + math.log(total)",
        "out_loglik[p] = loglik",
        "if out_dens.shape[0]:  # asked for",
        "    out_dens[p] = dens[:n_comp]",
    ]
    if not with_stats:
        return point
    return point + [
        "scale = 1.0 / total if total > 0.0 else 0.0",
        "for k in range(n_tiles * TILE):",
        "    resp[k] *= scale",
        "if uniforms.shape[0]:  # a sampled one-hot assignment, drawn as statistics.assign draws it",
        "    target, cdf, chosen = uniforms[p] * resp[:n_comp].sum(), 0.0, 0",
        "    for k in range(n_comp):",
        "        cdf += resp[k]",
        "        chosen += cdf < target",
        "    resp[:] = 0.0",
        "    resp[min(chosen, n_comp - 1)] = 1.0",
        "if point_weights.shape[0]:",
        "    resp *= point_weights[p]",
        *tiles(_accumulate_looped(dim) if looped else _accumulate_loops(dim), ["scr", "acc", "resp"], loop=False),
    ]


def _pack_source(dim: int, dtype: str) -> list[str]:
    """``pack(weights, means, covariances, par)``: the mixture written into ``par`` as the kernel reads it
    (``pack_fits``: several fits' mixtures, stacked on a leading axis, one after another),
    per tile of TILE components the rows of ``layout``, flat. Components that pad K to whole tiles have
    V = I, m = 0 and log alpha = -inf, so responsibility 0. The parameters may come in float64 for a float32
    kernel: each is rounded to ``dtype`` first, as ``Mixture.to`` would (log alpha too), so the packed
    numbers are the same either way. (Compiled, as the kernel: it runs once a batch, where numpy's dozen
    calls cost a tenth of a step at K = 64. Loops over D, so that its source does not grow with D.)"""
    at = layout(dim)
    row = lambda name, offset="": f"par[t * {at['n_params']} * TILE + ({at[name]}{offset}) * TILE + c]"  # noqa: E731
    return [
        "@njit(error_model='numpy', cache=True)",
        "def pack(weights, means, covariances, par):",
        f"    for t in range(par.shape[0] // ({at['n_params']} * TILE)):",
        "        for c in range(TILE):",
        "            k = t * TILE + c",
        "            real = k < means.shape[0]",
        f"            for i in range({dim}):",
        "                for j in range(i + 1):",
        f"                    {row('V', ' + i * (i + 1) // 2 + j')} = "
        "covariances[k, i, j] if real else (1.0 if i == j else 0.0)",
        f"                {row('means', ' + i')} = means[k, i] if real else 0.0",
        f"            {row('log_weights')} = math.log(np.{dtype}(weights[k])) if real else -math.inf",
        "",
        "",
        "@njit(error_model='numpy', cache=True)",
        "def pack_fits(weights, means, covariances, par):",
        "    length = par.shape[0] // weights.shape[0]",
        "    for s in range(weights.shape[0]):",
        "        pack(weights[s], means[s], covariances[s], par[s * length:(s + 1) * length])",
    ]


def _unpack_source(dim: int, dtype: str) -> list[str]:
    """``unpack(acc, n_blocks, n_comp)``: (q (K,), U (K, D), UU (K, D, D), P (K, D, D)) in ``dtype``, as the
    other backends return them, from the blocks' tiled float64 sums, summed over the blocks in order, in
    memory order, on one thread (memory-bound: a second parallel region a step gained nothing at K = 512,
    and waits for a descheduled thread on a shared machine). ``unpack_into`` writes the sums of blocks
    ``first`` to ``first + n_blocks - 1`` (one fit's, of several fitted together) into given arrays."""
    at = layout(dim)
    return [
        "@njit(error_model='numpy', cache=True)",
        "def unpack_into(acc, first, n_blocks, q, U, UU, P):",
        f"    D, n_comp = {dim}, q.shape[0]",
        f"    sums = np.zeros((n_comp + TILE - 1) // TILE * {at['n_sums']} * TILE)",
        "    for b in range(first, first + n_blocks):",
        "        for e in range(sums.shape[0]):",
        "            sums[e] += acc[b * sums.shape[0] + e]",
        "    for k in range(n_comp):",
        f"        tile = sums[k // TILE * {at['n_sums']} * TILE + k % TILE :]",
        f"        q[k] = tile[{at['q']} * TILE]",
        "        for i in range(D):",
        f"            U[k, i] = tile[({at['U']} + i) * TILE]",
        "            for j in range(i + 1):",
        f"                UU[k, i, j] = UU[k, j, i] = tile[({at['UU']} + i * (i + 1) // 2 + j) * TILE]",
        f"                P[k, i, j] = P[k, j, i] = tile[({at['P']} + i * (i + 1) // 2 + j) * TILE]",
        "",
        "",
        "@njit(error_model='numpy', cache=True)",
        "def unpack(acc, n_blocks, n_comp):",
        f"    D = {dim}",
        f"    q, U = np.empty(n_comp, np.{dtype}), np.empty((n_comp, D), np.{dtype})",
        f"    UU, P = np.empty((n_comp, D, D), np.{dtype}), np.empty((n_comp, D, D), np.{dtype})",
        "    unpack_into(acc, 0, n_blocks, q, U, UU, P)",
        "    return q, U, UU, P",
    ]


def _unpack_checked_source(dim: int, dtype: str) -> list[str]:
    """``unpack_checked(failed, acc, n_blocks, n_comp)``: the first point whose pair failed to factorise (-1
    for none) and ``unpack``'s sums, in one call as ``PlainPass`` takes a minibatch step's statistics (numpy's
    max and a second call from Python cost a step more); ``unpack_fits(failed, acc, n_blocks, n_fits,
    n_comp)``: the same for each of ``n_fits`` fits passed together (``EnsemblePass``), as arrays with a
    leading fit axis, each fit's sums its own blocks' as ``unpack`` sums them. The kernel is not called from
    here: compiled into a caller, LLVM may reorder its fast-math sums differently for each kind of input."""
    return [
        "@njit(error_model='numpy', cache=True)",
        "def first_failure(failed, first, last):",
        "    for p in range(first, last):",
        "        if failed[p] >= 0:",
        "            return p - first",
        "    return -1",
        "",
        "",
        "@njit(error_model='numpy', cache=True)",
        "def unpack_checked(failed, acc, n_blocks, n_comp):",
        "    q, U, UU, P = unpack(acc, n_blocks, n_comp)",
        "    return first_failure(failed, 0, failed.shape[0]), q, U, UU, P",
        "",
        "",
        "@njit(error_model='numpy', cache=True)",
        "def unpack_fits(failed, acc, n_blocks, n_fits, n_comp):",
        f"    D, fit_blocks, n_fit = {dim}, n_blocks // n_fits, failed.shape[0] // n_fits",
        f"    q, U = np.empty((n_fits, n_comp), np.{dtype}), np.empty((n_fits, n_comp, D), np.{dtype})",
        f"    UU, P = np.empty((n_fits, n_comp, D, D), np.{dtype}), np.empty((n_fits, n_comp, D, D), np.{dtype})",
        "    first = np.empty(n_fits, np.int64)",
        "    for s in range(n_fits):",
        "        first[s] = first_failure(failed, s * n_fit, (s + 1) * n_fit)",
        "        unpack_into(acc, s * fit_blocks, fit_blocks, q[s], U[s], UU[s], P[s])",
        "    return first, q, U, UU, P",
    ]


def _module_source(
    dim: int, with_stats: bool, dtype: str, parallel: bool, masked: bool = False, tile: int = TILE
) -> str:
    """A module defining the kernel, ``pack`` and (with the statistics) ``unpack`` and ``unpack_checked``,
    compiled with numba's on-disk cache (``parallel``: the kernel's blocks spread over numba's threads;
    otherwise run one after another on the calling thread), in tiles of ``tile`` components."""
    header = [
        f"# The fused statistics pass for D = {dim}, {dtype}, written by scalable_xd.kernel.fused.",
        f"# Reads rows through scalable_xd.kernel.row_access, sets floats through float_env: {_helpers_digest()}.",
        "import math",
        "",
        "import numpy as np",
        "from numba import njit, prange",
        "",
        "from scalable_xd.kernel.float_env import flush_subnormals, restore_float_env",
        "from scalable_xd.kernel.row_access import noise_entry, prefetch_row",
        "",
        f"TILE = {tile}",
        "",
        "",
        helpers_source(EXP_CUTOFF),
        "",
        *_pack_source(dim, dtype),
        "",
        "",
        *(_unpack_source(dim, dtype) + ["", ""] if with_stats else []),
        # the serial kernel releases the GIL: ``EnsemblePass`` runs it on several fits' batches at once
        f"@njit(parallel={parallel}, nogil={not parallel}, fastmath={{"
        + ", ".join(map(repr, sorted(FASTMATH)))
        + "}, error_model='numpy', cache=True)",
    ]
    plain = ["", "", *_unpack_checked_source(dim, dtype)] if with_stats else []
    return "\n".join(header) + "\n" + _source(dim, with_stats, f"np.{dtype}", masked) + "\n".join(plain) + "\n"


@cache
def _helpers_digest() -> str:
    """A digest of ``row_access``'s and ``float_env``'s sources, written into each kernel's source: numba's
    cache keys a kernel by its own file alone, so a change there must change the file."""
    sources = b"".join(Path(str(helper.__file__)).read_bytes() for helper in (row_access, float_env))
    return hashlib.sha1(sources).hexdigest()[:12]


@cache
def compiled_module(
    dim: int, with_stats: bool, dtype: str, parallel: bool = True, masked: bool = False, tile: int = TILE
):
    """The numba-compiled module (``kernel``, ``pack``, ``unpack``, ``unpack_checked``) for dimension ``dim``
    and float dtype ``dtype`` ("float32" or "float64"), its kernel multi-threaded or serial
    (``_module_source``); ``masked``: its kernel takes each point's observed entries (``_masked_point``);
    ``tile``: components per tile (``tile_for``).

    Its source is written once into the kernel cache folder under a name holding its digest, so that numba's
    cache finds the compiled code in the next process (a workflow runs each fit in its own); where the
    folder cannot be written it is compiled in memory, a few seconds per process."""
    source = _module_source(dim, with_stats, dtype, parallel, masked, tile)
    kind = ("stats" if with_stats else "densities") + ("_masked" if masked else "") + ("" if parallel else "_serial")
    kind += "" if tile == TILE else f"_tile{tile}"
    stem = f"fused_d{dim}_{dtype}_{kind}"
    try:
        module = import_generated(stem, source)
    except OSError:
        module = types.ModuleType(stem)
        exec(compile(source.replace("cache=True", "cache=False"), stem, "exec"), module.__dict__)
        return module
    if parallel:  # the serial kernel is the same code compiled or loaded
        _compile_elsewhere(module)
    return module


# Run by ``_compile_elsewhere`` in a new process: compile the kernel of the generated module (name, path) for
# the argument types pickled on stdin, which numba writes to its disk cache.
_COMPILE_CHILD = """
import importlib.util, pickle, sys
name, path = sys.argv[1:]
spec = importlib.util.spec_from_file_location(name, path)
module = importlib.util.module_from_spec(spec)
sys.modules[name] = module
spec.loader.exec_module(module)
module.kernel.compile(tuple(pickle.load(sys.stdin.buffer)))
"""


def _compile_elsewhere(module) -> None:
    """Make the module's threaded kernel compile for new argument types in a new process, then load that
    code from numba's disk cache, so that this process runs the code every later process loads (see
    ``FASTMATH``: compiled in the process, numba's code for the kernel's threads is not the code it writes
    to the cache). Where that process fails, the kernel is compiled here, as numba would, with a message."""
    kernel, compile_here = module.kernel, module.kernel.compile

    def compile(sig):
        from numba.core import sigutils

        args, _ = sigutils.normalize_signature(sig)
        if tuple(args) not in kernel.overloads and kernel._cache.load_overload(sig, kernel.targetctx) is None:
            child = subprocess.run(
                [sys.executable, "-c", _COMPILE_CHILD, module.__name__, module.__file__],
                input=pickle.dumps(tuple(args)),
                capture_output=True,
            )
            if child.returncode:
                log.warning(
                    "the threaded kernel %s could not be compiled in a new process, so it is compiled here; "
                    "this process's sums may then differ from a later one's in their last bits:\n%s",
                    module.__name__,
                    child.stderr.decode(errors="replace")[-2000:],
                )
        return compile_here(sig)

    kernel.compile = compile


def fused_chunk(
    x,
    S,
    mixture: Mixture,
    R,
    with_stats: bool,
    row_offset: int,
    point_weights=None,
    uniforms=None,
    with_criteria: bool = False,
    observed=None,
):
    """(log p(x_i) (B,), log alpha_j N_ij (B, K), Statistics or None) for one chunk on the CPU, R = I (``R``
    is None); the statistics pass returns no log alpha_j N_ij (None) unless the criteria need them.
    ``observed`` (B, D) bool: each point's other entries marginalised (``_masked_point``), U, UU and P in
    the model's dimensions."""
    import numba

    n, dim = x.shape
    k = mixture.n_components
    pool = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # numba's config is filled at import
    parallel = _threads_for(n * k, pool)
    tile, n_params, block_sums = tiled_sizes(k, dim)
    x_np, S_np = _array(x), _array(S)
    empty = np.empty(0, x_np.dtype)
    n_blocks = blocks_for(n, pool)
    per_pair = with_criteria or not with_stats  # the densities: the scoring pass's result, the criteria's input
    loglik_np, log_dens_np = np.empty(n, x_np.dtype), np.empty((n if per_pair else 0, k), x_np.dtype)
    failed = np.empty(n, np.int64)
    acc = np.empty(n_blocks * block_sums if with_stats else 0)  # each block zeroes its own
    module = compiled_module(dim, with_stats, DTYPE_NAMES[x.dtype], parallel, observed is not None, tile)
    par = np.empty(n_params, x_np.dtype)
    module.pack(*mixture.arrays(), par)
    point_weights_np = empty if point_weights is None else _array(point_weights.to(x.dtype))
    uniforms_np = empty if uniforms is None else _array(uniforms.to(x.dtype))
    masks = () if observed is None else (_array(observed),)
    outputs = (loglik_np, log_dens_np, failed, acc)
    module.kernel(x_np, S_np, NO_ROWS, *masks, par, point_weights_np, uniforms_np, *outputs, n_blocks, 1)
    if n and failed.max() >= 0:  # the component of the pair that failed, -1 for none
        row = int(np.flatnonzero(failed >= 0)[0])
        raise NotPositiveDefiniteError(row_offset + row, int(failed[row]))
    loglik, log_dens = torch.from_numpy(loglik_np), torch.from_numpy(log_dens_np) if per_pair else None
    if not with_stats:
        return loglik, log_dens, None
    sums = _unpacked(module, acc, n_blocks, k)
    criteria = None
    if with_criteria:
        criteria = Criteria(*criteria_sums(log_dens, loglik, mixture.log_weights.to(x.dtype), point_weights, dim=1))
    stats = Statistics(n_points(x, point_weights), *sums, summed_loglik(loglik, point_weights), criteria)
    return loglik, log_dens, stats


class PlainPass:
    """The statistics pass over plain batches (R = I; no weights, draws or criteria; one chunk) of one fit
    on the CPU, as ``fused_chunk`` computes it, with its module, thread count and buffers settled once,
    where ``dispatch`` and ``fused_chunk`` settle them at every call (a seventh of a minibatch step's pass at
    K = 64: docs/performance.md). A batch with missing entries takes the masked kernel (``_masked_point``).
    A batch whose rows lie in memory (``Batch.in_memory``) is read in place (``row_access``), never
    gathered. Its buffers are reused from call to call: one fit loop calls it, from one thread."""

    def __init__(self, dim: int, n_components: int, dtype: torch.dtype, max_pairs: int):
        import numba

        self.pool = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # filled at import
        self.dim, self.k, self.dtype, self.max_pairs = dim, n_components, dtype, max_pairs
        self.tile, n_params, self.block_sums = tiled_sizes(n_components, dim)  # block_sums: a block's in ``acc``
        real = DTYPE_NAMES[dtype]
        self.par = np.empty(n_params, real)
        self.acc = np.empty(4 * self.pool * self.block_sums)  # room for the most blocks (``blocks_for``)
        self._modules: dict[tuple[int, int, bool], tuple] = {}  # by (torch's threads, points, masked): _module
        self._empty = np.empty(0, real), np.empty((0, n_components), real)  # no weights, draws or densities

    def _module(self, n: int, masked: bool):
        """The compiled module for a batch of n points, threaded or not (``_threads_for``), masked or not,
        and the batch's buffers (each point's log-likelihood and failed pair, and its blocks' sums:
        ``blocks_for``), settled once for each thread count and batch size (a batch size recurs at every
        step): numba's thread count is set only to torch's, so it holds while torch's does."""
        key = (torch.get_num_threads(), n, masked)
        settled = self._modules.get(key)
        if settled is None:
            parallel = _threads_for(n * self.k, self.pool)
            module = compiled_module(self.dim, True, DTYPE_NAMES[self.dtype], parallel, masked, self.tile)
            n_blocks = blocks_for(n, self.pool)
            acc = self.acc[: n_blocks * self.block_sums]
            settled = self._modules[key] = (module, (np.empty(n, self.par.dtype), np.empty(n, np.int64), acc, n_blocks))
        return settled

    def statistics(self, batch: Batch, mixture: Mixture, with_loglik: bool = True) -> Statistics | None:
        """The batch's Statistics (without its summed log-likelihood unless ``with_loglik``, which a
        minibatch step's update does not read), or None where it is not plain (the general pass takes
        it) or a pair of it could not be factorised (the general pass retries it in float64, or names it)."""
        done = self._pass(batch, *mixture.arrays())  # float64 or the data's dtype: pack rounds them
        if done is None:
            return None
        n, loglik, sums = done
        q, U, UU, P = map(torch.from_numpy, sums)
        return Statistics(n, q, U, UU, P, summed_loglik(torch.from_numpy(loglik)) if with_loglik else None)

    def sums(self, batch: Batch, weights: np.ndarray, means: np.ndarray, covariances: np.ndarray) -> tuple | None:
        """(n, q, U, UU, P) of the batch under the mixture of these C-contiguous arrays, as numpy arrays,
        or None where ``statistics`` gives None: a minibatch step's pass for an update that takes arrays
        (the CPU engine's compiled rules, ``fit.engines.cpu``), with no tensor made or read."""
        done = self._pass(batch, weights, means, covariances)
        return None if done is None else (done[0], *done[2])

    def _pass(self, batch: Batch, weights: np.ndarray, means: np.ndarray, covariances: np.ndarray) -> tuple | None:
        """(n, each point's log-likelihood, (q, U, UU, P)) of a plain batch, or None (see ``statistics``).
        The log-likelihoods are a buffer the next call overwrites."""
        place = batch.in_memory
        if place is not None:
            x, S, rows, observed = place.X, place.noise, place.rows, place.observed
        else:
            plain = batch.R is None and batch.weights is None
            if not plain or not isinstance(batch.S, torch.Tensor) or batch.x.dtype != self.dtype:
                return None
            x, S, rows = _array(batch.x), _array(batch.S), NO_ROWS
            observed = None if batch.observed is None else _array(batch.observed)
        n = len(rows) if place is not None else len(x)
        if n == 0 or n * self.k > self.max_pairs:
            return None
        if means.shape[0] != self.k or x.shape[1] != self.dim:
            return None
        module, (loglik, failed, acc, n_blocks) = self._module(n, observed is not None)
        module.pack(weights, means, covariances, self.par)
        no_weights, no_densities = self._empty
        masks, outputs = () if observed is None else (observed,), (loglik, no_densities, failed, acc)
        module.kernel(x, S, rows, *masks, self.par, no_weights, no_weights, *outputs, n_blocks, 1)
        first, *sums = module.unpack_checked(failed, acc, n_blocks, self.k)
        return None if first >= 0 else (n, loglik, sums)


def blocks_for(n: int, pool: int) -> int:
    """The blocks the sums of a chunk of n points are accumulated in, then summed in order: four a thread
    of numba's pool for a large chunk, fewer for a minibatch (at least ``BLOCK_ROWS`` rows a block, a
    multiple of the pool). They depend on the chunk and the machine's pool, never on the threads in use, so
    that a chunk's sums are the same on one thread or several."""
    return max(1, min(n, pool * min(4, max(1, n // (pool * BLOCK_ROWS)))))


def _threads_for(n_pairs: int, pool: int) -> bool:
    """Whether a pass of ``n_pairs`` pairs runs on numba's threads (their count set to torch's, at most the
    pool) or serially on this thread: a small chunk runs serially, since a parallel region waits for every
    thread of the pool (stalling the step where one is descheduled on a shared machine), and the pool's
    threads spin on a core after each region."""
    import numba

    threads = max(1, min(torch.get_num_threads(), pool))
    parallel = threads > 1 and n_pairs >= PARALLEL_PAIRS
    if parallel and numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    return parallel


def _unpacked(
    module, acc: np.ndarray, n_blocks: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, U, UU, P) from the blocks' sums (``unpack``), as tensors."""
    q, U, UU, P = module.unpack(acc, n_blocks, k)
    return torch.from_numpy(q), torch.from_numpy(U), torch.from_numpy(UU), torch.from_numpy(P)


def _array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the C-contiguous array the kernel takes (a view where it is one already)."""
    return (tensor if tensor.is_contiguous() else tensor.contiguous()).detach().numpy()
