"""The fitting methods as small state machines driven by the training loop (``methods`` says which runs which).

Each fitter sees the same stream of kernel statistics: ``start_epoch(epoch)``, then ``observe(stats)``
for every batch, then ``end_epoch()``. Batch EM sums the statistics over the whole data set and updates
once an epoch; minibatch EM and SGD update after every batch. ``state_dict``/``load_state_dict`` carry
everything needed to resume from a checkpoint and continue exactly as an uninterrupted fit would.

Parameters and their updates are kept in float64 whatever precision the statistics pass runs in: they are
K x D x D numbers, and Gaia's features need the range (a component can be 1e7 times narrower in parallax
than on the sky, a condition number float32 cannot even store as a positive-definite matrix).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import ModuleType
from typing import Protocol

import torch

from .. import deferred_checks
from ..kernel.statistics import Statistics
from ..mixture import Mixture
from .adam import Adam
from .updates import (
    CholeskyParameters,
    FixedParameters,
    component_scale,
    em_update,
    feature_scale,
    online_em_update,
    online_em_update_naive,
    regularised,
    ridge_vector,
    share_weights,
)


class Fitter(Protocol):
    """What the loop drives: ``mixture`` is the model the E-step uses; ``result`` the one the fit reports
    (the same, except under Polyak averaging)."""

    mixture: Mixture
    result: Mixture
    samples_assignments: bool  # stochastic EM: the loop passes uniforms for the S-step
    wants_criteria: bool  # split-and-merge: the loop asks the kernel for the criteria's sums
    finished: bool  # split-and-merge: no move left to try, so the fit is done
    shadow: Mixture | None  # stochastic split-and-merge: a trial model that gets its own statistics pass
    scores_its_pass: bool  # batch EM: an epoch's sums hold the training log-likelihood of its starting model

    def step_size(self, epoch: int) -> float:
        """The step size (1 for batch EM, the learning rate for SGD) used in ``epoch`` (0-based)."""

    def start_epoch(self, epoch: int) -> None: ...

    def observe(self, stats: Statistics) -> None:
        """Take one batch's kernel statistics (an update, or a sum towards one)."""

    def end_epoch(self) -> None: ...

    def diagnostics(self) -> dict:
        """Extra numbers for the history entry of the epoch just done (e.g. truncation restarts)."""

    def state_dict(self) -> dict:
        """Tensors and plain data that ``load_state_dict`` restores exactly (see ``checkpoint``)."""

    def load_state_dict(self, state: dict) -> None: ...

    def pass_loglik(self) -> float:
        """(Called where ``scores_its_pass``.) The summed training log-likelihood of the model the epoch's
        pass used."""

    def pass_objective(self) -> float | None:
        """(Called where ``scores_its_pass``.) What the fitter maximises, summed like ``pass_loglik``, where
        that is not the log-likelihood alone (``tol`` then judges it); None where it is."""

    def observe_shadow(self, stats: Statistics) -> None:
        """(Called where ``shadow`` is not None.) The statistics of the trial model's pass over the batch."""


class TrialFitter(Fitter, Protocol):
    """What stochastic split-and-merge asks of a minibatch fitter to run a trial copy beside it."""

    @property
    def starting_point(self) -> Mixture:
        """The parameters a copy of this fit starts from."""

    def continue_schedule(self, other: TrialFitter) -> None:
        """Take up ``other``'s step-size schedule where it is."""

    def release_fixed(self) -> None:
        """Let every parameter move again (the trial's partial updates are over)."""


def fused_updates(device: torch.device) -> ModuleType | None:
    """The compiled minibatch updates (``fused_updates``) where they run: numba installed, parameters on
    the CPU; None elsewhere, where the torch updates run."""
    if device.type != "cpu" or importlib.util.find_spec("numba") is None:
        return None
    from . import fused_updates

    return fused_updates


