"""The fused kernel's module source per (D, dtype, with_stats, masked, parallel, tile): the kernel's work on
a point (its components' loops from ``fused_loops``), the packing of parameters into tiles and the
unpacking of a block's sums, with the fast-math flags and helpers it is compiled with (``fused`` compiles
it and runs it)."""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

from . import float_env, fused_layout, row_access
from .fused_layout import TILE, layout
from .fused_loops import (
    _accumulate_looped,
    _accumulate_loops,
    _component_loop,
    _component_loop_looped,
    _density_loop,
    _first_failure,
    _indent,
    _loop_work,
    _split_component_loops,
)
from .statistics import LOG_2PI
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


# exp(x) for x below this is < 1e-304 and is taken as 0 (responsibilities exactly 0): vector_math's exp
# builds 2^n as a normal float, which it no longer is below -708
EXP_CUTOFF = -700.0


def _source(dim: int, with_stats: bool, real: str, masked: bool = False) -> str:
    """The kernel's Python source for dimension ``dim`` and scalar type ``real``: arrays are flat, and
    every index is a tile's base plus a literal offset, so that the strides are compile-time constants.
    ``masked``: the kernel takes each point's observed entries, ``observed`` (n, D), after ``rows``."""
    at = layout(dim)
    looped = dim > fused_layout.UNROLLED_MAX_DIM
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
    looped = dim > fused_layout.UNROLLED_MAX_DIM
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
        if dim > fused_layout.SPLIT_MIN_DIM:
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
