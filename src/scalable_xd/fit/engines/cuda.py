"""The CUDA engine: minibatch steps replayed as CUDA graphs, one launch a batch instead of about a hundred.

A minibatch step on a GPU is the statistics pass's kernels and the float64 update's small torch ops (online
EM's is one Triton kernel there, SGD's two: ``cuda_rules``), each launched from Python in a few microseconds; at
the paper's batch of 500 the launches, not the arithmetic, set the pace. A CUDA graph
(``torch.cuda.CUDAGraph``) records the step's kernels once and replays them all
with one call, which asks three things of the step:

* its inputs sit in fixed ("static") buffers: each batch is copied into them, and the step size (Adam's
  bias-corrected rate for SGD) is a scalar on the device that the host sets before each replay
  (``prepare_step``);
* it writes its results into the tensors it reads (``step_in_place``), so that one replay's outputs are
  the next one's inputs;
* it never waits for the device: its per-batch tests are deferred to the epoch's end (``deferred_checks``)
  and write to a flag that lives as long as the graph.

``GraphedStep`` is that step. On CUDA it runs the first batch eagerly on a side stream (Triton compiles its
kernels, the allocator settles), captures the second and replays the graph from then on; a batch of
another size (an epoch's last) takes the reference engine's step, whose results are copied into the static
buffers before the next replay; after an epoch run again from a restored state the step is captured anew.
On the CPU it runs the same static-buffer step eagerly, which is how the tests check it against the
ordinary step here. A capture that CUDA refuses is said in a warning, and the fit goes on with uncaptured
steps. The rules' forms that a step replays (``GRAPHED``) take the fitter's host-side part of a step
(``prepare_step``) apart from its device-side part (``step_in_place``).

Fits in lockstep (``fit.lockstep``: restarts, a grid cell's seeds) share one replayed step,
``GraphedEnsemble``: one fit at batch 500 leaves a GPU mostly idle, and F fits' steps one after another
cost F launches' worth of latency for little more arithmetic than one. Their batches go through one Triton
pass (``triton_pass.ensemble_statistics``), their updates through one launch of each of the rule's kernels
over the F fits, each fit's parameters in a slice of stacked static tensors.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from ... import deferred_checks
from ...data.batching import Batch
from ...kernel.dispatch import batch_statistics, choose_backend
from ...kernel.statistics import Statistics
from ...kernel.triton_pass import ensemble_statistics
from ...mixture import Mixture
from ..fitters import Fitter
from ..lockstep import StepRequest, caught
from ..loop_config import LoopConfig
from ..updates import FixedParameters, online_em_update, regularised, share_weights
from .reference import ReferenceEngine

if TYPE_CHECKING:
    from ..online_em import MinibatchEM
    from ..sgd import SGD

log = logging.getLogger("scalable_xd.fit")


class Replayed:
    """A step's body (``_body``) on static buffers: on the CPU run as it is; on CUDA run eagerly once on a
    side stream (Triton compiles its kernels, the allocator settles), captured at the next step and
    replayed from then on. A capture that CUDA refuses is said in a warning, and the steps run uncaptured."""

    what = "the minibatch step"

    def __init__(self, device: torch.device):
        self.device = device
        self.capturing = device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.warm = False
        self.replays = 0

    def _body(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        """The body, run, replayed, or run to warm up or captured and replayed, as the step's turn says."""
        if not self.capturing:
            self._body()
        elif self.graph is not None:
            self.graph.replay()
            self.replays += 1
        elif not self.warm:
            warm_up(self.device, self._body)
            self.warm = True
        else:
            graph = captured(self._body, self.what)
            if graph is None:
                self.capturing = False
                self._body()
                return
            self.graph = graph
            graph.replay()
            self.replays += 1

    def forget(self) -> None:
        """Drop the captured graph, after a fitter's state was loaded anew (an epoch run again): the graph may
        read tensors that loading replaced. The next step captures again."""
        self.graph = None


