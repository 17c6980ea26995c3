"""The CPU's engine: plain batches through the fused kernel's pass (``kernel.fused.PlainPass``), into the
compiled (numba) forms of the minibatch rules (``rules.online_em_numba``, ``rules.sgd_numba``), on the pass's
arrays.

A minibatch step's float64 update written as torch calls is dozens of small operations whose dispatch costs
several times the arithmetic; compiled, each rule is one call. Fed the pass's sums as arrays and keeping the
fitter's parameters as arrays until a tensor is asked for (``MinibatchEM.hold``, ``SGD.hold``), a step
makes no tensor at all. A fitter on the CPU runs its rule's compiled form at every update, whichever pass
made the statistics, so that a fit's arithmetic does not depend on which batches the plain pass took.
"""

from __future__ import annotations

import numpy as np
import torch

from ... import deferred_checks
from ...data.batching import Batch
from ...kernel import TABLE
from ...kernel.dispatch import choose_backend
from ...kernel.ensemble_pass import EnsemblePass
from ...kernel.fused import PlainPass
from ..families.background_fit import background_of
from ..fitters import Fitter
from ..rules.arrays import ArrayRule
from ..run.lockstep import StepRequest, caught
from ..run.loop_config import LoopConfig
from .reference import ReferenceEngine


class CpuEngine:
    """Plain batches through ``PlainPass``, into the fitter's compiled rule on the pass's arrays (or its
    ``observe``); it takes a batch only when the step needs nothing else (no draws, criteria or trial model
    at that batch, as split-and-merge asks for at some epochs); missing entries take the masked kernel. The
    batches it does not take (projected, weighted, or with a pair that fails to factorise) go to the
    reference engine.
    A fit in lockstep with others (``fit.run.lockstep``) posts its plain in-memory batches to be stepped with
    theirs (``steps_together``)."""

    checks = None

    def __init__(self, fitter: Fitter, cfg: LoopConfig, general: ReferenceEngine):
        mixture = fitter.mixture
        self.fitter, self.general = fitter, general
        self.plain = PlainPass(mixture.dim, mixture.n_components, cfg.dtype, TABLE["fused"].max_pairs["cpu"])
        self.in_place = not fitter.samples_assignments  # the plain pass will read the batches where they lie
        self.member = cfg.lockstep  # the fits this one steps with (``fit.run.lockstep``), or None
        self.ensemble = EnsemblePass(mixture.dim, mixture.n_components, cfg.dtype) if self.member else None

    def step(self, batch: Batch, epoch: int, number: int, uniforms: torch.Tensor | None) -> None:
        fitter = self.fitter
        plain = uniforms is None and not fitter.wants_criteria and fitter.trial_mixture is None
        if plain and self.member is not None and isinstance(fitter.compiled, ArrayRule) and batch.in_memory:
            self.member.step(StepRequest(self, batch, epoch, number, steps_together))  # with the other fits' steps
            return
        self.step_alone(batch, epoch, number, uniforms)

    def step_alone(self, batch: Batch, epoch: int, number: int, uniforms: torch.Tensor | None) -> None:
        """The step of this fit's batch by itself."""
        fitter = self.fitter
        if uniforms is None and not fitter.wants_criteria and fitter.trial_mixture is None:
            rule = fitter.compiled
            if isinstance(rule, ArrayRule):  # the pass's arrays, no tensor made
                sums = self.plain.sums(batch, *rule.arrays())
                if sums is not None:  # of a plain batch of points, never empty
                    rule.observe_sums(*sums)
                    return
            else:
                stats = self.plain.statistics(batch, fitter.mixture, fitter.reads_batch_loglik)
                if stats is not None:
                    if deferred_checks.positive_weight(stats.n_points):
                        fitter.observe(stats)
                    return
        self.general.step(batch, epoch, number, uniforms)

    def restart(self) -> None:
        return None


def engine(fitter: Fitter, cfg: LoopConfig, general: ReferenceEngine) -> CpuEngine | None:
    """The CPU's engine where the fit can take it: on the CPU with the fused kernel, one process, no
    selection or background."""
    if cfg.device.type != "cpu" or choose_backend(cfg.backend, None, cfg.device) != "fused" or cfg.group.parallel:
        return None
    if cfg.selection is not None or background_of(fitter) is not None:
        return None
    return CpuEngine(fitter, cfg, general)


def steps_together(requests: list[StepRequest]) -> list[BaseException | None]:
    """Every posted step: the fits' batches in one ensemble pass (``EnsemblePass``), then their updates in
    one compiled call (``ArrayRule.update_together``; fits of mixed rules one call a fit); a fit whose batch
    cannot join the pass (of another size or data; a pair that did not factorise) steps alone.
    Each fit's error (or None), so that one fit's failure is its own."""
    rules: list[ArrayRule] = [request.engine.fitter.compiled for request in requests]
    ensemble, done = requests[0].engine.ensemble, None
    if ensemble is not None and len(requests) > 1:  # one fit left steps alone
        stacked = tuple(np.stack([rule.arrays()[i] for rule in rules]) for i in range(3))
        places = [request.batch.in_memory for request in requests]  # each a batch's rows: ``step`` posts no other
        done = ensemble.sums(places, *stacked)
    failed = np.zeros(len(requests), np.int64) if done is None else done[1]
    errors: list[BaseException | None] = [None] * len(requests)
    for s, request in enumerate(requests):
        if done is None or failed[s] >= 0:  # the plain pass, or the general one, which retries or names a pair
            errors[s] = caught(request.engine.step_alone, request.batch, request.epoch, request.number, None)
    if done is None or not (joined := [s for s in range(len(requests)) if failed[s] < 0]):
        return errors
    n, sums = done[0], done[2:] if len(joined) == len(requests) else tuple(a[joined] for a in done[2:])
    forms = {type(rules[s]) for s in joined}
    if len(forms) == 1:  # one compiled call for them all
        forms.pop().update_together([rules[s] for s in joined], n, sums)
        return errors
    for at, s in enumerate(joined):
        errors[s] = caught(rules[s].observe_sums, n, *(a[at] for a in sums))
    return errors
