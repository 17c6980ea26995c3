"""What the Triton forms of the rules share: a program's block of components, the batch's size per fit.

A program takes a few components as (component, D, D) blocks, D padded to a power of two: the products
are broadcast sums, the Cholesky test a right-looking elimination, so that the kernel compiles in seconds
(unrolled entry by entry, as the statistics kernels are, it took 50-75 s). Every kernel takes several
fits at once (the ensemble's step, ``engines.cuda.GraphedEnsemble``), each with its own parameters and
scalars. They run on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``), which is how the
tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernel.statistics import Statistics

BLOCK = 4  # components per program: with the (B, D, D, D) products, 2,048 float64 numbers at D <= 8


@triton.jit
def _components(n_comp, n_all, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr):
    """A program's BLOCK components among the fits' n_all (n_comp a fit): their indices, which are real,
    their fits, the padded dimension's index as a row and a column, and the masks of real vector and matrix
    entries."""
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    on = k < n_all
    idx = tl.arange(0, DP)
    row, col = idx[None, :, None], idx[None, None, :]
    vec_on = on[:, None] & (idx[None, :] < D)
    mat_on = on[:, None, None] & (row < D) & (col < D)
    return k, on, k // n_comp, idx, row, col, vec_on, mat_on


def _points_per_fit(stats: Statistics, n_fits: int, device) -> torch.Tensor:
    """The batch's (weighted) number of points for each of ``n_fits`` fits, (F,), on the device: a fill, not a
    copy from the host, so that a CUDA graph captures it (every fit's batch is of one size)."""
    n = stats.n_points
    return (
        n.expand(n_fits) if torch.is_tensor(n) else torch.full((n_fits,), float(n), dtype=torch.float64, device=device)
    )
