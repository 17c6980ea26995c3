"""Scoring a data set under a mixture: log p(x) of every point, in bounded-memory batches, and their
(weighted) sum, shared among the processes of a data-parallel fit."""

from __future__ import annotations

import math

import torch

from .. import deferred_checks
from ..background import Background
from ..data.source import DataSource
from ..errors import NotPositiveDefiniteError
from ..kernel.dispatch import log_densities
from ..kernel.fused import PARALLEL_PAIRS
from ..kernel.statistics import summed_loglik
from ..mixture import Mixture
from .parallel import ONE_PROCESS, Group, reduce_sum

# Points per evaluation batch; the kernel chunks it further to bound memory.
EVAL_BATCH = 8192


def summing_batch(n_components: int) -> int:
    """Points per batch where only the total is kept (``total_loglik``): ``EVAL_BATCH``, or for a mixture
    of few components enough points for the CPU's threaded pass (``PARALLEL_PAIRS`` pairs: 10,000 points at
    K = 3, where 8,192 ran on one core), up to four times as many."""
    return min(4 * EVAL_BATCH, max(EVAL_BATCH, -(-PARALLEL_PAIRS // n_components)))


def scored_batches(
    data: DataSource,
    mixture: Mixture,
    device,
    dtype,
    backend: str,
    batch_size: int = EVAL_BATCH,
    rows: slice | None = None,
    background: Background | None = None,
):
    """Yield (first row, log p(x) (B,), log alpha_j N_ij (B, K), weights (B,) or None) over a data set (or
    its ``rows``) in bounded-memory batches; a factorisation failure names the row of the whole data set.
    With a ``background`` of weight beta, log p(x) is the likelihood under both and the second figure
    log (1 - beta) alpha_j N_ij, so that exp(second - first) is each component's chance beside the
    background's (both float64)."""
    for start, x, S, R, weights, observed in data.scan(rows or slice(0, len(data)), batch_size, device, dtype):
        try:
            loglik, log_dens = log_densities(x, S, mixture, R, backend=backend, observed=observed)
        except NotPositiveDefiniteError as err:
            raise NotPositiveDefiniteError(start + err.row, err.component) from None
        if background is not None:
            loglik, _ = background.combine(loglik, x)
            log_dens = log_dens.to(torch.float64) + math.log1p(-background.weight)
        yield start, loglik, log_dens, weights


def total_loglik(
    data: DataSource,
    mixture: Mixture,
    device,
    dtype,
    backend: str,
    group: Group = ONE_PROCESS,
    background: Background | None = None,
) -> float:
    """Sum over all points of log p(x_i) (times each point's weight, where the data are weighted),
    accumulated in float64; in a process group each process scores its share of the rows; with a
    ``background``, under the mixture and the background together.

    Where the device defers its tests (a GPU: ``deferred_checks``), the sum and the batches' tests stay on
    the device until the end, one question of it a scoring instead of two a batch; where a test tripped, the
    data are scored again with every test made at its batch (a float32 pair then computed in float64, or the
    row that fails named), so the result is the same."""
    rows = group.share(slice(0, len(data)), len(data))

    def batch_totals():
        batch = summing_batch(mixture.n_components)
        for _, ll, _, weights in scored_batches(
            data, mixture, device, dtype, backend, batch, rows=rows, background=background
        ):
            yield summed_loglik(ll, weights)

    if deferred_checks.defers_on(device):
        with deferred_checks.deferring(device) as checks:
            on_device = torch.zeros((), dtype=torch.float64, device=device)
            for batch_total in batch_totals():
                on_device += batch_total
        if not checks.tripped():
            return reduce_sum(float(on_device), group, device)
    total = sum(float(batch_total) for batch_total in batch_totals())
    return reduce_sum(total, group, device)