def graph_updates(device: torch.device) -> ModuleType | None:
    """Online EM's update as one Triton kernel (``triton_updates``) for the step a GPU replays: on CUDA
    where triton is installed; None elsewhere, where the torch update runs."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from . import triton_updates

    return triton_updates


def mixture_state(mixture: Mixture) -> dict:
    return {"weights": mixture.weights, "means": mixture.means, "covariances": mixture.covariances}


def mixture_from_state(state: dict, like: Mixture) -> Mixture:
    device = like.means.device
    return Mixture(*(state[k].to(device=device, dtype=torch.float64) for k in ("weights", "means", "covariances")))


class EpochSums:
    """What the batch methods share: every batch's statistics of an epoch summed in float64 (``_sums``),
    for the one update each makes at the epoch's end."""

    _sums: Statistics | None = None

    def step_size(self, epoch: int) -> float:
        return 1.0

    def start_epoch(self, epoch: int) -> None:
        self._sums = None

    def observe(self, stats: Statistics) -> None:
        self._sums = stats.double() if self._sums is None else self._sums.combine(stats.double())

    def pass_loglik(self) -> float:
        """The summed (weighted) log-likelihood of the whole training set under the model the epoch's pass
        used: what an evaluation pass would compute, had the E-step not already done so."""
        return float(self._sums.loglik)

    def pass_objective(self) -> float | None:
        return None  # Bovy et al.'s EM judges convergence on the log-likelihood, whatever w

    def _sums_state(self) -> dict | None:
        """The epoch's sums so far, for a checkpoint written inside an epoch (without split-and-merge
        criteria, which such checkpoints never carry)."""
        if self._sums is None:
            return None
        s = self._sums
        return {"n_points": float(s.n_points), "q": s.q, "U": s.U, "UU": s.UU, "P": s.P, "loglik": s.loglik}

    def _load_sums(self, state: dict | None, device) -> None:
        if state is None:
            self._sums = None
            return
        tensors = {k: state[k].to(device) for k in ("q", "U", "UU", "P", "loglik")}
        self._sums = Statistics(state["n_points"], **tensors)


