"""The fused kernel's layout: components in tiles (``TILE``, ``tile_for``), the rows of a tile's parameters,
scratch and sums (``layout``), and the dimensions at which the generated algebra changes form
(``UNROLLED_MAX_DIM``, ``SPLIT_MIN_DIM``: tests and benchmarks set them, and the generators read them here at
each use)."""

from __future__ import annotations

from functools import cache

TILE = 16  # components per tile: a compile-time stride, so that LLVM proves the tile loops free of aliasing


SUMS_PER_LOOP = 8  # sums updated per loop: with all 63 in one, LLVM's dependence analysis gives up


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
    1.2 in tiles of 4); the looped form's cost a lane each, padding or not, while they ran as scalars (at
    D = 20, K = 3: 22.7 us a pair in tiles of 16, 5.3 in tiles of 4: docs/performance.md)."""
    if dim <= UNROLLED_MAX_DIM:
        return TILE
    return next((tile for tile in NARROW_TILES if n_components <= tile), TILE)


def tiled_sizes(n_components: int, dim: int) -> tuple[int, int, int]:
    """(the tile, the length of ``pack``'s parameters, the length of one block's sums) for K components in
    D dimensions: K padded to whole tiles of ``tile_for``'s width."""
    tile, at = tile_for(n_components, dim), layout(dim)
    padded = -(-n_components // tile) * tile
    return tile, padded * at["n_params"], padded * at["n_sums"]


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
