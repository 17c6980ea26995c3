"""The CPU statistics pass of several fits at once: S fits' minibatches, each under its own mixture, in one
call of the fused kernel (``fused``), as (fit, point, component) triples.

Fits that advance in lockstep (``fit.run.lockstep``: restarts, or a grid cell's seeds) each take a batch of
their own rows of the same data at every step. One call over the S batches pays the call's fixed costs
once, and where one fit's pass is threaded, spreads S times its work over the threads; where it is serial
and the S fits' pairs together would be threaded, the fits are shared among threads of this process, each
running the serial kernel (which releases the GIL) on its own fits' batches. Each fit's points
are split into the blocks ``fused.blocks_for`` gives one fit's batch alone, and its sums are those blocks'
summed in order: a fit's statistics are the same, to the bit, whether it was passed alone
(``fused.PlainPass``) or beside any others.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..data.batching import RowsInMemory
from . import fused, fused_layout

# (fit, point, component) triples from which fits passed by the serial kernel are shared among threads: at
# K = 3 and ten features, three fits' 1,350 took a default fit on 3,000 stars from 2.11 to 1.89 s; 450 (1,000
# stars) gained nothing (2 cores, 2026-12-03)
SHARED_PAIRS = 1_000


class EnsemblePass:
    """The statistics pass over S fits' plain in-memory batches of one data set (R = I; no weights or
    draws; missing entries through the masked kernel), each fit's mixture its own, as ``PlainPass``
    computes one fit's; its buffers are reused from call to call (one loop calls it, from one thread)."""

    def __init__(self, dim: int, n_components: int, dtype: torch.dtype):
        import numba

        self.pool = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # filled at import
        self.dim, self.k, self.dtype = dim, n_components, dtype
        # one fit's packed parameters, and one block's sums
        self.tile, self.fit_params, self.block_sums = fused_layout.tiled_sizes(n_components, dim)
        self._buffers: dict[tuple, tuple] = {}  # by (torch's threads, fits, points a fit, masked)
        self._pool: tuple[int, ThreadPoolExecutor] | None = None  # (its threads, the pool), made when first asked

    def sums(self, places: list[RowsInMemory], weights: np.ndarray, means: np.ndarray, covariances: np.ndarray):
        """(n points a fit, the first failed point of each fit (S,), -1 for none, and the sums q (S, K),
        U (S, K, D), UU and P (S, K, D, D)) of fit s's batch ``places[s]`` under mixture s of the stacked
        (S, K), (S, K, D) and (S, K, D, D) arrays; None where the batches are not rows of one data set in
        memory of equal sizes and of this pass's D (each fit then takes its batch alone)."""
        first = places[0]
        n = len(first.rows)
        same = all(
            all(_same(getattr(p, a), getattr(first, a)) for a in ("X", "noise", "observed")) and len(p.rows) == n
            for p in places
        )
        if not same or n == 0 or first.X.shape[1] != self.dim:  # rows of any float dtype, cast as read
            return None
        n_fits = len(places)
        module, par, loglik, failed, acc, n_blocks, groups = self._settled(n_fits, n, first.observed is not None)
        module.pack_fits(weights, means, covariances, par)
        rows = np.concatenate([p.rows for p in places])
        no_weights, no_densities = np.empty(0, par.dtype), np.empty((0, self.k), par.dtype)
        masks = () if first.observed is None else (first.observed,)
        fit_blocks = n_blocks // n_fits

        def run(a: int, b: int) -> None:  # fits a to b - 1: their rows, parameters and outputs, fit after fit
            points, blocks = (
                slice(a * n, b * n),
                slice(a * fit_blocks * self.block_sums, b * fit_blocks * self.block_sums),
            )
            outputs = (loglik[points], no_densities, failed[points], acc[blocks])
            fit_par = par[a * self.fit_params : b * self.fit_params]
            module.kernel(
                first.X, first.noise, rows[points], *masks, fit_par, no_weights, no_weights, *outputs,
                (b - a) * fit_blocks, b - a,
            )  # fmt: skip

        if groups == 1:
            run(0, n_fits)
        else:
            bounds = [(g * n_fits // groups, (g + 1) * n_fits // groups) for g in range(groups)]
            waits = [self._workers(groups).submit(run, a, b) for a, b in bounds[1:]]
            run(*bounds[0])
            for wait in waits:
                wait.result()
        return (n, *module.unpack_fits(failed, acc, n_blocks, n_fits, self.k))

    def _workers(self, groups: int) -> ThreadPoolExecutor:
        """The threads that pass all groups of fits but the first (which the calling thread passes)."""
        if self._pool is None or self._pool[0] < groups - 1:
            if self._pool is not None:  # torch's threads were raised: a larger pool replaces it
                self._pool[1].shutdown(wait=False)
            self._pool = (groups - 1, ThreadPoolExecutor(groups - 1, thread_name_prefix="scalable-xd-ensemble"))
        return self._pool[1]

    def _settled(self, n_fits: int, n: int, masked: bool) -> tuple:
        """The module one fit's pass of n points takes (threaded or serial: ``fused._threads_for``; the two
        compiled kernels differ in their last bits, so a fit passed alone and with others must take the
        same; ``masked``: with missing entries), the buffers for S fits of n points each, and the groups of
        fits passed on threads of their own (serial kernel, S fits' pairs enough to thread: see the module),
        made once for each (S, n, masked) and torch's threads."""
        key = (torch.get_num_threads(), n_fits, n, masked)
        settled = self._buffers.get(key)
        if settled is None:
            parallel = fused._threads_for(n * self.k, self.pool)  # as one fit's pass: the same compiled code
            real = fused.DTYPE_NAMES[self.dtype]
            module = fused.compiled_module(self.dim, True, real, parallel, masked, self.tile)
            n_blocks = n_fits * fused.blocks_for(n, self.pool)  # each fit's as in its pass alone
            par = np.empty(n_fits * self.fit_params, real)
            loglik, failed = np.empty(n_fits * n, real), np.empty(n_fits * n, np.int64)
            threads = min(torch.get_num_threads(), self.pool, n_fits)
            groups = threads if not parallel and n_fits * n * self.k >= SHARED_PAIRS else 1
            acc = np.empty(n_blocks * self.block_sums)
            settled = self._buffers[key] = (module, par, loglik, failed, acc, n_blocks, groups)
        return settled


def _same(a, b) -> bool:
    """Whether two arrays (or tuples of arrays: compact noise; or both None) are views of the same memory,
    alike."""
    if a is None or b is None:
        return a is b
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and all(map(_same, a, b))
    same_memory = a.__array_interface__["data"] == b.__array_interface__["data"]
    return a is b or (same_memory and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype)
