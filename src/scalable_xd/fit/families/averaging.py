"""Polyak-Ruppert averaging of a minibatch fitter's parameters."""

from __future__ import annotations

from ...kernel.statistics import Statistics
from ...mixture import Mixture
from ..fitters import Capabilities, Fitter, mixture_from_state, mixture_state


class PolyakAverage(Capabilities):
    """Polyak-Ruppert averaging around a minibatch fitter: the update and the E-step are the wrapped
    fitter's own; what the fit reports (``result``) is the running mean of its parameters over all updates
    so far, theta_bar_r = theta_bar_{r-1} + (theta_r - theta_bar_{r-1}) / r (Nguyen, Forbes & McLachlan's "P" variants).
    Weights, means and covariances are averaged as they are; an average of positive-definite matrices is
    positive definite, and of weights that sum to one sums to one.
    """

    def __init__(self, inner: Fitter):
        self.inner = inner
        self._samples_assignments = inner.samples_assignments
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