class BatchEM(EpochSums):
    """Bovy et al. (2011) EM: full passes, sums accumulated over the data set, one M-step per epoch.

    ``stochastic``: stochastic EM (Celeux & Diebolt 1985): the sums come from one sampled
    assignment per star (the S-step) rather than its responsibilities, the true values still integrated
    out analytically. A component that draws no star is frozen with weight zero, as in batch EM.
    """

    wants_criteria = finished = False
    shadow = None
    scores_its_pass = True

    def __init__(
        self,
        mixture: Mixture,
        *,
        w: float | torch.Tensor | None,
        fixed: FixedParameters | None = None,
        stochastic: bool = False,
    ):
        self.mixture = mixture
        self.w = ridge_vector(w, mixture.means)
        self.fixed = fixed
        self.samples_assignments = stochastic

    @property
    def result(self) -> Mixture:
        return self.mixture

    def end_epoch(self) -> None:
        self.mixture = em_update(self.mixture, self._sums, self.w, self.fixed)
        self._sums = None

    def diagnostics(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {"mixture": mixture_state(self.mixture), "sums": self._sums_state()}

    def load_state_dict(self, state: dict) -> None:
        self.mixture = mixture_from_state(state["mixture"], self.mixture)
        self._load_sums(state["sums"], self.mixture.means.device)


class MinibatchEM:
    """Online EM (Cappe & Moulines 2009; paper section 3.1) with the centred covariance update.

    Step sizes: ``schedule="step"`` uses ``step_size`` and multiplies it by ``step_decay`` once ``decay_epoch``
    epochs are done (the paper: 1e-2, halved after 10); ``schedule="cappe_moulines"`` uses
    lambda_t = (t0 + t)^-kappa over update count t, with t0 = step_size^(-1/kappa) so that it starts at
    ``step_size`` and decays as Cappe & Moulines recommend (kappa in (0.5, 1]); ``schedule="power"`` uses
    gamma_r = step_size r^-kappa for update r = 1, 2, ... (Nguyen, Forbes & McLachlan's
    (1 - 1e-10) r^-0.6 is step_size = 1 - 1e-10, kappa = 0.6).

    The running state (``state``) is unregularised; ``mixture``, which the E-step uses and the fit reports,
    regularises its covariances (``updates.e_step_covariances``): with ``data_size`` N, the training data's
    total weight, by the prior batch EM's update implies, so that both have one fixed point; without, by
    adding ``w I``, as the paper's code does. The initial covariances seed the state.

    ``stochastic``: the minibatch form of stochastic EM (each batch's sums from sampled assignments).
    ``truncation``: the truncated algorithm of Nguyen, Forbes & McLachlan (2020, section 3.2) with
    c1 = c2 = c3 = ``truncation``: after the m-th restart the parameters must stay in the compact set
    K_m (weights >= 1/(c + m), every mean entry within +-(c + m), covariance eigenvalues in
    [1/(c + m), c + m], in the features' units); an update that leaves it restarts the running state from
    the initial parameters and m grows by one. The step-size count is not reset.
    """

    wants_criteria = finished = False
    shadow = None
    scores_its_pass = False

    def __init__(
        self,
        mixture: Mixture,
        *,
        w: float | torch.Tensor | None,
        step_size: float,
        schedule: str,
        step_decay: float,
        decay_epoch: int,
        kappa: float,
        covariance_update: str,
        fixed: FixedParameters | None = None,
        stochastic: bool = False,
        truncation: float | None = None,
        data_size: float | None = None,
    ):
        if covariance_update == "naive" and fixed is not None and fixed.any():
            raise ValueError("fixed parameters need covariance_update='stable' (the naive update keeps raw sums)")
        self.state = mixture
        self.initial = mixture
        self._e_step: Mixture | None = None  # the E-step's mixture, kept until the state changes
        self.w = ridge_vector(w, mixture.means)
        self.base_step = step_size
        self.schedule = schedule
        self.step_decay = step_decay
        self.decay_epoch = decay_epoch
        self.kappa = kappa
        self.fixed = fixed
        self.samples_assignments = stochastic
        self.truncation = truncation
        self.data_size = data_size
        self.update = online_em_update if covariance_update == "stable" else online_em_update_naive
        self._fused = fused_updates(mixture.means.device) if covariance_update == "stable" else None
        self._graph_update = graph_updates(mixture.means.device)
        self._constants: torch.Tensor | None = None  # (data_size or 0, float64's tiny) on the device
        self._no_fixed = FixedParameters.none(mixture.n_components, mixture.means.device)
        self.n_updates = 0
        self.restarts = 0
        self._epoch = 0
        self._step: torch.Tensor | None = None  # the step size on the device (``prepare_step``)

    def resize(self, data_size: float) -> None:
        """The training data's total weight, where it grows (online learning, ``fit.online``): the E-step's
        prior follows it."""
        self.data_size = data_size
        self._e_step = None
        self._constants = None

    def step_size(self, epoch: int) -> float:
        if self.schedule == "cappe_moulines":
            t0 = self.base_step ** (-1.0 / self.kappa)
            return (t0 + self.n_updates) ** (-self.kappa)
        if self.schedule == "power":
            return self.base_step * (self.n_updates + 1) ** (-self.kappa)
        return self.base_step * (self.step_decay if epoch >= self.decay_epoch else 1.0)

    def start_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    @property
    def state(self) -> Mixture:
        return self._state

    @state.setter
    def state(self, state: Mixture) -> None:
        self._state = state
        self._e_step = None

    @property
    def mixture(self) -> Mixture:
        if self._e_step is None:
            self._e_step = regularised(self.state, self.w, self.fixed, self.data_size)
        return self._e_step

    @property
    def result(self) -> Mixture:
        return self.mixture

    def observe(self, stats: Statistics) -> None:
        step = self.step_size(self._epoch)
        fixed, data_size = self.fixed or self._no_fixed, self.data_size
        if self._fused is not None:
            self.state, e_step = self._fused.online_em_step(self.state, stats, step, self.w, fixed, data_size)
            self._e_step = e_step
        elif self.update is online_em_update:
            self.state = online_em_update(self.state, stats.double(), step, self.w, fixed, data_size)
        else:
            self.state = self.update(self.state, stats.double(), step, self.w, data_size)
        self.n_updates += 1
        if self.truncation is not None and not inside_compact_set(self.mixture, self.truncation + self.restarts):
            self.state = self.initial
            self.restarts += 1

    # The step as ``cuda_graphs`` replays it: the host's part, then the device's, in place.
    @property
    def graphable(self) -> bool:
        """Whether the step can be replayed (truncation asks the host, the naive update is kept for study)."""
        return self.update is online_em_update and self.truncation is None

    def live_tensors(self) -> list[torch.Tensor]:
        """The tensors a step reads and writes: the running state's and the E-step mixture's."""
        return [*self.state.tensors(), *self.mixture.tensors()]

    def bind(self, tensors: list[torch.Tensor]) -> None:
        self._state, self._e_step = Mixture(*tensors[:3]), Mixture(*tensors[3:])

    def prepare_step(self) -> None:
        """The host's part of the next step: its step size, into a scalar on the device."""
        if self._step is None:
            self._step = torch.zeros((), dtype=torch.float64, device=self.state.means.device)
        self._step.fill_(self.step_size(self._epoch))
        self.n_updates += 1
        if self._graph_update is not None and self._constants is None:
            paper = self.data_size is None or self.w is None  # V = Vr + W (or Vr): no prior
            tiny = torch.finfo(torch.float64).tiny
            self._constants = torch.full((2,), tiny, dtype=torch.float64, device=self.state.means.device)
            self._constants[0].fill_(0.0 if paper else float(self.data_size))  # filled, not copied: no wait

    def step_in_place(self, stats: Statistics) -> None:
        """``observe``'s update (less truncation) written into ``live_tensors``, asking the host nothing."""
        fixed = self.fixed or self._no_fixed
        if self._graph_update is not None:
            e_step = self.mixture
            suspect = self._graph_update.online_em_step_in_place(
                self.state, e_step, stats, self._step, self.w, fixed, self._constants
            )
            deferred_checks.active().note(suspect)  # a covariance rounding left indefinite: the epoch runs again
            if fixed.any():  # as ``regularised``: the weights shared, the fixed ones restored
                e_step.weights.copy_(share_weights(self.state.weights, fixed.weight_values, fixed.weights))
            return
        state = online_em_update(self.state, stats.double(), self._step, self.w, fixed, self.data_size)
        e_step = regularised(state, self.w, self.fixed, self.data_size)
        for live, new in zip(self.live_tensors(), [*state.tensors(), *e_step.tensors()]):
            live.copy_(new)

    def end_epoch(self) -> None:
        return None

    def diagnostics(self) -> dict:
        return {} if self.truncation is None else {"truncation_restarts": self.restarts}

    # What stochastic split-and-merge needs of a minibatch fitter to run a trial beside it.
    @property
    def starting_point(self) -> Mixture:
        """The parameters a copy of this fit starts from: the running state (its mixture adds w I, which
        the copy would add again)."""
        return self.state

    def continue_schedule(self, other: MinibatchEM) -> None:
        """Take up ``other``'s step-size schedule where it is."""
        self.n_updates = other.n_updates

    def release_fixed(self) -> None:
        self.fixed = None
        self._e_step = None

    def state_dict(self) -> dict:
        return {
            "state": mixture_state(self.state),
            "initial": mixture_state(self.initial),
            # kept, not recomputed on load: the fused step and ``regularised`` may round differently
            "e_step": mixture_state(self.mixture),
            "n_updates": self.n_updates,
            "restarts": self.restarts,
        }

    def load_state_dict(self, state: dict) -> None:
        self.state = mixture_from_state(state["state"], self.state)
        self.initial = mixture_from_state(state["initial"], self.state)
        if self.fixed is not None:  # the fixed weights are the initial ones, not the placeholder's
            self.fixed = dataclasses.replace(self.fixed, weight_values=self.initial.weights)
        self._e_step = mixture_from_state(state["e_step"], self.state) if "e_step" in state else None
        self.n_updates = int(state["n_updates"])
        self.restarts = int(state["restarts"])


def inside_compact_set(mixture: Mixture, bound: float) -> bool:
    """Whether the parameters lie in the truncation set of bound c: weights >= 1/c, |mean entries| <= c,
    covariance eigenvalues in [1/c, c] (Nguyen, Forbes & McLachlan 2020, section 3.2)."""
    eigenvalues = torch.linalg.eigvalsh(mixture.covariances)
    return bool(
        (mixture.weights >= 1.0 / bound).all()
        and (mixture.means.abs() <= bound).all()
        and (eigenvalues >= 1.0 / bound).all()
        and (eigenvalues <= bound).all()
    )


class SGD:
    """Adam on softmax logits, means and log-diagonal Cholesky factors (paper section 3.2).

    Loss per batch: the summed negative log-likelihood plus sum_j 1 / tr(W^-1 V_j) (the paper's w / tr(V_j)
    where W = w I). Learning rate ``lr``, multiplied by ``lr_decay`` once ``decay_epoch`` epochs are done (the
    paper: 1e-2 then 1e-3 after 10). Gradients come analytically from the kernel's sums, so no autograd
    graph is built.

    ``scaling="none"`` is the paper's parametrisation in the features' own units; ``"spread"`` measures the
    parameters in units of each feature's spread under the initial mixture (``updates.feature_scale``), so
    that ``lr`` means the same for degrees and milliarcseconds; ``"component"`` in units of each
    component's own starting spread (``updates.component_scale``), so that it means the same for a
    component as wide as the data and one a thousand times narrower (see ``CholeskyParameters``).
    """

    samples_assignments = wants_criteria = finished = False
    shadow = None
    scores_its_pass = False

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
        self.mixture = self.params.mixture()
        self._fused = fused_updates(mixture.means.device)
        self._corrections: torch.Tensor | None = None  # Adam's, on the device (``prepare_step``)

    def step_size(self, epoch: int) -> float:
        return self.base_lr * (self.lr_decay if epoch >= self.decay_epoch else 1.0)

    def start_epoch(self, epoch: int) -> None:
        self.optimizer.lr = self.step_size(epoch)

    def observe(self, stats: Statistics) -> None:
        if self._fused is not None:
            self.mixture = self._fused.sgd_step(self.params, self.optimizer, stats, self.w)
            return
        self.optimizer.step(self.params.loss_gradients(stats.double(), self.w))
        self.mixture = self.params.mixture()

    # The step as ``cuda_graphs`` replays it: the host's part, then the device's, in place.
    @property
    def graphable(self) -> bool:
        """Whether the step can be replayed (fixed weights select the free ones by a mask, asking the host)."""
        return not self.params.fixed.has_fixed_weights

    def live_tensors(self) -> list[torch.Tensor]:
        """The tensors a step rebinds (the parameters and Adam's moments are updated in place anyway)."""
        return list(self.mixture.tensors())

    def bind(self, tensors: list[torch.Tensor]) -> None:
        self.mixture = Mixture(*tensors)

    def prepare_step(self) -> None:
        """The host's part of the next step: Adam's step count and corrections, into the device."""
        if self._corrections is None:
            self._corrections = torch.zeros(2, dtype=torch.float64, device=self.mixture.means.device)
        self.optimizer.steps += 1
        for slot, value in zip(self._corrections, self.optimizer.corrections()):
            slot.fill_(value)

    def step_in_place(self, stats: Statistics) -> None:
        """``observe``'s Adam step, its mixture written into ``live_tensors``, asking the host nothing."""
        self.optimizer.step_on_device(self.params.loss_gradients(stats.double(), self.w), self._corrections)
        for live, new in zip(self.live_tensors(), self.params.mixture().tensors()):
            live.copy_(new)

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


class PolyakAverage:
    """Polyak-Ruppert averaging around a minibatch fitter: the update and the E-step are the wrapped
    fitter's own; what the fit reports (``result``) is the running mean of its parameters over all updates
    so far, theta_bar_r = theta_bar_{r-1} + (theta_r - theta_bar_{r-1}) / r (Nguyen, Forbes & McLachlan's "P" variants).
    Weights, means and covariances are averaged as they are; an average of positive-definite matrices is
    positive definite, and of weights that sum to one sums to one.
    """

    wants_criteria = finished = False
    shadow = None
    scores_its_pass = False

    def __init__(self, inner: Fitter):
        self.inner = inner
        self.samples_assignments = inner.samples_assignments
        self.average = inner.result
        self.n_averaged = 0

    @property
    def mixture(self) -> Mixture:
        return self.inner.mixture

    @property
    def result(self) -> Mixture:
        return self.average

    def step_size(self, epoch: int) -> float:
        return self.inner.step_size(epoch)

    def start_epoch(self, epoch: int) -> None:
        self.inner.start_epoch(epoch)

    def observe(self, stats: Statistics) -> None:
        self.inner.observe(stats)
        self.n_averaged += 1
        rate = 1.0 / self.n_averaged
        new, avg = self.inner.result, self.average
        self.average = Mixture(
            *(
                a + rate * (b - a)
                for a, b in zip((avg.weights, avg.means, avg.covariances), (new.weights, new.means, new.covariances))
            )
        )

    def end_epoch(self) -> None:
        self.inner.end_epoch()

    def diagnostics(self) -> dict:
        return self.inner.diagnostics()

    def state_dict(self) -> dict:
        return {
            "inner": self.inner.state_dict(),
            "average": mixture_state(self.average),
            "n_averaged": self.n_averaged,
        }

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        self.average = mixture_from_state(state["average"], self.average)
        self.n_averaged = int(state["n_averaged"])
