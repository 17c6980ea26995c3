"""What the epoch loop and the engines that take its batches read of a fit: ``LoopConfig``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..selection import Selection
from .lockstep import Member
from .parallel import ONE_PROCESS, Group


@dataclass
class LoopConfig:
    epochs: int
    batch_size: int
    shuffle: bool
    seed: int
    device: torch.device
    dtype: torch.dtype
    backend: str  # kernel backend for R = I batches (see ``kernel``)
    cures: str  # what could stop a divergence, for FitDivergedError (``driver.divergence_cures``)
    tol: float | None
    verbose: int = 0
    group: Group = ONE_PROCESS  # data-parallel processes (see ``parallel``)
    checkpoint_every: int = 0  # batches between checkpoints inside an epoch (0: at epochs' ends only)
    defer_checks: bool = False  # per-batch tests asked once an epoch (``deferred_checks``): for GPUs
    graph_steps: bool = False  # minibatch steps on static buffers, replayed as CUDA graphs (``engines.cuda``)
    selection: Selection | None = None  # each batch's sums gain the points it removed (``selection``)
    # (D,) each feature's least noise variance over the training stars, where known (data in memory, no
    # projection): a component's collapse is a divergence only in a feature some star measures without noise
    least_noise: torch.Tensor | None = None
    lockstep: Member | None = None  # the fits this one steps together with (``lockstep``), or None
