"""The three fitting methods as small state machines driven by the training loop.

Each fitter sees the same stream of kernel statistics: ``start_epoch(epoch)``, then ``observe(stats)``
for every batch, then ``end_epoch()``. Batch EM sums the statistics over the whole data set and updates
once an epoch; minibatch EM and SGD update after every batch. ``state_dict``/``load_state_dict`` carry
everything needed to resume from a checkpoint and continue exactly as an uninterrupted fit would.

Parameters and their updates are kept in float64 whatever precision the statistics pass runs in: they are
K x D x D numbers, and Gaia's features need the range (a component can be 1e7 times narrower in parallax
than on the sky, a condition number float32 cannot even store as a positive-definite matrix).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..kernel.statistics import Statistics
from ..mixture import Mixture
from ..settings import FitSettings
from .updates import CholeskyParameters, em_update, feature_scale, online_em_update, online_em_update_naive, regularised


class Fitter(Protocol):
    """What the loop drives: ``mixture`` is the current model (the one the E-step uses and a fit reports)."""

    mixture: Mixture

    def step_size(self, epoch: int) -> float:
        """The step size (1 for batch EM, the learning rate for SGD) used in ``epoch`` (0-based)."""

    def start_epoch(self, epoch: int) -> None: ...

    def observe(self, stats: Statistics) -> None:
        """Take one batch's kernel statistics (an update, or a sum towards one)."""

    def end_epoch(self) -> None: ...

    def state_dict(self) -> dict:
        """Tensors and plain data that ``load_state_dict`` restores exactly (see ``checkpoint``)."""

    def load_state_dict(self, state: dict) -> None: ...


def make_fitter(settings: FitSettings, mixture: Mixture) -> Fitter:
    """The fitter of ``settings.method``, starting from ``mixture``."""
    s = settings
    if s.method == "em":
        return BatchEM(mixture, w=s.w)
    if s.method == "minibatch_em":
        return MinibatchEM(mixture, w=s.w, step_size=s.step_size, schedule=s.step_schedule, step_decay=s.step_decay,
                           decay_epoch=s.decay_epoch, kappa=s.kappa, covariance_update=s.covariance_update)  # fmt: skip
    return SGD(mixture, w=s.w, lr=s.lr, lr_decay=s.lr_decay, decay_epoch=s.decay_epoch, scaling=s.sgd_scaling)


def _mixture_state(mixture: Mixture) -> dict:
    return {"weights": mixture.weights, "means": mixture.means, "covariances": mixture.covariances}


def _mixture_from_state(state: dict, like: Mixture) -> Mixture:
    device = like.means.device
    return Mixture(*(state[k].to(device=device, dtype=torch.float64) for k in ("weights", "means", "covariances")))


class BatchEM:
    """Bovy et al. (2011) EM: full passes, sums accumulated over the data set, one M-step per epoch."""

    def __init__(self, mixture: Mixture, *, w: float):
        self.mixture = mixture
        self.w = w
        self._sums: Statistics | None = None

    def step_size(self, epoch: int) -> float:
        return 1.0

    def start_epoch(self, epoch: int) -> None:
        self._sums = None

    def observe(self, stats: Statistics) -> None:
        self._sums = stats.double() if self._sums is None else self._sums.combine(stats.double())

    def end_epoch(self) -> None:
        self.mixture = em_update(self.mixture, self._sums, self.w)
        self._sums = None

    def state_dict(self) -> dict:
        return {"mixture": _mixture_state(self.mixture)}

    def load_state_dict(self, state: dict) -> None:
        self.mixture = _mixture_from_state(state["mixture"], self.mixture)


