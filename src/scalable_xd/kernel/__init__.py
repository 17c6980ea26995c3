"""The statistics pass every fitter, the scorer and the posterior stand on: ``dispatch`` picks a backend
(``fused``: numba on the CPU; ``triton_pass``: Triton on CUDA; ``unrolled``: torch, eager or through
``torch.compile``; ``linalg``: batched LAPACK, for projections) and chunks the pairs; ``statistics``
defines the sums each backend returns (and the ``Chunk`` each implements); ``unrolled_source`` writes the
D x D algebra that the generated kernels share.

The backends' table is here, not in ``dispatch``, so that the settings' readers (the command line's help)
name them without loading torch: a new backend is its module, which implements ``statistics.Chunk``,
and its row.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module


@dataclass(frozen=True)
class Backend:
    """A statistics pass: ``chunk`` names its ``statistics.Chunk`` as "module.function", the module relative
    to this package where it starts with a dot (imported on first use); ``max_pairs`` the (point, component)
    pairs per chunk on each kind of device it runs on; ``projections`` whether it handles R_i other than
    the identity."""

    name: str
    chunk: str
    max_pairs: dict[str, int]
    projections: bool = False

    def chunk_function(self):
        module, function = self.chunk.rsplit(".", 1)
        return getattr(import_module(module, package=__name__), function)


# Pairs per chunk. The fused kernel writes only the log-densities per pair (4-8 MB at 2^20 pairs). The
# unrolled pass is fastest on CPU between ~2^16 and ~2^18 pairs (its ~100 (K, B) temporaries then stay
# in cache); on a GPU far larger chunks amortise kernel launches. The LAPACK path holds several
# (pairs, d, d) stacks, ~25 MB each in float64 at 2^16 pairs. Triton on the CPU is its interpreter:
# test sizes only.
TABLE = {
    b.name: b
    for b in (
        Backend("fused", ".fused.fused_chunk", {"cpu": 1 << 20}),
        Backend("triton", ".triton_pass.triton_chunk", {"cpu": 1 << 16, "cuda": 1 << 22}),
        Backend("compiled", ".unrolled.compiled_chunk", {"cpu": 1 << 17, "cuda": 1 << 22}),
        Backend("unrolled", ".unrolled.unrolled_chunk", {"cpu": 1 << 17, "cuda": 1 << 22}),
        Backend("linalg", ".linalg.linalg_chunk", {"cpu": 1 << 16, "cuda": 1 << 20}, projections=True),
    )
}
# What the backend setting accepts: "auto" (``dispatch.choose_backend`` picks) or a backend of the table.
BACKENDS = ("auto", *TABLE)


def check_backend(name: str) -> None:
    """A ValueError for a backend name that is neither "auto" nor in the table, listing them."""
    if name != "auto" and name not in TABLE:
        raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(['auto', *TABLE])}")
