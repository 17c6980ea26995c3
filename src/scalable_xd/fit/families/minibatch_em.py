"""Minibatch EM, the method (``method="minibatch_em"``, the paper's name): an update after every batch, by a
step-size schedule. Cappe & Moulines (2009) call the algorithm online EM, the name its update rule keeps
(``rules.online_em``: the rule, its compiled forms and the state they update)."""

from __future__ import annotations

import dataclasses

import torch

from ...kernel.statistics import Statistics
from ...mixture import Mixture
from ..fitters import Capabilities, mixture_from_state, mixture_state
from ..rules import forms  # forms.compiled, read at each fitter's start (tests and benchmarks swap it)
from ..rules.em import FixedParameters, regularised, ridge_vector
from ..rules.online_em import online_em_update, online_em_update_naive
from . import schedules
from .reseed import dead_components, reseeded


class MinibatchEM(Capabilities):
    """Online EM (Cappe & Moulines 2009; paper section 3.1) with the centred covariance update.

    Step sizes: ``schedule="step"`` uses ``step_size`` and multiplies it by ``step_decay`` once ``decay_epoch``
    epochs are done (the paper: 1e-2, halved after 10); ``schedule="cappe_moulines"`` uses
    lambda_t = (t0 + t)^-kappa over update count t, with t0 = step_size^(-1/kappa) so that it starts at
    ``step_size`` and decays as Cappe & Moulines recommend (kappa in (0.5, 1]); ``schedule="power"`` uses
    gamma_r = step_size r^-kappa for update r = 1, 2, ... (Nguyen, Forbes & McLachlan's
    (1 - 1e-10) r^-0.6 is step_size = 1 - 1e-10, kappa = 0.6).

    The running state (``state``) is unregularised; ``mixture``, which the E-step uses and the fit reports,
    regularises its covariances (``rules.em.e_step_covariances``): with ``data_size`` N, the training data's
    total weight, by the prior batch EM's update implies, so that both have one fixed point; without, by
    adding ``w I``, as the paper's code does. The initial covariances seed the state.

    ``stochastic``: the minibatch form of stochastic EM (each batch's sums from sampled assignments).
    ``truncation``: the truncated algorithm of Nguyen, Forbes & McLachlan (2020, section 3.2) with
    c1 = c2 = c3 = ``truncation``: after the m-th restart the parameters must stay in the compact set
    K_m (weights >= 1/(c + m), every mean entry within +-(c + m), covariance eigenvalues in
    [1/(c + m), c + m], in the features' units); an update that leaves it restarts the running state from
    the initial parameters and m grows by one. The step-size count is not reset.

    ``reseed_size``: the training data's total weight N; at each epoch's end a component of weight below 1/N
    (less than one star) is re-seeded from the heaviest (``reseed``), counted in ``reseeded``; None leaves
    it dead (the paper).
    """

    _reads_batch_loglik = False  # its update takes the sums alone
    rule = "online_em"

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
        reseed_size: float | None = None,
    ):
        self._held: tuple | None = None  # (state, E-step) arrays of the last compiled step (``hold``)
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
        self._no_fixed = FixedParameters.none(mixture.n_components, mixture.means.device)
        self.n_updates = 0
        self.restarts = 0
        self.reseed_size = reseed_size
        self.reseeded = 0
        self._epoch = 0
        self.compiled = forms.compiled(self, mixture.means.device)

    def resize(self, data_size: float) -> None:
        """The training data's total weight, where it grows (online learning, ``fit.partial``): the E-step's
        prior follows it."""
        self.data_size = data_size
        self.reseed_size = data_size if self.reseed_size is not None else None
        self.state = self.state  # the E-step mixture is made again, with the new prior

    def step_size(self, epoch: int) -> float:
        if self.schedule == "cappe_moulines":
            return schedules.cappe_moulines(self.base_step, self.kappa, self.n_updates)
        if self.schedule == "power":
            return schedules.power(self.base_step, self.kappa, self.n_updates)
        return schedules.step_decay(self.base_step, self.step_decay, self.decay_epoch, epoch)

    def start_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def next_step_size(self) -> float:
        """The step size of the next update."""
        return self.step_size(self._epoch)

    @property
    def fixed_parameters(self) -> FixedParameters:
        """``fixed``, or the masks of no parameter fixed."""
        return self.fixed or self._no_fixed

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
        if self.compiled is not None:
            self.compiled.observe(stats)
            return
        step = self.next_step_size()
        if self.naive:
            self.state = online_em_update_naive(self.state, stats.double(), step, self.w, self.data_size)
        else:
            self.state = online_em_update(
                self.state, stats.double(), step, self.w, self.fixed_parameters, self.data_size
            )
        self.counted()

    # The parameters as a compiled rule reads and writes them: arrays, made tensors only when asked for.
    def state_arrays(self) -> tuple:
        """The running state's (weights, means, covariances) as C-contiguous float64 arrays."""
        return self._held[0] if self._held is not None else self.state.arrays()

    def e_step_arrays(self) -> tuple:
        """``mixture``'s (weights, means, covariances) as C-contiguous float64 arrays, which the caller reads."""
        return self._held[1] if self._held is not None else self.mixture.arrays()

    def bind(self, state: Mixture, e_step: Mixture) -> None:
        """Take these tensors as the running state and the E-step mixture (a replayed step writes them)."""
        self._state, self._e_step, self._held = state, e_step, None

    def hold(self, state: tuple, e_step: tuple) -> None:
        """Take a compiled update's new state and E-step mixture as arrays (that no later step writes to),
        and count the update."""
        self._held, self._state, self._e_step = (state, e_step), None, None
        self.counted()

    def counted(self) -> None:
        """An update done: counted, and under truncation a restart where it left the compact set."""
        self.n_updates += 1
        if self.truncation is not None and not inside_compact_set(self.mixture, self.truncation + self.restarts):
            self.state = self.initial
            self.restarts += 1

    def end_epoch(self) -> None:
        """Re-seed the components that died in the epoch (``reseed``), where ``reseed_size`` is set."""
        if self.reseed_size is None:
            return
        fixed = self.fixed_parameters
        held = fixed.weights | fixed.means | fixed.covariances
        dead = dead_components(self.state.weights, 1.0 / self.reseed_size, held)
        if len(dead):
            self.state = reseeded(self.state, dead, held)
            self.reseeded += len(dead)

    def diagnostics(self) -> dict:
        out = {} if self.truncation is None else {"truncation_restarts": self.restarts}
        return out if self.reseed_size is None else {**out, "reseeded": self.reseeded}

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
            "reseeded": self.reseeded,
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
        self.reseeded = int(state.get("reseeded", 0))  # a checkpoint written before re-seeding: none


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