class GraphedStep(Replayed):
    """One fit's minibatch steps on static buffers, captured and replayed as a CUDA graph on CUDA, by
    ``rule``, a form of the fitter's rule in ``GRAPHED``."""

    def __init__(self, rule, device: torch.device, backend: str):
        super().__init__(device)
        self.rule, self.backend = rule, backend
        self.checks = deferred_checks.DeferredChecks(device)  # the flag the captured step writes to
        self.layout: tuple[int, bool, bool] | None = None  # (batch size, weighted, drawn): the static buffers
        self.inputs: dict[str, torch.Tensor | None] = {}
        self.live: list[torch.Tensor] = []  # the rule's tensors the step reads and writes, static

    def takes(self, batch) -> bool:
        """Whether a replayed step can take the batch: checks deferred to this step's flag (not in an epoch
        run again with every test made), no projections or missing entries, noise as matrices."""
        plain = batch.R is None and batch.observed is None and isinstance(batch.S, torch.Tensor)  # not noise mixtures
        return plain and deferred_checks.active() is self.checks

    def step(self, batch, uniforms) -> bool:
        """Take the batch's step; False where the ordinary step must take it instead: a batch the replayed
        step does not take (``takes``), or one of another size or kind than the static buffers'."""
        if not self.takes(batch):
            return False
        layout = (batch.size, batch.weights is not None, uniforms is not None)
        if self.layout is None:
            self.layout = layout
            self.inputs = {
                "x": torch.empty_like(batch.x),
                "S": torch.empty_like(batch.S),
                "weights": None if batch.weights is None else torch.empty_like(batch.weights),
                "uniforms": None if uniforms is None else torch.empty_like(uniforms),
            }
        elif layout != self.layout:
            return False
        self._load(batch, uniforms)
        self.rule.prepare_step()
        self.run()
        return True

    def _load(self, batch, uniforms) -> None:
        """Copy the batch into the static inputs, and the fitter's tensors into the static ones where an
        ordinary step (or a restored state) replaced them."""
        for name, value in (("x", batch.x), ("S", batch.S), ("weights", batch.weights), ("uniforms", uniforms)):
            target = self.inputs[name]
            if value is not None and target is not None:  # the layout says both are given or neither
                target.copy_(value)
        if not self.live:
            self.live = [t.clone() for t in self.rule.live_tensors()]
        take_over(self.rule, self.live)

    def _body(self) -> None:
        """The step on the static buffers: the statistics pass, then the fitter's update in place."""
        inputs = self.inputs
        stats = batch_statistics(
            inputs["x"],
            inputs["S"],
            self.rule.mixture,
            backend=self.backend,
            point_weights=inputs["weights"],
            uniforms=inputs["uniforms"],
        )
        deferred_checks.positive_weight(stats.n_points)  # a batch of zero weight: noted (this step's flag)
        self.rule.step_in_place(stats)


def take_over(rule, live: list[torch.Tensor]) -> None:
    """Bind ``rule``'s fitter to the static tensors ``live``, copying its current ones into them, where it
    holds others (an ordinary step's, a restored state's, another replayed step's)."""
    current = rule.live_tensors()
    if any(mine is not theirs for mine, theirs in zip(live, current)):
        for mine, theirs in zip(live, current):
            if mine is not theirs:
                mine.copy_(theirs)
        rule.bind(live)


