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

The source is written out per dimension D (``fused_source``, its loops ``fused_loops``, its layout
``fused_layout``), the algebra unrolled entry by entry as in ``unrolled``, and compiled on first use for each
(D, dtype, with_stats), then cached on disk (``compiled_module``). Above D = 7
(``fused_layout.SPLIT_MIN_DIM``) a tile's work runs as four loops over its components, L and z passed through
the scratch (``fused_loops._split_component_loops``): as one loop, LLVM's vectoriser gave up at D = 12 and ran
it on scalars, at a quarter of the split form's rate (``benchmarks/bench_roofline.py``). The unrolled source
grows as D^3, and numba's compile time with it: 5 s at D = 2, 9 s at 7, 22 s at 12, 83 s at 20. Above
``fused_layout.UNROLLED_MAX_DIM`` the algebra runs in loops over D instead (the tile's components still
innermost, so still vectorised), which compiles in 6-7 s at any D and runs 1.5-7x slower than unrolled code
would (``benchmarks/bench_compile.py``). numba installs from wheels; where it is missing the dispatcher falls
back to the torch kernel with a message (``dispatch.choose_backend``).
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import types
from functools import cache

import numpy as np
import torch

from ..data.batching import Batch
from ..errors import NotPositiveDefiniteError
from ..mixture import Mixture
from .fused_layout import TILE, tiled_sizes
from .fused_source import _module_source
from .statistics import Criteria, Statistics, criteria_sums, n_points, summed_loglik
from .unrolled_source import import_generated

# (star, component) pairs below which a chunk runs on one thread, where a parallel region's cost and its
# threads' spinning outweigh what a second thread saves (500 stars x K < 60)
PARALLEL_PAIRS = 30_000
log = logging.getLogger(__name__)
DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64"}  # a lookup: numpy's str(dtype) is slow
NO_ROWS = np.empty(0, np.int64)  # the kernel's ``rows`` where x and S are the batch itself
# Rows a block of the pass's sums takes at least, up to four blocks a thread of numba's pool: each block
# zeroes and is summed over K x 63 sums, which costs a minibatch step of 500 rows more in eight blocks
BLOCK_ROWS = 100


@cache
def compiled_module(
    dim: int, with_stats: bool, dtype: str, parallel: bool = True, masked: bool = False, tile: int = TILE
):
    """The numba-compiled module (``kernel``, ``pack``, ``unpack``, ``unpack_checked``) for dimension ``dim``
    and float dtype ``dtype`` ("float32" or "float64"), its kernel multi-threaded or serial
    (``_module_source``); ``masked``: its kernel takes each point's observed entries (``fused_source._masked_point``);
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
    ``observed`` (B, D) bool: each point's other entries marginalised (``fused_source._masked_point``), U, UU and P in
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
    K = 64: docs/performance.md). A batch with missing entries takes the masked kernel (``fused_source._masked_point``).
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
