"""SGD: Adam on the mixture's softmax weights, means and Cholesky factors (paper section 3.2)."""

from __future__ import annotations

import dataclasses

import torch

from ...kernel.statistics import Statistics
from ...mixture import Mixture
from ..fitters import Capabilities, mixture_from_state, mixture_state
from ..rules import forms  # forms.compiled, read at each fitter's start (tests and benchmarks swap it)
from ..rules.em import FixedParameters, ridge_vector
from ..rules.sgd import Adam, CholeskyParameters, component_scale, feature_scale
from . import schedules


class SGD(Capabilities):
    """Adam on softmax logits, means and log-diagonal Cholesky factors (paper section 3.2).

    Loss per batch: the summed negative log-likelihood plus sum_j 1 / tr(W^-1 V_j) (the paper's w / tr(V_j)
    where W = w I). Learning rate ``lr``, multiplied by ``lr_decay`` once ``decay_epoch`` epochs are done (the
    paper: 1e-2 then 1e-3 after 10). Gradients come analytically from the kernel's sums, so no autograd
    graph is built.

    ``scaling="none"`` is the paper's parametrisation in the features' own units; ``"spread"`` measures the
    parameters in units of each feature's spread under the initial mixture (``rules.sgd.feature_scale``), so
    that ``lr`` means the same for degrees and milliarcseconds; ``"component"`` in units of each
    component's own starting spread (``rules.sgd.component_scale``), so that it means the same for a
    component as wide as the data and one a thousand times narrower (see ``CholeskyParameters``).
    """

    _reads_batch_loglik = False  # its update takes the sums alone
    rule = "sgd"

    def __init__(
        self,
        mixture: Mixture,
        *,
        w: float | torch.Tensor | None,
        lr: float,
        lr_decay: float,
        decay_epoch: int,
        scaling: str,
        fixed: FixedParameters | None = None,
    ):
        scale = {"component": component_scale, "spread": feature_scale}.get(scaling, lambda mixture: None)(mixture)
        self.params = CholeskyParameters(mixture, scale, fixed)
        self.w = ridge_vector(w, mixture.means)
        self.base_lr = lr
        self.lr_decay = lr_decay
        self.decay_epoch = decay_epoch
        self.optimizer = Adam(self.params.tensors(), lr=lr)
        self._held: tuple | None = None  # the mixture's arrays from the last compiled step (``hold``)
        self._mixture: Mixture | None = None  # made from ``_held`` when asked for
        self.mixture = self.params.mixture()
        self.compiled = forms.compiled(self, mixture.means.device)

    def step_size(self, epoch: int) -> float:
        return schedules.step_decay(self.base_lr, self.lr_decay, self.decay_epoch, epoch)

    def start_epoch(self, epoch: int) -> None:
        self.optimizer.lr = self.step_size(epoch)

    @property
    def mixture(self) -> Mixture:
        if self._mixture is None:  # made only when asked for, from the arrays of the last compiled step
            self._mixture = Mixture.from_arrays(self._held)  # type: ignore[arg-type]
        return self._mixture

    @mixture.setter
    def mixture(self, mixture: Mixture) -> None:
        self._mixture, self._held = mixture, None

    def observe(self, stats: Statistics) -> None:
        if self.compiled is not None:
            self.compiled.observe(stats)
            return
        self.optimizer.step(self.params.loss_gradients(stats.double(), self.w))
        self.mixture = self.params.mixture()

    # The mixture as a compiled rule reads and writes it: arrays, made tensors only when asked for.
    def mixture_arrays(self) -> tuple:
        """``mixture``'s (weights, means, covariances) as C-contiguous float64 arrays, which the caller reads."""
        return self._held if self._held is not None else self.mixture.arrays()

    def hold(self, mixture: tuple) -> None:
        """Take a compiled step's new mixture as arrays (that no later step writes to)."""
        self._held, self._mixture = mixture, None

    @property
    def result(self) -> Mixture:
        return self.mixture

    def end_epoch(self) -> None:
        return None

    def diagnostics(self) -> dict:
        return {}

    # What stochastic split-and-merge needs of a minibatch fitter to run a trial beside it.
    @property
    def starting_point(self) -> Mixture:
        return self.mixture

    def continue_schedule(self, other: SGD) -> None:
        """The learning rate follows the epoch (set in ``start_epoch``); nothing to carry over."""

    def release_fixed(self) -> None:
        self.params.fixed = FixedParameters.none(self.mixture.n_components, self.mixture.means.device)

    def state_dict(self) -> dict:
        return {
            "params": [t.clone() for t in self.params.tensors()],
            "scale": self.params.scale.clone(),
            "optimizer": self.optimizer.state_dict(),
            "initial": mixture_state(self.params.initial),
            # kept, not recomputed on load: the fused step's L L^T and torch's may round differently
            "mixture": mixture_state(self.mixture),
        }

    def load_state_dict(self, state: dict) -> None:
        self.params.scale = state["scale"].to(self.params.scale).expand_as(self.params.scale)  # (D,): older files
        self.params.initial = mixture_from_state(state["initial"], self.params.initial)
        self.params.fixed = dataclasses.replace(self.params.fixed, weight_values=self.params.initial.weights)
        for tensor, saved in zip(self.params.tensors(), state["params"]):
            tensor.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        saved = state.get("mixture")
        self.mixture = self.params.mixture() if saved is None else mixture_from_state(saved, self.mixture)
