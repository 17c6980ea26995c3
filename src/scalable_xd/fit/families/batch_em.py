"""Batch EM (Bovy, Hogg & Roweis 2011): an epoch's statistics summed, one update at its end."""

from __future__ import annotations

import torch

from ...kernel.statistics import Statistics
from ...mixture import Mixture
from ..fitters import Capabilities, mixture_from_state, mixture_state
from ..rules.em import FixedParameters, em_update, ridge_vector


class EpochSums(Capabilities):
    """What the batch methods share: every batch's statistics of an epoch summed in float64 (``_sums``),
    for the one update each makes at the epoch's end."""

    _sums: Statistics | None = None

    def step_size(self, epoch: int) -> float:
        return 1.0

    def start_epoch(self, epoch: int) -> None:
        self._sums = None

    def observe(self, stats: Statistics) -> None:
        self._sums = stats.double() if self._sums is None else self._sums.combine(stats.double())

    @property
    def epoch_sums(self) -> Statistics:
        """The epoch's statistics so far; a RuntimeError before its first batch."""
        if self._sums is None:
            raise RuntimeError("no batch was observed this epoch")
        return self._sums

    def pass_loglik(self) -> float:
        """The summed (weighted) log-likelihood of the whole training set under the model the epoch's pass
        used: what an evaluation pass would compute, had the E-step not already done so."""
        loglik = self.epoch_sums.loglik
        if loglik is None:
            raise RuntimeError("the epoch's statistics hold no log-likelihood")
        return float(loglik)

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

    _scores_its_pass = True

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
        self._samples_assignments = stochastic

    @property
    def result(self) -> Mixture:
        return self.mixture

    def end_epoch(self) -> None:
        self.mixture = em_update(self.mixture, self.epoch_sums, self.w, self.fixed)
        self._sums = None

    def diagnostics(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {"mixture": mixture_state(self.mixture), "sums": self._sums_state()}

    def load_state_dict(self, state: dict) -> None:
        self.mixture = mixture_from_state(state["mixture"], self.mixture)
        self._load_sums(state["sums"], self.mixture.means.device)