class GraphedOnlineEM:
    """Online EM's step (``updates.online_em_update``, then ``regularised``; less truncation) as a replayed
    step takes it, on a ``MinibatchEM``: the update one Triton kernel where triton is installed
    (``cuda_rules``), torch's in place elsewhere."""

    READS = slice(3, 6)  # which of ``live_tensors`` the statistics pass reads: the E-step mixture's

    @staticmethod
    def accepts(fitter: MinibatchEM) -> bool:
        """Not the naive update (kept for study) nor truncation (its restarts ask the host)."""
        return not fitter.naive and fitter.truncation is None

    def __init__(self, fitter: MinibatchEM):
        self.fitter = fitter
        self.kernel = triton_rules(fitter.state.means.device)
        self._step: torch.Tensor | None = None  # the step size on the device (``prepare_step``)
        self._constants: torch.Tensor | None = None  # (the prior's data size or 0, float64's tiny)
        self._prior_size: float | None = None  # what ``_constants`` holds of it

    @property
    def mixture(self) -> Mixture:
        return self.fitter.mixture

    def live_tensors(self) -> list[torch.Tensor]:
        """The tensors a step reads and writes: the running state's and the E-step mixture's."""
        return [*self.fitter.state.tensors(), *self.fitter.mixture.tensors()]

    def bind(self, tensors: list[torch.Tensor]) -> None:
        self.fitter.bind(Mixture(*tensors[:3]), Mixture(*tensors[3:]))

    def prepare_step(self) -> None:
        """The host's part of the next step: its step size (and the prior's data size, where it changed),
        filled into scalars on the device (filled, not copied: no wait)."""
        fitter, device = self.fitter, self.fitter.state.means.device
        if self._step is None:
            self._step = torch.zeros((), dtype=torch.float64, device=device)
            self._constants = torch.full((2,), torch.finfo(torch.float64).tiny, dtype=torch.float64, device=device)
        self._step.fill_(fitter.next_step_size())
        fitter.n_updates += 1
        size = 0.0 if fitter.data_size is None or fitter.w is None else float(fitter.data_size)  # 0: no prior
        if size != self._prior_size:
            self._constants[0].fill_(size)  # type: ignore[index]
            self._prior_size = size

    def step_in_place(self, stats: Statistics) -> None:
        """The update written into ``live_tensors``, asking the host nothing."""
        fitter, step = self.fitter, self._step
        if step is None:
            raise RuntimeError("prepare_step sets the step size on the device before step_in_place")
        fixed = fitter.fixed_parameters
        if self.kernel is not None:
            e_step = fitter.mixture
            suspect = self.kernel.online_em_step_in_place(
                fitter.state, e_step, stats, step, fitter.w, fixed, self._constants
            )
            checks = deferred_checks.active()
            if checks is None:
                raise RuntimeError("the graphed step runs with its checks deferred (GraphedStep)")
            checks.note(suspect)  # a covariance rounding left indefinite: the epoch runs again
            self.share_fixed_weights()
            return
        state = online_em_update(fitter.state, stats.double(), step, fitter.w, fixed, fitter.data_size)
        e_step = regularised(state, fitter.w, fitter.fixed, fitter.data_size)
        for live, new in zip(self.live_tensors(), [*state.tensors(), *e_step.tensors()]):
            live.copy_(new)

    def share_fixed_weights(self) -> None:
        """After the kernel's update, where any parameter is fixed, the E-step's weights shared and the fixed
        ones restored, as ``regularised`` does (a host test made once: ``FixedParameters.any``)."""
        fitter, fixed = self.fitter, self.fitter.fixed_parameters
        if fixed.any():
            fitter.mixture.weights.copy_(share_weights(fitter.state.weights, fixed.weight_values, fixed.weights))

    def device_scalars(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step size and constants ``prepare_step`` sets on the device, for a step taken with others."""
        if self._step is None or self._constants is None:
            raise RuntimeError("prepare_step sets the step size on the device first")
        return self._step, self._constants

    @staticmethod
    def update_together(kernel: ModuleType, rules: list[GraphedOnlineEM], live: list[torch.Tensor]):
        """Online EM's update of F fits in one launch of its kernel (``cuda_rules``), their tensors ``live``
        (each of ``live_tensors`` stacked): a function of their stacked sums and their engines, which notes
        each fit's suspect covariances in its own flag."""
        fitters = [rule.fitter for rule in rules]
        fixed = stacked_fixed([fitter.fixed_parameters for fitter in fitters])
        dim = live[1].shape[-1]
        w = torch.stack([f.w if f.w is not None else live[1].new_zeros(dim) for f in fitters])

        def update(stacked: Statistics, engines: list[CudaEngine]) -> None:
            scalars = [rule.device_scalars() for rule in rules]
            suspect = kernel.online_em_step_in_place(
                Mixture(*live[:3]),
                Mixture(*live[3:]),
                stacked,
                torch.stack([step for step, _ in scalars]),
                w,
                fixed,
                torch.stack([constants for _, constants in scalars]),
            )
            for f, (engine, rule) in enumerate(zip(engines, rules)):
                engine.checks.note(suspect[f])  # a covariance rounding left indefinite: its epoch runs again
                rule.share_fixed_weights()

        return update


class GraphedAdam:
    """SGD's gradient and Adam's step as a replayed step takes them, on an ``SGD``: two Triton kernels where
    triton is installed (``cuda_rules``), torch's in place elsewhere; Adam's bias corrections set on the
    device by the host before each step (``Adam.step_on_device``)."""

    @staticmethod
    def accepts(fitter: SGD) -> bool:
        """Not with fixed weights (the free ones are selected by a mask, asking the host)."""
        return not fitter.params.fixed.has_fixed_weights

    READS = slice(0, 3)  # which of ``live_tensors`` the statistics pass reads: the mixture's

    def __init__(self, fitter: SGD):
        self.fitter = fitter
        self.kernel = triton_rules(fitter.mixture.means.device)
        self._adam: torch.Tensor | None = None  # (step size, sqrt(1 - beta2^t), beta1, beta2, eps) on the device
        means = fitter.mixture.means
        self.w = means.new_ones(means.shape[-1]) if fitter.w is None else fitter.w  # W's diagonal, 1 for none
        self.penalised = torch.tensor(fitter.w is not None, dtype=torch.int8, device=means.device)

    @property
    def mixture(self) -> Mixture:
        return self.fitter.mixture

    def live_tensors(self) -> list[torch.Tensor]:
        """The tensors a step reads and writes: the mixture's, the parameters' (logits, means, raw factors)
        and their scale, Adam's moments (first, second) and the fixed components' initial means and
        covariances."""
        params, adam = self.fitter.params, self.fitter.optimizer
        initial = params.initial
        return [
            *self.fitter.mixture.tensors(),
            *params.tensors(),
            params.scale,
            *adam.exp_avg,
            *adam.exp_avg_sq,
            initial.means,
            initial.covariances,
        ]

    def bind(self, tensors: list[torch.Tensor]) -> None:
        fitter = self.fitter
        params, adam = fitter.params, fitter.optimizer
        fitter.mixture = Mixture(*tensors[:3])
        params.logits, params.means, params.raw, params.scale = tensors[3:7]
        adam.params = params.tensors()
        adam.exp_avg, adam.exp_avg_sq = list(tensors[7:10]), list(tensors[10:13])
        params.initial = Mixture(params.initial.weights, *tensors[13:15])

    def prepare_step(self) -> None:
        """The host's part of the next step: Adam's step count and corrections, into the device."""
        optimizer = self.fitter.optimizer
        if self._adam is None:
            self._adam = torch.tensor(
                [0.0, 1.0, *optimizer.betas, optimizer.eps],
                dtype=torch.float64,
                device=self.fitter.mixture.means.device,
            )
        optimizer.steps += 1
        for slot, value in zip(self._adam, optimizer.corrections()):
            slot.fill_(value)

    def device_scalars(self) -> torch.Tensor:
        """Adam's constants that ``prepare_step`` sets on the device, for a step taken with others."""
        if self._adam is None:
            raise RuntimeError("prepare_step sets Adam's corrections on the device first")
        return self._adam

    def step_in_place(self, stats: Statistics) -> None:
        """The Adam step, its mixture written into ``live_tensors``, asking the host nothing."""
        adam = self.device_scalars()
        fitter, params, optimizer = self.fitter, self.fitter.params, self.fitter.optimizer
        if self.kernel is not None:
            self.kernel.sgd_step_in_place(
                tuple(params.tensors()),
                params.scale,
                (tuple(optimizer.exp_avg), tuple(optimizer.exp_avg_sq)),
                stats,
                adam[None],
                self.w,
                self.penalised,
                params.fixed,
                (params.initial.means, params.initial.covariances),
                fitter.mixture,
            )
            return
        optimizer.step_on_device(params.loss_gradients(stats.double(), fitter.w), adam)
        for live, new in zip(fitter.mixture.tensors(), params.mixture().tensors()):
            live.copy_(new)

    @staticmethod
    def update_together(kernel: ModuleType, rules: list[GraphedAdam], live: list[torch.Tensor]):
        """SGD's step of F fits in one launch of each kernel (``cuda_rules``), their tensors ``live`` (each
        of ``live_tensors`` stacked): a function of their stacked sums and their engines."""
        fixed = stacked_fixed([rule.fitter.params.fixed for rule in rules])
        w = torch.stack([rule.w for rule in rules])
        penalised = torch.stack([rule.penalised for rule in rules])

        def update(stacked: Statistics, engines: list[CudaEngine]) -> None:
            kernel.sgd_step_in_place(
                tuple(live[3:6]),
                live[6],
                (tuple(live[7:10]), tuple(live[10:13])),
                stacked,
                torch.stack([rule.device_scalars() for rule in rules]),
                w,
                penalised,
                fixed,
                (live[13], live[14]),
                Mixture(*live[:3]),
            )

        return update


def stacked_fixed(fixes: list[FixedParameters]) -> FixedParameters:
    """F fits' fixed parameters with a leading fit axis."""
    return FixedParameters(
        *(torch.stack([getattr(f, field.name) for f in fixes]) for field in dataclasses.fields(FixedParameters))
    )


# The forms of the rules a replayed step takes, by the rule's name (``Fitter.rule``).
GRAPHED: dict[str, type[GraphedOnlineEM] | type[GraphedAdam]] = {"online_em": GraphedOnlineEM, "sgd": GraphedAdam}


def triton_rules(device: torch.device) -> ModuleType | None:
    """The Triton forms of the rules (``cuda_rules``) where they run: on CUDA with triton installed; None
    elsewhere, where torch's run. Read as each step's form is made: tests replace it to run them on the
    CPU through Triton's interpreter."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from . import cuda_rules

    return cuda_rules


class CudaEngine:
    """Steps of whole batches replayed (``GraphedStep``); the batches it does not take (another size or
    kind than its buffers', an epoch run again with every test made) go to the reference engine. A fit in
    lockstep with others (``fit.lockstep``) posts its plain, unweighted batches to be stepped with theirs
    (``steps_together``)."""

    in_place = False

    def __init__(self, rule, cfg: LoopConfig, general: ReferenceEngine):
        self.graphed = GraphedStep(rule, cfg.device, cfg.backend)
        self.general = general
        self.checks = self.graphed.checks
        self.member = cfg.lockstep  # the fits this one steps with (``fit.lockstep``), or None

    def step(self, batch: Batch, epoch: int, number: int, uniforms: torch.Tensor | None) -> None:
        if self.member is not None and uniforms is None and batch.weights is None and self.graphed.takes(batch):
            self.member.step(StepRequest(self, batch, epoch, number, steps_together))
            return
        self.step_alone(batch, epoch, number, uniforms)

    def step_alone(self, batch: Batch, epoch: int, number: int, uniforms: torch.Tensor | None) -> None:
        """The step of this fit's batch by itself."""
        if not self.graphed.step(batch, uniforms):
            self.general.step(batch, epoch, number, uniforms)

    def restart(self) -> None:
        self.graphed.forget()
        if self.member is not None:  # the ensembles' graphs may read what loading replaced
            for ensemble in self.member.lockstep.shared.get("cuda", {}).values():
                ensemble.forget()


def steps_together(requests: list[StepRequest]) -> list[BaseException | None]:
    """Every posted step: where the fits' batches are alike (one size and dtype, one rule, one mixture
    shape), one ``GraphedEnsemble`` step for all of them, kept by the lockstep for these fits and this batch
    size; else each fit's step alone. Each fit's error (or None)."""
    engines = [request.engine for request in requests]
    first, batches = engines[0], [request.batch for request in requests]
    rules = [engine.graphed.rule for engine in engines]
    alike = len(requests) > 1 and all(
        type(rule) is type(rules[0])
        and engine.graphed.backend == first.graphed.backend
        and batch.x.shape == batches[0].x.shape
        and batch.x.dtype == batches[0].x.dtype
        and rule.mixture.means.shape == rules[0].mixture.means.shape
        for rule, engine, batch in zip(rules, engines, batches)
    )
    if not alike:
        return [caught(r.engine.step_alone, r.batch, r.epoch, r.number, None) for r in requests]
    ensembles = first.member.lockstep.shared.setdefault("cuda", {})
    key = (tuple(engine.member.index for engine in engines), batches[0].size)
    ensemble = ensembles.get(key)
    if ensemble is None:  # an epoch's last, smaller batches have their own
        ensemble = ensembles[key] = GraphedEnsemble(engines, batches[0])
    error = caught(ensemble.step, batches)
    return [error] * len(requests)


class GraphedEnsemble(Replayed):
    """F fits' steps as one replayed step: their batches in one statistics pass (``triton_pass``'s
    ``ensemble_statistics`` where the fits run the triton kernel; each fit's pass in turn otherwise), then
    their updates in one launch of each of the rule's kernels over the F fits (``cuda_rules``; each fit's
    update in turn where torch's update runs); all captured as one CUDA graph on CUDA. Each fit's
    parameters live in a slice of stacked static tensors (``take_over``), its deferred tests go to its own
    flag, and its sums and update are those it would have alone (the pass's to float rounding, the
    update's to the bit)."""

    what = "the ensemble's minibatch step"

    def __init__(self, engines: list[CudaEngine], batch: Batch):
        super().__init__(engines[0].graphed.device)
        self.engines = engines
        self.rules = [engine.graphed.rule for engine in engines]
        self.backend = engines[0].graphed.backend
        self.one_pass = choose_backend(self.backend, None, self.device) == "triton"  # else each fit's in turn
        self.size = batch.size
        n_fits = len(engines)
        self.x = batch.x.new_empty((n_fits * batch.size, *batch.x.shape[1:]))
        self.S = batch.S.new_empty((n_fits * batch.size, *batch.S.shape[1:]))
        self.live = [torch.stack(tensors) for tensors in zip(*(rule.live_tensors() for rule in self.rules))]
        self.views = [[t[f] for t in self.live] for f in range(n_fits)]  # fit f's slice, made once: bound by identity
        # every fit's update in one launch of each of its rule's kernels, where the rule runs kernels (the
        # fits' rules are of one form, ``steps_together``, on one device, which decides ``triton_rules``);
        # else each fit's update in turn
        kernel = self.rules[0].kernel
        self.update = None if kernel is None else type(self.rules[0]).update_together(kernel, self.rules, self.live)

    def step(self, batches: list[Batch]) -> None:
        """Copy each fit's batch into its rows of the static inputs and its tensors into its slices, set each
        fit's scalars, and run the step."""
        n = self.size
        for f, (batch, rule) in enumerate(zip(batches, self.rules)):
            self.x[f * n : (f + 1) * n].copy_(batch.x)
            self.S[f * n : (f + 1) * n].copy_(batch.S)
            take_over(rule, self.views[f])
            rule.prepare_step()
        self.run()

    def _body(self) -> None:
        """The fits' pass, then their updates in place, each fit's tests noted in its own flag."""
        stacked = self._statistics()
        if self.update is not None:
            self.update(stacked, self.engines)
            return
        for f, (engine, rule) in enumerate(zip(self.engines, self.rules)):
            with deferred_checks.noting(engine.checks):
                rule.step_in_place(fit_of(stacked, f))

    def _statistics(self) -> Statistics:
        """Every fit's sums, with a leading fit axis: one pass where the fits run the triton kernel, else
        each fit's pass in turn, stacked."""
        if self.one_pass:
            stacked, failed = ensemble_statistics(self.x, self.S, *self.live[self.rules[0].READS])
            for f, engine in enumerate(self.engines):
                engine.checks.note(failed[f])
            return stacked
        fits, n = [], self.size
        for f, (engine, rule) in enumerate(zip(self.engines, self.rules)):
            with deferred_checks.noting(engine.checks):
                rows = slice(f * n, (f + 1) * n)
                fits.append(batch_statistics(self.x[rows], self.S[rows], rule.mixture, backend=self.backend))
        q, U, UU, P, loglik = (torch.stack([getattr(stats, name) for stats in fits]) for name in STACKED)
        return Statistics(n, q, U, UU, P, loglik)


STACKED = ("q", "U", "UU", "P", "loglik")  # the sums an ensemble's pass gives, with a leading fit axis


def fit_of(stacked: Statistics, f: int) -> Statistics:
    """Fit ``f``'s sums from sums with a leading fit axis."""
    loglik = None if stacked.loglik is None else stacked.loglik[f]
    return Statistics(stacked.n_points, stacked.q[f], stacked.U[f], stacked.UU[f], stacked.P[f], loglik)


def engine(fitter: Fitter, cfg: LoopConfig, general: ReferenceEngine) -> CudaEngine | None:
    """The CUDA engine where the fit can take it: graphed steps asked for, checks deferred (not re-run at
    every batch, nor interleaved with mid-epoch checkpoints), one process, no selection (its imputed points
    are drawn on the host), and a rule with a form in ``GRAPHED`` that takes the fitter (not under
    averaging, split-and-merge or a background, whose fitters name no rule)."""
    if not (cfg.graph_steps and cfg.defer_checks) or cfg.checkpoint_every or cfg.group.parallel:
        return None
    if cfg.selection is not None or fitter.shadow is not None or fitter.wants_criteria:
        return None
    form = GRAPHED.get(fitter.rule) if fitter.rule is not None else None
    if form is None or not form.accepts(fitter):  # type: ignore[arg-type]
        return None
    return CudaEngine(form(fitter), cfg, general)  # type: ignore[arg-type]


def compiled_rule(fitter: Fitter, device: torch.device) -> None:
    """None: on CUDA a fitter's every update outside the replayed steps is its torch rule."""
    return None


def warm_up(device: torch.device, body) -> None:
    """``body()`` eagerly on a side stream, as CUDA graphs ask of a first run before a capture: kernels
    compile, the allocator's pools settle."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        body()
    current.wait_stream(side)


def captured(body, what: str) -> torch.cuda.CUDAGraph | None:
    """``body``'s kernels captured as a CUDA graph (captured, not run), or None where CUDA refuses the
    capture, which a warning naming ``what`` says: the caller then runs its steps uncaptured."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            body()
    except RuntimeError as err:
        log.warning("%s could not be captured as a CUDA graph (%s): its steps run uncaptured", what, err)
        return None
    return graph
