"""The reference engine: every batch through the general statistics pass (``kernel.dispatch``), then the
fitter's own update rule. It takes every batch any fit can have, on any device; the faster engines hand it
those they cannot take."""

from __future__ import annotations

import torch

from ... import deferred_checks
from ...background import Background
from ...data.batching import Batch
from ...deferred_checks import DeferredChecks
from ...errors import FitDivergedError, NotPositiveDefiniteError
from ...kernel.dispatch import batch_statistics, log_densities
from ...kernel.statistics import Statistics, summed_loglik
from ...mixture import Mixture
from ..families.background_fit import background_of
from ..families.background_fit import refuse_unsupported as refuse_background_data
from ..fitters import Fitter
from ..run.loop_config import LoopConfig
from ..run.parallel import reduce_statistics
from ..selection import Selection, imputed_points


class ReferenceEngine:
    """The general pass over each batch (and over a split-and-merge trial's model beside it), then the
    fitter's ``observe``."""

    checks: DeferredChecks | None = None
    in_place: bool = False

    def __init__(self, fitter: Fitter, cfg: LoopConfig):
        self.fitter, self.cfg = fitter, cfg

    def step(self, batch: Batch, epoch: int, number: int, uniforms: torch.Tensor | None) -> None:
        fitter, cfg = self.fitter, self.cfg
        try:
            stats = global_sums(
                batch, uniforms, fitter.mixture, cfg, fitter.wants_criteria, (epoch, number), background_of(fitter)
            )
            trial_sums = None  # a split-and-merge trial: its own pass over the same batch
            if fitter.trial_mixture is not None:
                trial_sums = global_sums(batch, uniforms, fitter.trial_mixture, cfg, False)
        except NotPositiveDefiniteError as err:
            raise FitDivergedError(
                epoch, err.component, "gave a covariance V_j + S_i that is not positive definite", cfg.cures, number
            ) from None
        if deferred_checks.positive_weight(stats.n_points):  # zero weight: nothing to update
            if trial_sums is not None:
                fitter.observe_trial(trial_sums)
            fitter.observe(stats)

    def restart(self) -> None:
        return None


def global_sums(
    batch: Batch,
    uniforms,
    mixture: Mixture,
    cfg: LoopConfig,
    with_criteria: bool,
    keys: tuple[int, int] | None = None,
    background: Background | None = None,
) -> Statistics:
    """The kernel's sums over a global batch: this process's share of it (and of the S-step's uniforms),
    with the points a selection removed beside it (``cfg.selection``; drawn by ``keys``, (epoch, batch)),
    or each point weighted by its chance of not being ``background``'s; summed over the processes when
    data-parallel."""
    if len(batch.x) == 0:  # a batch smaller than the number of processes
        stats = Statistics.zeros(mixture.n_components, mixture.dim, cfg.device, with_criteria)
        if background is not None:
            stats.background = torch.zeros((), dtype=torch.float64, device=cfg.device)
    else:
        weights, background_sums = batch.weights, None
        if background is not None:
            weights, background_sums = _background_weights(batch, mixture, cfg, background)
        stats = batch_statistics(
            batch.x,
            batch.S,
            mixture,
            batch.R,
            backend=cfg.backend,
            point_weights=weights,
            uniforms=uniforms,
            with_criteria=with_criteria,
            observed=batch.observed,
        )
        if background_sums is not None:
            stats.loglik, stats.background = background_sums
        if cfg.selection is not None and keys is not None:
            stats = stats.combine(_imputed_sums(cfg.selection, batch, mixture, cfg, keys))
    return reduce_statistics(stats, cfg.group, with_criteria)


def _background_weights(batch: Batch, mixture: Mixture, cfg: LoopConfig, background: Background):
    """Each point's weight times its chance 1 - r_i of being a Gaussian point (``background``), and the
    batch's (log-likelihood under mixture and background, sum of r_i), both weighted, float64."""
    refuse_background_data(batch)
    gaussian, _ = log_densities(batch.x, batch.S, mixture, backend=cfg.backend)
    loglik, log_r = background.combine(gaussian, batch.x)
    r = torch.exp(log_r)
    kept = -torch.expm1(log_r)  # 1 - r_i, exact where r_i is tiny
    weights = kept if batch.weights is None else batch.weights.to(torch.float64) * kept
    return weights.to(batch.x.dtype), (summed_loglik(loglik, batch.weights), summed_loglik(r, batch.weights))


def _imputed_sums(selection: Selection, batch: Batch, mixture: Mixture, cfg: LoopConfig, keys) -> Statistics:
    """The sums of the points the selection removed beside ``batch`` (``selection.imputed_points``), with no
    log-likelihood: the history's figures stay those of the catalogue's own points."""
    x, S = imputed_points(selection, mixture, batch, (cfg.seed, *keys, cfg.group.rank))
    if len(x) == 0:
        return Statistics.zeros(mixture.n_components, mixture.dim, cfg.device)
    stats = batch_statistics(x, S, mixture, None, backend=cfg.backend)
    stats.loglik = torch.zeros_like(stats.loglik) if stats.loglik is not None else None
    return stats
