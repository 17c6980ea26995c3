"""The epoch loop shared by every fitter: batching, timing, evaluation, checkpoints and divergence checks.

History entry 0 describes the initial parameters; entry e the parameters after epoch e. ``seconds`` is the
cumulative training wall time (batch transfer, statistics and updates), excluding the evaluation passes
that fill ``train_loglik`` and ``val_loglik`` (mean log-likelihood per point over the whole set).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from .._torch import synchronize
from ..dataset import Dataset
from ..errors import FitDivergedError, NotPositiveDefiniteError
from .checkpoint import Checkpoint
from .fitters import Fitter
from ..kernel.dispatch import batch_statistics, log_densities
from ..kernel.statistics import Statistics, summed_loglik
from ..mixture import Mixture
from .parallel import ONE_PROCESS, Group, reduce_statistics, reduce_sum

log = logging.getLogger("scalable_xd.fit")

# Points per evaluation batch; the kernel chunks it further to bound memory.
EVAL_BATCH = 8192


def batch_bounds(n: int, batch_size: int) -> list[tuple[int, int]]:
    """(start, stop) of each batch of an epoch over n points. A remainder of n mod batch_size joins the
    last batch, so every batch holds between batch_size and 2 batch_size - 1 points (or all n when
    n < batch_size). A separate remainder batch of a handful of points would get a full minibatch-EM or
    Adam step from almost no data, and a fit could end on it."""
    starts = list(range(0, n, batch_size))
    if len(starts) > 1 and n - starts[-1] < batch_size:
        starts.pop()
    return [(start, stop) for start, stop in zip(starts, starts[1:] + [n])]


def epoch_order(n: int, batch_size: int, epoch: int, seed: int, shuffle: bool):
    """Batches of one epoch (see ``batch_bounds``): slices in order, or a permutation that depends only on
    (seed, epoch)."""
    bounds = batch_bounds(n, batch_size)
    if not shuffle:
        return [slice(start, stop) for start, stop in bounds]
    epoch_seed = int(np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0] >> 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed))
    return [order[start:stop] for start, stop in bounds]


def scored_batches(data: Dataset, mixture: Mixture, device, dtype, backend: str, batch_size: int = EVAL_BATCH,
                   rows: slice | None = None):  # fmt: skip
    """Yield (start row, log p(x) (B,), log alpha_j N_ij (B, K)) over a data set (or its ``rows``) in
    bounded-memory batches; a factorisation failure names the row of the whole data set."""
    rows = rows or slice(0, len(data))
    for start in range(rows.start, rows.stop, batch_size):
        x, S, R = data.batch(slice(start, min(start + batch_size, rows.stop)), device, dtype)
        try:
            loglik, log_dens = log_densities(x, S, mixture, R, backend=backend)
        except NotPositiveDefiniteError as err:
            raise NotPositiveDefiniteError(start + err.row, err.component) from None
        yield start, loglik, log_dens


def total_loglik(data: Dataset, mixture: Mixture, device, dtype, backend: str, group: Group = ONE_PROCESS) -> float:
    """Sum over all points of log p(x_i) (times each point's weight, where the data are weighted),
    accumulated in float64; in a process group each process scores its share of the rows."""
    total = 0.0
    rows = group.share(slice(0, len(data)), len(data))
    for start, ll, _ in scored_batches(data, mixture, device, dtype, backend, rows=rows):
        total += float(summed_loglik(ll, data.batch_weights(slice(start, start + len(ll)), ll.device, torch.float64)))
    return reduce_sum(total, group, device)


def assignment_uniforms(seed: int, epoch: int, batch: int, size: int, device, dtype) -> torch.Tensor:
    """Stochastic EM's uniforms for one batch: drawn on the CPU from a generator that depends only on
    (seed, epoch, batch), so that draws are the same on every device and after a resume."""
    batch_seed = int(np.random.SeedSequence([seed, epoch, batch, 1]).generate_state(1, dtype=np.uint64)[0] >> 1)
    uniforms = torch.rand(size, generator=torch.Generator().manual_seed(batch_seed), dtype=torch.float64)
    return uniforms.to(device=device, dtype=dtype)


@dataclass
class LoopConfig:
    epochs: int
    batch_size: int
    shuffle: bool
    seed: int
    device: torch.device
    dtype: torch.dtype
    backend: str  # kernel backend for R = I batches (see ``kernel``)
    w: float
    tol: float | None
    verbose: int = 0
    group: Group = ONE_PROCESS  # data-parallel processes (see ``parallel``)


def _check_mixture(mixture: Mixture, epoch: int, w: float) -> None:
    problem = mixture.first_invalid_component()
    if problem is not None:
        raise FitDivergedError(epoch, problem[0], problem[1], w)


def _log(cfg: LoopConfig, entry: dict) -> None:
    """One line per epoch on the ``scalable_xd.fit`` logger (when ``verbose``), so applications route it;
    where nothing configured logging at all, a stderr handler is added so that verbose output shows."""
    if cfg.verbose < 1:
        return
    if not logging.getLogger().hasHandlers() and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[scalable-xd] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    val = "" if entry["val_loglik"] is None else f"  val {entry['val_loglik']:.5f}"
    log.info("epoch %3d/%d  %9.2f s  train %.5f%s", entry["epoch"], cfg.epochs, entry["seconds"],
             entry["train_loglik"], val)  # fmt: skip


def _global_sums(batch: tuple, mixture: Mixture, cfg: LoopConfig, with_criteria: bool) -> Statistics:
    """The kernel's sums over a global batch: this process's share (x, S, R, weights, uniforms), summed
    over the processes when data-parallel."""
    x, S, R, weights, uniforms = batch
    if len(x) == 0:  # a batch smaller than the number of processes
        stats = Statistics.zeros(mixture.n_components, mixture.dim, cfg.device, with_criteria)
    else:
        stats = batch_statistics(x, S, mixture, R, backend=cfg.backend, point_weights=weights, uniforms=uniforms,
                                 with_criteria=with_criteria)  # fmt: skip
    return reduce_statistics(stats, cfg.group, with_criteria)


def run(fitter: Fitter, train: Dataset, val: Dataset | None, cfg: LoopConfig, checkpoint: Checkpoint | None = None):
    """Fit until ``cfg.epochs`` epochs are done (or batch EM converges), continuing from the checkpoint's
    saved state when there is one and saving to it after every epoch; returns (history, converged)."""

    def evaluate(epoch: int, seconds: float) -> dict:
        return {
            "epoch": epoch,
            "seconds": seconds,
            "train_loglik": total_loglik(train, fitter.result, cfg.device, cfg.dtype, cfg.backend, cfg.group)
            / train.total_weight,
            "val_loglik": None
            if val is None
            else total_loglik(val, fitter.result, cfg.device, cfg.dtype, cfg.backend, cfg.group) / val.total_weight,
            "step_size": fitter.step_size(max(epoch - 1, 0)),
            **fitter.diagnostics(),
        }

    if checkpoint is not None and checkpoint.saved is not None:
        fitter.load_state_dict(checkpoint.saved["fitter"])
        start, history, converged = (checkpoint.saved[key] for key in ("epoch", "history", "converged"))
    else:
        start, history, converged = 0, [evaluate(0, 0.0)], False
        _log(cfg, history[0])
    epoch = start + 1
    while epoch <= cfg.epochs and not converged:
        synchronize(cfg.device)
        tick = time.perf_counter()
        fitter.start_epoch(epoch - 1)
        batches = epoch_order(len(train), cfg.batch_size, epoch, cfg.seed, cfg.shuffle)
        progress = tqdm(batches, disable=cfg.verbose < 2, leave=False, desc=f"epoch {epoch}", unit="batch",
                        mininterval=1.0 if sys.stderr.isatty() else 30.0)  # fmt: skip
        for number, index in enumerate(progress):
            size = index.stop - index.start if isinstance(index, slice) else len(index)
            share = cfg.group.share(index, size)  # the whole batch unless data-parallel
            x, S, R = train.batch(share, cfg.device, cfg.dtype)
            weights = train.batch_weights(share, cfg.device, cfg.dtype)
            uniforms = None
            if fitter.samples_assignments:  # drawn for the whole batch, so the same draws for any P
                uniforms = assignment_uniforms(cfg.seed, epoch, number, size, cfg.device, cfg.dtype)
                uniforms = uniforms[cfg.group.share(slice(0, size), size)]

            batch = (x, S, R, weights, uniforms)
            try:
                stats = _global_sums(batch, fitter.mixture, cfg, fitter.wants_criteria)
                if fitter.shadow is not None:  # a split-and-merge trial: its own pass over the same batch
                    fitter.observe_shadow(_global_sums(batch, fitter.shadow, cfg, False))
            except NotPositiveDefiniteError as err:
                raise FitDivergedError(
                    epoch, err.component, "gave a covariance V_j + S_i that is not positive definite", cfg.w, number
                ) from None
            fitter.observe(stats)
        fitter.end_epoch()
        synchronize(cfg.device)
        seconds = history[-1]["seconds"] + time.perf_counter() - tick
        _check_mixture(fitter.mixture, epoch, cfg.w)
        _check_mixture(fitter.result, epoch, cfg.w)
        history.append(evaluate(epoch, seconds))
        _log(cfg, history[-1])
        if cfg.tol is not None and history[-1]["train_loglik"] - history[-2]["train_loglik"] < cfg.tol:
            converged = True
        converged = converged or fitter.finished
        if checkpoint is not None and cfg.group.writes:
            checkpoint.save(epoch, history, converged, fitter.state_dict())
        epoch += 1
    return history, converged
