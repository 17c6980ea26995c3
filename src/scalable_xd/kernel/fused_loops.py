"""The fused kernel's loops over a tile's components, written out as Python source per dimension D: the
factorisation of T = V + S and its solves, unrolled entry by entry (in one loop, or above
``SPLIT_MIN_DIM`` in four) or looped over D above ``UNROLLED_MAX_DIM``; the densities; and the sums the
responsibilities add to (``fused`` describes the kernel they make)."""

from __future__ import annotations

from .fused_layout import PIVOTS_PER_LOG, SUMS_PER_LOOP, layout
from .unrolled_source import factorise_and_solve, invert_factor, t_inv_entry, tri, u_entry


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
            "    for c in range(lanes):",
            f"        dv[i, c] = xi - par2[{means_row} + i, c]",
            "for j in range(D):",
            "    for i in range(j, D):",
            f"        sij, vij = noise_entry(S, r, i, j, {real}), i * (i + 1) // 2 + j",
            "        for c in range(lanes):",
            "            av[c] = par2[vij, c] + sij",
        ]
    return [
        "for i in range(D):",
        f"    xi, oi = ({real}(x[r, i]), {real}(1.0)) if observed[r, i] else ({real}(0.0), {real}(0.0))",
        "    for c in range(lanes):",
        f"        dv[i, c] = (xi - par2[{means_row} + i, c]) * oi",
        "for j in range(D):",
        "    for i in range(j, D):",
        "        seen, vij = observed[r, i] and observed[r, j], i * (i + 1) // 2 + j",
        f"        sij = noise_entry(S, r, i, j, {real}) if seen else {real}(1.0 if i == j else 0.0)",
        f"        oij = {real}(1.0) if seen else {real}(0.0)",
        "        for c in range(lanes):",
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
        "            for c in range(lanes):",
        "                av[c] -= lf[i * D + m, c] * lf[j * D + m, c]",
        "        if i == j:",
        "            for c in range(lanes):",
        "                pv[j, c] = av[c]",
        "                lf[j * D + j, c] = math.sqrt(av[c])",
        f"                wf[j * D + j, c] = {real}(1.0) / lf[j * D + j, c]",
        "        else:",
        "            for c in range(lanes):",
        "                lf[i * D + j, c] = av[c] * wf[j * D + j, c]",
        "for c in range(lanes):",
        f"    scr2[{at['maha']}, c], scr2[{at['lo']}, c], scr2[{at['hi']}, c] = 0.0, math.inf, -math.inf",
        "for i in range(D):",
        "    for c in range(lanes):",
        "        av[c] = dv[i, c]",
        "    for m in range(i):",
        "        for c in range(lanes):",
        "            av[c] -= lf[i * D + m, c] * zv[m, c]",
        "    for c in range(lanes):",
        "        zv[i, c] = av[c] * wf[i * D + i, c]",
        f"        scr2[{at['maha']}, c] += zv[i, c] * zv[i, c]",
        # -1 where a pivot is not positive (NaN included), so that the density loop's check fails
        f"        scr2[{at['lo']}, c] = min(scr2[{at['lo']}, c], pv[i, c]) if pv[i, c] > 0 else -1.0",
        f"        scr2[{at['hi']}, c] = max(scr2[{at['hi']}, c], pv[i, c])",
        "for i in range(D):",
        "    for c in range(lanes):",
        f"        scr2[{at['pivots']} + i, c] = pv[i, c]",
    ]
    if not with_stats:
        return lines
    return lines + [
        "for i in range(D):",  # W's off-diagonal entries, as invert_factor
        "    for j in range(i):",
        "        for c in range(lanes):",
        "            av[c] = 0.0",
        "        for m in range(j, i):",
        "            for c in range(lanes):",
        "                av[c] += lf[i * D + m, c] * wf[m * D + j, c]",
        "        for c in range(lanes):",
        "            wf[i * D + j, c] = -av[c] * wf[i * D + i, c]",
        "for i in range(D):",  # u = W^T z and T^-1 = W^T W, as u_entry and t_inv_entry
        "    for c in range(lanes):",
        "        av[c] = 0.0",
        "    for m in range(i, D):",
        "        for c in range(lanes):",
        "            av[c] += wf[m * D + i, c] * zv[m, c]",
        "    for c in range(lanes):",
        f"        scr2[{at['u']} + i, c] = av[c]",
        "    for j in range(i + 1):",
        "        for c in range(lanes):",
        "            av[c] = 0.0",
        "        for m in range(i, D):",
        "            for c in range(lanes):",
        "                av[c] += wf[m * D + i, c] * wf[m * D + j, c]",
        *([f"        oij = {real}(1.0) if observed[r, i] and observed[r, j] else {real}(0.0)"] if masked else []),
        "        for c in range(lanes):",
        f"            scr2[{at['t_inv']} + i * (i + 1) // 2 + j, c] = av[c]" + (" * oij" if masked else ""),
    ]


def _accumulate_looped(dim: int) -> list[str]:
    """``_accumulate_loops`` for large D: loops over the dimensions, the tile's components innermost."""
    at = layout(dim)
    return [
        f"scr2, acc2 = tile_scr.reshape({at['n_scratch']}, TILE), tile_acc.reshape({at['n_sums']}, TILE)",
        "for c in range(lanes):",
        f"    acc2[{at['q']}, c] += tile_resp[c]",
        "for i in range(D):",
        "    for c in range(lanes):",
        f"        acc2[{at['U']} + i, c] += tile_resp[c] * scr2[{at['u']} + i, c]",
        "    for j in range(i + 1):",
        "        for c in range(lanes):",
        f"            acc2[{at['UU']} + i * (i + 1) // 2 + j, c] += "
        f"tile_resp[c] * scr2[{at['u']} + i, c] * scr2[{at['u']} + j, c]",
        f"for e in range({dim * (dim + 1) // 2}):",
        "    for c in range(lanes):",
        f"        acc2[{at['P']} + e, c] += tile_resp[c] * scr2[{at['t_inv']} + e, c]",
    ]


def _loop_work(dim: int) -> list[str]:
    """The looped kernel's per-block work rows (``_component_loop_looped``) and its lane count, in the
    block's prologue."""
    rows = {"lf": dim * dim, "wf": dim * dim, "dv": dim, "zv": dim, "pv": dim}
    work = [f"        {name} = np.empty(({n}, TILE), par.dtype)" for name, n in rows.items()]
    # ``lanes`` is TILE where LLVM cannot see it: a lane loop of a constant 4 to 16 trips it unrolled into
    # scalar operations (its assembly held only scalar FMAs), one of a trip count known at run time it
    # vectorises, checking there that the work rows do not overlap: 2.3-2.8x the pairs a second at D = 13
    # and 20 (docs/performance.md). n_blocks is never 0 where a block runs.
    lanes = "        lanes = TILE if n_blocks > 0 else 1"
    return [f"        D = {dim}", *work, "        av = np.empty(TILE, par.dtype)", lanes]


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


def _indent(lines: list[str], n: int = 1) -> list[str]:
    return ["    " * n + line for line in lines]