class MinibatchEM:
    """Online EM (Cappe & Moulines 2009; paper section 3.1) with the centred covariance update.

    Step sizes: ``schedule="step"`` uses ``step_size`` and multiplies it by ``step_decay`` once ``decay_epoch``
    epochs are done (the paper: 1e-2, halved after 10); ``schedule="cappe_moulines"`` uses
    lambda_t = (t0 + t)^-kappa over update count t, with t0 = step_size^(-1/kappa) so that it starts at
    ``step_size`` and decays as Cappe & Moulines recommend (kappa in (0.5, 1]).

    The running state (``state``) is unregularised; ``mixture``, which the E-step uses and the fit reports,
    adds ``w I`` to its covariances (see ``updates.regularised``). The initial covariances seed the state.
    """

    def __init__(
        self,
        mixture: Mixture,
        *,
        w: float,
        step_size: float,
        schedule: str,
        step_decay: float,
        decay_epoch: int,
        kappa: float,
        covariance_update: str,
    ):
        self.state = mixture
        self.w = w
        self.base_step = step_size
        self.schedule = schedule
        self.step_decay = step_decay
        self.decay_epoch = decay_epoch
        self.kappa = kappa
        self.update = online_em_update if covariance_update == "stable" else online_em_update_naive
        self.n_updates = 0
        self._epoch = 0

    def step_size(self, epoch: int) -> float:
        if self.schedule == "cappe_moulines":
            t0 = self.base_step ** (-1.0 / self.kappa)
            return (t0 + self.n_updates) ** (-self.kappa)
        return self.base_step * (self.step_decay if epoch >= self.decay_epoch else 1.0)

    def start_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    @property
    def mixture(self) -> Mixture:
        return regularised(self.state, self.w)

    def observe(self, stats: Statistics) -> None:
        self.state = self.update(self.state, stats.double(), self.step_size(self._epoch), self.w)
        self.n_updates += 1

    def end_epoch(self) -> None:
        return None

    def state_dict(self) -> dict:
        return {"state": _mixture_state(self.state), "n_updates": self.n_updates}

    def load_state_dict(self, state: dict) -> None:
        self.state = _mixture_from_state(state["state"], self.state)
        self.n_updates = int(state["n_updates"])


class SGD:
    """Adam on softmax logits, means and log-diagonal Cholesky factors (paper section 3.2).

    Loss per batch: the summed negative log-likelihood plus sum_j w / tr(V_j). Learning rate ``lr``,
    multiplied by ``lr_decay`` once ``decay_epoch`` epochs are done (the paper: 1e-2 then 1e-3 after 10).
    Gradients come analytically from the kernel's sums, so no autograd graph is built.

    ``scaling="none"`` is the paper's parametrisation in the features' own units; ``"spread"`` measures the
    parameters in units of each feature's spread under the initial mixture (``updates.feature_scale``), so
    that ``lr`` means the same for degrees and milliarcseconds (see ``CholeskyParameters``).
    """

    def __init__(self, mixture: Mixture, *, w: float, lr: float, lr_decay: float, decay_epoch: int, scaling: str):
        self.params = CholeskyParameters(mixture, feature_scale(mixture) if scaling == "spread" else None)
        self.w = w
        self.base_lr = lr
        self.lr_decay = lr_decay
        self.decay_epoch = decay_epoch
        self.optimizer = torch.optim.Adam(self.params.tensors(), lr=lr)
        self.mixture = self.params.mixture()

    def step_size(self, epoch: int) -> float:
        return self.base_lr * (self.lr_decay if epoch >= self.decay_epoch else 1.0)

    def start_epoch(self, epoch: int) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.step_size(epoch)

    def observe(self, stats: Statistics) -> None:
        for tensor, grad in zip(self.params.tensors(), self.params.loss_gradients(stats.double(), self.w)):
            tensor.grad = grad
        self.optimizer.step()
        self.mixture = self.params.mixture()

    def end_epoch(self) -> None:
        return None

    def state_dict(self) -> dict:
        return {"params": [t.clone() for t in self.params.tensors()], "scale": self.params.scale.clone(),
                "optimizer": self.optimizer.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.params.scale = state["scale"].to(self.params.scale)
        for tensor, saved in zip(self.params.tensors(), state["params"]):
            tensor.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.mixture = self.params.mixture()
