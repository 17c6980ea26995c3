"""Engines: how a fit's batches run on a device. Each owns its statistics pass and drives the forms of the
update rules (``fit.rules``) that its steps take.

A fitter's update rule is defined once, in torch, on the kernel's ``Statistics`` (``fit.rules``: ``em``,
``online_em``, ``sgd``), its compiled forms beside it. An engine takes each batch of an epoch (``Engine.step``):

* ``reference``: the general pass (``kernel.dispatch``: any device and backend, projections, missing
  entries, weights, a selection's imputed points, a background, data-parallel processes), then the rule;
* ``cpu``: plain batches through the fused kernel's pass, its set-up settled once
  (``kernel.fused.PlainPass``), into the rule's compiled (numba) form on the pass's arrays;
* ``cuda``: each step on static buffers, replayed as a CUDA graph, online EM's rule as one Triton kernel.

The CPU's and CUDA's engines hand the reference engine the batches they cannot take. Which form of a rule
runs where is ``rules.forms``'s, by the rule's name (``Fitter.rule``). Adding a method is its rule and its
row (``methods.METHODS``); adding a device is one engine module, named here.
"""

from __future__ import annotations

from importlib import import_module
from typing import Protocol

import torch

from ...data.batching import Batch
from ...deferred_checks import DeferredChecks
from ..fitters import Fitter
from ..run.loop_config import LoopConfig
from .reference import ReferenceEngine

# The engines with a fast path, asked in this order for a fit's engine: the first that takes the fit runs
# it, handing the reference engine what it cannot take; where none does, the reference engine runs alone.
ENGINES = (".cuda", ".cpu")


class Engine(Protocol):
    """What the loop drives: one step (pass and update) a batch."""

    checks: DeferredChecks | None  # the flag its steps write their deferred tests to; None: the epoch's own
    in_place: bool  # its pass reads in-memory rows where they lie (``DataSource.epoch_batches``)

    def step(self, batch: Batch, epoch: int, number: int, uniforms: torch.Tensor | None) -> None:
        """Batch ``number`` of ``epoch`` (1-based): its statistics, and the fitter's update from them."""

    def restart(self) -> None:
        """Forget what it holds of the fitter's state, which was loaded anew (an epoch run again)."""


def engine_for(fitter: Fitter, cfg: LoopConfig) -> Engine:
    """The engine that runs ``fitter``'s batches under ``cfg``."""
    general = ReferenceEngine(fitter, cfg)
    for name in ENGINES:
        engine = import_module(name, __name__).engine(fitter, cfg, general)
        if engine is not None:
            return engine
    return general
