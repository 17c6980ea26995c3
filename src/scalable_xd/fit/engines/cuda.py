"""The CUDA engine: minibatch steps replayed as CUDA graphs, one launch a batch instead of about a hundred.

A minibatch step on a GPU is the statistics pass's kernels and the float64 update's small torch ops (online
EM's is one Triton kernel there, ``cuda_rules``), each launched from Python in a few microseconds; at
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
"""

from __future__ import annotations

import importlib.util
import logging
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from ... import deferred_checks
from ...data.batching import Batch
from ...kernel.dispatch import batch_statistics
from ...kernel.statistics import Statistics
from ...mixture import Mixture
from ..fitters import Fitter
from ..loop_config import LoopConfig
from ..updates import online_em_update, regularised, share_weights
from .reference import ReferenceEngine

if TYPE_CHECKING:
    from ..online_em import MinibatchEM
    from ..sgd import SGD

log = logging.getLogger("scalable_xd.fit")


class GraphedStep:
    """One fit's minibatch steps on static buffers, captured and replayed as a CUDA graph on CUDA, by
    ``rule``, a form of the fitter's rule in ``GRAPHED``."""

    def __init__(self, rule, device: torch.device, backend: str):
        self.rule = rule
        self.device, self.backend = device, backend
        self.checks = deferred_checks.DeferredChecks(device)  # the flag the captured step writes to
        self.capturing = device.type == "cuda"
        self.layout: tuple[int, bool, bool] | None = None  # (batch size, weighted, drawn): the static buffers
        self.inputs: dict[str, torch.Tensor | None] = {}
        self.live: list[torch.Tensor] = []  # the rule's tensors the step reads and writes, static
        self.graph: torch.cuda.CUDAGraph | None = None
        self.warm = False
        self.replays = 0

    def step(self, batch, uniforms) -> bool:
        """Take the batch's step; False where the ordinary step must take it instead: checks not deferred
        to this step's flag (an epoch run again with every test made), projections or missing entries,
        or a batch of another size or kind than the static buffers'."""
        plain = batch.R is None and batch.observed is None and isinstance(batch.S, torch.Tensor)  # not noise mixtures
        if deferred_checks.active() is not self.checks or not plain:
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
        if not self.capturing:
            self._body()
        elif self.graph is not None:
            self.graph.replay()
            self.replays += 1
        elif not self.warm:
            self._warm_up()
        else:
            self._capture_and_replay()
        return True

    def forget(self) -> None:
        """Drop the captured graph, after the fitter's state was loaded anew (an epoch run again): the graph
        may read tensors that loading replaced, beside ``live_tensors``. The next full batch captures again."""
        self.graph = None

    def _load(self, batch, uniforms) -> None:
        """Copy the batch into the static inputs, and the fitter's tensors into the static ones where an
        ordinary step (or a restored state) replaced them."""
        for name, value in (("x", batch.x), ("S", batch.S), ("weights", batch.weights), ("uniforms", uniforms)):
            target = self.inputs[name]
            if value is not None and target is not None:  # the layout says both are given or neither
                target.copy_(value)
        current = self.rule.live_tensors()
        if not self.live:
            self.live = [t.clone() for t in current]
        if any(mine is not theirs for mine, theirs in zip(self.live, current)):
            for mine, theirs in zip(self.live, current):
                if mine is not theirs:
                    mine.copy_(theirs)
            self.rule.bind(self.live)

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

    def _warm_up(self) -> None:
        warm_up(self.device, self._body)
        self.warm = True

    def _capture_and_replay(self) -> None:
        graph = captured(self._body, "the minibatch step")
        if graph is None:
            self.capturing = False
            self._body()
            return
        self.graph = graph
        graph.replay()
        self.replays += 1


class GraphedOnlineEM:
    """Online EM's step (``updates.online_em_update``, then ``regularised``; less truncation) as a replayed
    step takes it, on a ``MinibatchEM``: the update one Triton kernel where triton is installed
    (``cuda_rules``), torch's in place elsewhere."""

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
            if fixed.any():  # as ``regularised``: the weights shared, the fixed ones restored
                e_step.weights.copy_(share_weights(fitter.state.weights, fixed.weight_values, fixed.weights))
            return
        state = online_em_update(fitter.state, stats.double(), step, fitter.w, fixed, fitter.data_size)
        e_step = regularised(state, fitter.w, fitter.fixed, fitter.data_size)
        for live, new in zip(self.live_tensors(), [*state.tensors(), *e_step.tensors()]):
            live.copy_(new)


class GraphedAdam:
    """SGD's gradient and Adam's step as a replayed step takes them, on an ``SGD``: Adam's bias corrections
    set on the device by the host before each step (``Adam.step_on_device``)."""

    @staticmethod
    def accepts(fitter: SGD) -> bool:
        """Not with fixed weights (the free ones are selected by a mask, asking the host)."""
        return not fitter.params.fixed.has_fixed_weights

    def __init__(self, fitter: SGD):
        self.fitter = fitter
        self._corrections: torch.Tensor | None = None  # Adam's, on the device (``prepare_step``)

    @property
    def mixture(self) -> Mixture:
        return self.fitter.mixture

    def live_tensors(self) -> list[torch.Tensor]:
        """The tensors a step rebinds (the parameters and Adam's moments are updated in place anyway)."""
        return list(self.fitter.mixture.tensors())

    def bind(self, tensors: list[torch.Tensor]) -> None:
        self.fitter.mixture = Mixture(*tensors)

    def prepare_step(self) -> None:
        """The host's part of the next step: Adam's step count and corrections, into the device."""
        optimizer = self.fitter.optimizer
        if self._corrections is None:
            self._corrections = torch.zeros(2, dtype=torch.float64, device=self.fitter.mixture.means.device)
        optimizer.steps += 1
        for slot, value in zip(self._corrections, optimizer.corrections()):
            slot.fill_(value)

    def step_in_place(self, stats: Statistics) -> None:
        """The Adam step, its mixture written into ``live_tensors``, asking the host nothing."""
        if self._corrections is None:
            raise RuntimeError("prepare_step sets Adam's corrections on the device before step_in_place")
        params = self.fitter.params
        self.fitter.optimizer.step_on_device(params.loss_gradients(stats.double(), self.fitter.w), self._corrections)
        for live, new in zip(self.live_tensors(), params.mixture().tensors()):
            live.copy_(new)


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
    kind than its buffers', an epoch run again with every test made) go to the reference engine."""

    in_place = False

    def __init__(self, rule, cfg: LoopConfig, general: ReferenceEngine):
        self.graphed = GraphedStep(rule, cfg.device, cfg.backend)
        self.general = general
        self.checks = self.graphed.checks

    def step(self, batch: Batch, epoch: int, number: int, uniforms: torch.Tensor | None) -> None:
        if not self.graphed.step(batch, uniforms):
            self.general.step(batch, epoch, number, uniforms)

    def restart(self) -> None:
        self.graphed.forget()


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
