"""Minibatch (online) EM (Cappe & Moulines 2009): an update after every batch, by a step-size schedule."""

from __future__ import annotations

import dataclasses

import torch

from .. import deferred_checks
from ..kernel.statistics import Statistics
from ..mixture import Mixture
from . import fitters, schedules  # fitters.fused_updates, read at each fitter's start (tests and benchmarks swap it)
from .fitters import Capabilities, mixture_from_state, mixture_state
from .updates import (
    FixedParameters,
    online_em_update,
    online_em_update_naive,
    regularised,
    ridge_vector,
    share_weights,
)


class MinibatchEM(Capabilities):
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

    _reads_batch_loglik = False  # its update takes the sums alone

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
        self._held: tuple | None = None  # (state, E-step) arrays of the last compiled step (``observe_sums``)
        self._state: Mixture | None = None  # made from ``_held`` when asked for
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
        self._samples_assignments = stochastic
        self.truncation = truncation
        self.data_size = data_size
        self.naive = covariance_update == "naive"  # the paper's eq. 7, kept for study
        self._fused = fitters.fused_updates(mixture.means.device) if covariance_update == "stable" else None
        self._views = None if self._fused is None else self._fused.ArrayViews()  # its arrays of W and the masks
        self._graph_update = fitters.graph_updates(mixture.means.device)
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
        self.state = self.state  # the E-step mixture is made again, with the new prior
        if self._constants is not None:  # in place: a captured step reads this tensor
            self._constants[0].fill_(self._prior_size())

    def _prior_size(self) -> float:
        """The E-step prior's data size for the Triton update; 0 where V = Vr + W (or Vr): no prior."""
        return 0.0 if self.data_size is None or self.w is None else float(self.data_size)

    def step_size(self, epoch: int) -> float:
        if self.schedule == "cappe_moulines":
            return schedules.cappe_moulines(self.base_step, self.kappa, self.n_updates)
        if self.schedule == "power":
            return schedules.power(self.base_step, self.kappa, self.n_updates)
        return schedules.step_decay(self.base_step, self.step_decay, self.decay_epoch, epoch)

    def start_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    @property
    def state(self) -> Mixture:
        if self._state is None:  # made only when asked for, from the arrays of the last compiled step
            self._state = Mixture.from_arrays(self._held[0])  # type: ignore[index]
        return self._state

    @state.setter
    def state(self, state: Mixture | None) -> None:
        self._state, self._e_step, self._held = state, None, None

    @property
    def mixture(self) -> Mixture:
        if self._e_step is None:
            if self._held is not None:
                self._e_step = Mixture.from_arrays(self._held[1])
            else:
                self._e_step = regularised(self.state, self.w, self.fixed, self.data_size)
        return self._e_step

    @property
    def result(self) -> Mixture:
        return self.mixture

    def observe(self, stats: Statistics) -> None:
        if self._fused is not None:
            self.observe_sums(*self._fused.sums_of(stats))
            return
        step = self.step_size(self._epoch)
        fixed, data_size = self.fixed or self._no_fixed, self.data_size
        if self.naive:
            self.state = online_em_update_naive(self.state, stats.double(), step, self.w, data_size)
        else:
            self.state = online_em_update(self.state, stats.double(), step, self.w, fixed, data_size)
        self._counted()

    @property
    def takes_sums(self) -> bool:
        return self._fused is not None

    def e_step_arrays(self) -> tuple:
        return self._held[1] if self._held is not None else self.mixture.arrays()

    def observe_sums(self, n: float, q, U, UU, P) -> None:
        """``observe``'s compiled update from the sums as arrays; the state and E-step mixture are kept as
        the update's arrays, and made tensors only when asked for."""
        if self._fused is None:
            raise TypeError("observe_sums runs the compiled update (takes_sums)")
        state = self._held[0] if self._held is not None else self.state.arrays()
        fixed = self.fixed or self._no_fixed
        held = self._fused.online_em_step(
            state, n, q, U, UU, P, self.step_size(self._epoch), self.w, fixed, self.data_size, self._views
        )
        self._held, self._state, self._e_step = held, None, None
        self._counted()

    def _counted(self) -> None:
        """An update done: counted, and under truncation a restart where it left the compact set."""
        self.n_updates += 1
        if self.truncation is not None and not inside_compact_set(self.mixture, self.truncation + self.restarts):
            self.state = self.initial
            self.restarts += 1

    # The step as ``cuda_graphs`` replays it: the host's part, then the device's, in place.
    @property
    def graphable(self) -> bool:
        """Whether the step can be replayed (truncation asks the host, the naive update is kept for study)."""
        return not self.naive and self.truncation is None

    def live_tensors(self) -> list[torch.Tensor]:
        """The tensors a step reads and writes: the running state's and the E-step mixture's."""
        return [*self.state.tensors(), *self.mixture.tensors()]

    def bind(self, tensors: list[torch.Tensor]) -> None:
        self._state, self._e_step, self._held = Mixture(*tensors[:3]), Mixture(*tensors[3:]), None

    def prepare_step(self) -> None:
        """The host's part of the next step: its step size, into a scalar on the device."""
        if self._step is None:
            self._step = torch.zeros((), dtype=torch.float64, device=self.state.means.device)
        self._step.fill_(self.step_size(self._epoch))
        self.n_updates += 1
        if self._graph_update is not None and self._constants is None:
            tiny = torch.finfo(torch.float64).tiny
            self._constants = torch.full((2,), tiny, dtype=torch.float64, device=self.state.means.device)
            self._constants[0].fill_(self._prior_size())  # filled, not copied: no wait

    def step_in_place(self, stats: Statistics) -> None:
        """``observe``'s update (less truncation) written into ``live_tensors``, asking the host nothing."""
        fixed, step = self.fixed or self._no_fixed, self._step
        if step is None:
            raise RuntimeError("prepare_step sets the step size on the device before step_in_place")
        if self._graph_update is not None:
            e_step = self.mixture
            suspect = self._graph_update.online_em_step_in_place(
                self.state, e_step, stats, step, self.w, fixed, self._constants
            )
            checks = deferred_checks.active()
            if checks is None:
                raise RuntimeError("the graphed step runs with its checks deferred (cuda_graphs.GraphedStep)")
            checks.note(suspect)  # a covariance rounding left indefinite: the epoch runs again
            if fixed.any():  # as ``regularised``: the weights shared, the fixed ones restored
                e_step.weights.copy_(share_weights(self.state.weights, fixed.weight_values, fixed.weights))
            return
        state = online_em_update(self.state, stats.double(), step, self.w, fixed, self.data_size)
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
        self.state = self.state  # the E-step mixture is made again, without the fixed parameters

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
        if "e_step" in state:
            self._e_step = mixture_from_state(state["e_step"], self.state)
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
