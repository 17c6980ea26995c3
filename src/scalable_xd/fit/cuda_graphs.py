"""Minibatch steps replayed as CUDA graphs: one launch a batch instead of about a hundred.

A minibatch step on a GPU is the statistics pass's kernels and the float64 update's small torch ops (online
EM's is one Triton kernel there, ``triton_updates``), each launched from Python in a few microseconds; at
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
another size (an epoch's last) takes the fitter's ordinary step, whose results are copied into the static
buffers before the next replay; after an epoch run again from a restored state the step is captured anew.
On the CPU it runs the same static-buffer step eagerly, which is how the
tests check it against the ordinary step here. A capture that CUDA refuses is said in a warning, and the
fit goes on with uncaptured steps.
"""

from __future__ import annotations

import logging

import torch

from .. import deferred_checks
from ..kernel.dispatch import batch_statistics

log = logging.getLogger("scalable_xd.fit")


class GraphedStep:
    """One fit's minibatch steps on static buffers, captured and replayed as a CUDA graph on CUDA."""

    def __init__(self, fitter, device: torch.device, backend: str):
        self.fitter = fitter
        self.device, self.backend = device, backend
        self.checks = deferred_checks.DeferredChecks(device)  # the flag the captured step writes to
        self.capturing = device.type == "cuda"
        self.layout: tuple[int, bool, bool] | None = None  # (batch size, weighted, drawn): the static buffers
        self.inputs: dict[str, torch.Tensor | None] = {}
        self.live: list[torch.Tensor] = []  # the fitter's tensors the step reads and writes, static
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
        self.fitter.prepare_step()
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
        current = self.fitter.live_tensors()
        if not self.live:
            self.live = [t.clone() for t in current]
        if any(mine is not theirs for mine, theirs in zip(self.live, current)):
            for mine, theirs in zip(self.live, current):
                if mine is not theirs:
                    mine.copy_(theirs)
            self.fitter.bind(self.live)

    def _body(self) -> None:
        """The step on the static buffers: the statistics pass, then the fitter's update in place."""
        inputs = self.inputs
        stats = batch_statistics(
            inputs["x"],
            inputs["S"],
            self.fitter.mixture,
            backend=self.backend,
            point_weights=inputs["weights"],
            uniforms=inputs["uniforms"],
        )
        deferred_checks.positive_weight(stats.n_points)  # a batch of zero weight: noted (this step's flag)
        self.fitter.step_in_place(stats)

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
