"""The CUDA engine: minibatch steps replayed as CUDA graphs, one launch a batch instead of about a hundred.

A minibatch step on a GPU is the statistics pass's kernels and the float64 update's small torch ops (online
EM's is one Triton kernel there, SGD's two: ``rules.online_em_triton``, ``rules.sgd_triton``), each launched
from Python in a few microseconds; at the paper's batch of 500 the launches, not the arithmetic, set the
pace. A CUDA graph (``torch.cuda.CUDAGraph``) records the step's kernels once and replays them all with one
call, which asks three things of the step:

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

Fits in lockstep (``fit.run.lockstep``: restarts, a grid cell's seeds) share one replayed step,
``GraphedEnsemble``: one fit at batch 500 leaves a GPU mostly idle, and F fits' steps one after another
cost F launches' worth of latency for little more arithmetic than one. Their batches go through one Triton
pass (``triton_pass.ensemble_statistics``), their updates through one launch of each of the rule's kernels
over the F fits, each fit's parameters in a slice of stacked static tensors.
"""

from __future__ import annotations

import torch

from ... import deferred_checks
from ...data.batching import Batch
from ...kernel.cuda_graphs import captured, warm_up
from ...kernel.dispatch import batch_statistics, choose_backend
from ...kernel.statistics import Statistics
from ...kernel.triton_pass import ensemble_statistics
from ..fitters import Fitter
from ..rules.online_em_graphed import GraphedOnlineEM
from ..rules.sgd_graphed import GraphedAdam
from ..run.lockstep import StepRequest, caught
from ..run.loop_config import LoopConfig
from .reference import ReferenceEngine


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
        bind_static(self.rule, self.live)

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


def bind_static(rule, live: list[torch.Tensor]) -> None:
    """Bind ``rule``'s fitter to the static tensors ``live``, copying its current ones into them, where it
    holds others (an ordinary step's, a restored state's, another replayed step's)."""
    current = rule.live_tensors()
    if any(mine is not theirs for mine, theirs in zip(live, current)):
        for mine, theirs in zip(live, current):
            if mine is not theirs:
                mine.copy_(theirs)
        rule.bind(live)


# The forms of the rules a replayed step takes, by the rule's name (``Fitter.rule``).
GRAPHED: dict[str, type[GraphedOnlineEM] | type[GraphedAdam]] = {"online_em": GraphedOnlineEM, "sgd": GraphedAdam}


class CudaEngine:
    """Steps of whole batches replayed (``GraphedStep``); the batches it does not take (another size or
    kind than its buffers', an epoch run again with every test made) go to the reference engine. A fit in
    lockstep with others (``fit.run.lockstep``) posts its plain, unweighted batches to be stepped with theirs
    (``steps_together``)."""

    in_place = False

    def __init__(self, rule, cfg: LoopConfig, general: ReferenceEngine):
        self.graphed = GraphedStep(rule, cfg.device, cfg.backend)
        self.general = general
        self.checks = self.graphed.checks
        self.member = cfg.lockstep  # the fits this one steps with (``fit.run.lockstep``), or None

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
    their updates in one launch of each of the rule's kernels over the F fits (``rules.*_triton``; each fit's
    update in turn where torch's update runs); all captured as one CUDA graph on CUDA. Each fit's
    parameters live in a slice of stacked static tensors (``bind_static``), its deferred tests go to its own
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
        # fits' rules are of one form, ``steps_together``, on one device, which decides ``forms.triton_form``);
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
            bind_static(rule, self.views[f])
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
    if cfg.selection is not None or fitter.trial_mixture is not None or fitter.wants_criteria:
        return None
    form = GRAPHED.get(fitter.rule) if fitter.rule is not None else None
    if form is None or not form.accepts(fitter):  # type: ignore[arg-type]
        return None
    return CudaEngine(form(fitter), cfg, general)  # type: ignore[arg-type]
