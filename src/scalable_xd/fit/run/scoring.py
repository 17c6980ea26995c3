"""Scoring a data set under a mixture: log p(x) of every point, in bounded-memory batches, and their
(weighted) sum, shared among the processes of a data-parallel fit; and several fits' scorings of one data
set in one pass over it (fits in lockstep on CUDA)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ... import deferred_checks
from ...background import Background
from ...data.source import DataSource
from ...errors import NotPositiveDefiniteError
from ...kernel.dispatch import log_densities
from ...kernel.fused import PARALLEL_PAIRS
from ...kernel.statistics import summed_loglik
from ...mixture import Mixture
from .lockstep import caught
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


def shares_scoring(device: torch.device) -> bool:
    """Whether fits in lockstep score a data set together (``scores_together``): on CUDA, where one pass of
    S fits' components keeps the GPU busy and reads the data once, where S passes of one fit's would
    each leave it mostly idle. Not on the CPU, whose pass costs the same per pair either way and whose
    fits in lockstep score to the bit as alone. Read at each scoring: tests replace it."""
    return device.type == "cuda"


@dataclass
class ScoreRequest:
    """A fit's scoring posted to its lockstep (``fit.run.lockstep``): the data, the mixture and how to score;
    ``total`` is filled in by ``scores_together``."""

    data: DataSource
    mixture: Mixture
    device: torch.device
    dtype: torch.dtype
    backend: str
    total: float = math.nan  # not yet scored

    @staticmethod
    def together(requests: list[ScoreRequest]) -> list[BaseException | None]:
        return scores_together(requests)

    def score_alone(self) -> None:
        self.total = total_loglik(self.data, self.mixture, self.device, self.dtype, self.backend)


def scores_together(requests: list[ScoreRequest]) -> list[BaseException | None]:
    """Every posted scoring: those of one data set (the same object) with mixtures of one shape in one pass
    (``ensemble_total_loglik``), any other alone; each request's ``total`` filled in, each fit's error (or
    None) returned."""
    groups: dict[tuple, list[ScoreRequest]] = {}
    for r in requests:
        groups.setdefault((id(r.data), r.device, r.dtype, r.backend, tuple(r.mixture.means.shape)), []).append(r)
    errors: dict[int, BaseException | None] = {}
    for group in groups.values():
        first = group[0]
        try:
            totals = ensemble_total_loglik(
                first.data, [r.mixture for r in group], first.device, first.dtype, first.backend
            )
        except Exception:  # each fit's error is its own: each scored alone, with every test made
            for request in group:
                errors[id(request)] = caught(request.score_alone)
            continue
        for request, total in zip(group, totals):
            request.total = total
    return [errors.get(id(request)) for request in requests]


def ensemble_total_loglik(data: DataSource, mixtures: list[Mixture], device, dtype, backend: str) -> list[float]:
    """``total_loglik`` of each of S mixtures of K components on one data set, in one pass over it: each
    batch's log alpha_j N_ij under the S K components at once (one mixture of the fits' components, each
    with its own fit's weight), then each fit's log-sum-exp over its own K. Its tests are deferred to the
    end (one question of the device); where one tripped, each mixture is scored alone with every test made
    (``total_loglik``), so the results are those, or the error that names the row."""
    if len(mixtures) == 1:
        return [total_loglik(data, mixtures[0], device, dtype, backend)]
    k = mixtures[0].n_components
    stacked = Mixture(*(torch.cat(parts) for parts in zip(*(m.tensors() for m in mixtures))))
    with deferred_checks.deferring(device) as checks:
        totals = torch.zeros(len(mixtures), dtype=torch.float64, device=device)
        for _, _, log_dens, weights in scored_batches(data, stacked, device, dtype, backend):
            loglik = torch.logsumexp(log_dens.view(log_dens.shape[0], len(mixtures), k), dim=2)  # (B, S)
            totals += (loglik.double() * (1.0 if weights is None else weights[:, None])).sum(0)
    if checks.tripped():
        return [total_loglik(data, mixture, device, dtype, backend) for mixture in mixtures]
    return totals.tolist()
