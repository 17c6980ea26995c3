"""The CPU's engine: plain batches through the fused kernel's pass (``kernel.fused.PlainPass``), into the
compiled (numba) forms of the minibatch rules (``cpu_rules``), on the pass's arrays.

A minibatch step's float64 update written as torch calls is dozens of small operations whose dispatch costs
several times the arithmetic; compiled, each rule is one call. Fed the pass's sums as arrays and keeping the
fitter's parameters as arrays until a tensor is asked for (``MinibatchEM.hold``, ``SGD.hold``), a step
makes no tensor at all. A fitter on the CPU runs its rule's compiled form at every update, whichever pass
made the statistics, so that a fit's arithmetic does not depend on which batches the plain pass took.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import numpy as np
import torch

from ... import deferred_checks
from ...data.batching import Batch
from ...kernel import TABLE
from ...kernel.dispatch import choose_backend
from ...kernel.ensemble_pass import EnsemblePass
from ...kernel.fused import PlainPass
from ...kernel.statistics import Statistics
from ..background_fit import background_of
from ..fitters import Fitter
from ..lockstep import StepRequest, caught
from ..loop_config import LoopConfig
from .reference import ReferenceEngine

if TYPE_CHECKING:
    from ..online_em import MinibatchEM
    from ..sgd import SGD


class ArrayRule:
    """A compiled rule bound to its fitter: ``observe_sums`` takes a batch's sums as the pass's arrays (n
    points, q, U, UU, P), ``observe`` a batch's ``Statistics`` (made arrays), ``arrays`` is the mixture the
    pass reads; ``views`` keeps the arrays of the tensors that live from step to step."""

    def __init__(self, fitter):
        from . import cpu_rules

        self.fitter, self._rules, self.views = fitter, cpu_rules, cpu_rules.ArrayViews()

    def observe(self, stats: Statistics) -> None:
        self.observe_sums(*self._rules.sums_of(stats))

    def observe_sums(self, n: float, q, U, UU, P) -> None:
        raise NotImplementedError

    def arrays(self) -> tuple:
        raise NotImplementedError


class OnlineEMArrays(ArrayRule):
    """Online EM's centred update (``updates.online_em_update``, then ``regularised``) as one compiled call
    (``cpu_rules.online_em_step``) on a ``MinibatchEM``'s arrays."""

    fitter: MinibatchEM

    @staticmethod
    def accepts(fitter: MinibatchEM) -> bool:
        return not fitter.naive  # the paper's eq. 7 is kept for study, in torch alone

    def arrays(self) -> tuple:
        return self.fitter.e_step_arrays()

    def observe_sums(self, n: float, q, U, UU, P) -> None:
        f = self.fitter
        held = self._rules.online_em_step(
            f.state_arrays(), n, q, U, UU, P, f.next_step_size(), f.w, f.fixed_parameters, f.data_size, self.views
        )
        f.hold(*held)


class AdamArrays(ArrayRule):
    """SGD's gradient (``CholeskyParameters.loss_gradients``) and Adam's step as one compiled call
    (``cpu_rules.sgd_step``) on an ``SGD``'s parameters, updated in place."""

    fitter: SGD

    @staticmethod
    def accepts(fitter: SGD) -> bool:
        return True

    def arrays(self) -> tuple:
        return self.fitter.mixture_arrays()

    def observe_sums(self, n: float, q, U, UU, P) -> None:
        f = self.fitter
        f.hold(self._rules.sgd_step(f.params, f.optimizer, n, q, U, UU, P, f.w, self.views))


# The compiled forms of the rules, by the rule's name (``Fitter.rule``).
RULES: dict[str, type[OnlineEMArrays] | type[AdamArrays]] = {"online_em": OnlineEMArrays, "sgd": AdamArrays}


def compiled_rule(fitter: Fitter, device: torch.device):
    """``fitter``'s rule compiled, where its parameters are on the CPU and numba is installed."""
    if device.type != "cpu" or importlib.util.find_spec("numba") is None:
        return None
    rule = RULES.get(fitter.rule) if fitter.rule is not None else None
    return rule(fitter) if rule is not None and rule.accepts(fitter) else None  # type: ignore[arg-type]


class CpuEngine:
    """Plain batches through ``PlainPass``, into the fitter's compiled rule on the pass's arrays (or its
    ``observe``); it takes a batch only when the step needs nothing else (no draws, criteria or trial model
    at that batch, as split-and-merge asks for at some epochs); missing entries take the masked kernel. The
    batches it does not take (projected, weighted, or with a pair that fails to factorise) go to the
    reference engine.
    A fit in lockstep with others (``fit.lockstep``) posts its plain in-memory batches to be stepped with
    theirs (``steps_together``)."""

    checks = None

    def __init__(self, fitter: Fitter, cfg: LoopConfig, general: ReferenceEngine):
        mixture = fitter.mixture
        self.fitter, self.general = fitter, general
        self.plain = PlainPass(mixture.dim, mixture.n_components, cfg.dtype, TABLE["fused"].max_pairs["cpu"])
        self.in_place = not fitter.samples_assignments  # the plain pass will read the batches where they lie
        self.member = cfg.lockstep  # the fits this one steps with (``fit.lockstep``), or None
        self.ensemble = EnsemblePass(mixture.dim, mixture.n_components, cfg.dtype) if self.member else None

    def step(self, batch: Batch, epoch: int, number: int, uniforms: torch.Tensor | None) -> None:
        fitter = self.fitter
        plain = uniforms is None and not fitter.wants_criteria and fitter.shadow is None
        if plain and self.member is not None and isinstance(fitter.compiled, ArrayRule) and batch.in_memory:
            self.member.step(StepRequest(self, batch, epoch, number, steps_together))  # with the other fits' steps
            return
        self.step_alone(batch, epoch, number, uniforms)

    def step_alone(self, batch: Batch, epoch: int, number: int, uniforms: torch.Tensor | None) -> None:
        """The step of this fit's batch by itself."""
        fitter = self.fitter
        if uniforms is None and not fitter.wants_criteria and fitter.shadow is None:
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
    one compiled call (``cpu_rules.online_em_steps``, ``cpu_rules.sgd_steps``; fits of mixed rules one call
    a fit); a fit whose batch cannot join the pass (of another size or data; a pair that did not factorise)
    steps alone. Each fit's error (or None), so that one fit's failure is its own."""
    from . import cpu_rules

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
    if all(isinstance(rules[s], OnlineEMArrays) for s in joined):
        fitters = [rules[s].fitter for s in joined]
        fits = [
            (f.next_step_size(), f.w, f.fixed_parameters, f.data_size, rules[s].views) for f, s in zip(fitters, joined)
        ]
        held = cpu_rules.online_em_steps([f.state_arrays() for f in fitters], n, sums, fits)
        for fitter, new in zip(fitters, held):
            fitter.hold(*new)
        return errors
    if all(isinstance(rules[s], AdamArrays) for s in joined):
        sgds = [rules[s].fitter for s in joined]
        adams = [(f.params, f.optimizer, f.w, rules[s].views) for f, s in zip(sgds, joined)]
        for sgd, mixture in zip(sgds, cpu_rules.sgd_steps(adams, n, sums)):
            sgd.hold(mixture)
        return errors
    for at, s in enumerate(joined):
        errors[s] = caught(rules[s].observe_sums, n, *(a[at] for a in sums))
    return errors
