"""A fitter with a uniform background's weight fitted beside its mixture (``background``).

The loop weights each point's part in the kernel's sums by 1 - r_i, its chance of being a Gaussian point,
and passes the sum of the r_i with the statistics (``Statistics.background``); the mixture's fitter then
updates the Gaussian part as usual. The background's weight beta follows the same rule as the mixture's
weights: batch EM sets it to the epoch's mean r_i (Melchior & Goulding 2018); minibatch EM and SGD move it
towards each batch's mean r_i by the step size (a stochastic-approximation step, as online EM moves the
weights: Cappe & Moulines 2009).
"""

from __future__ import annotations

import torch

from ...background import Background
from ...kernel.statistics import Statistics
from ..fitters import Fitter


class BackgroundFit:
    """``fitter`` (any ``Fitter``) and ``background``'s weight, fitted together; every other attribute is the
    fitter's."""

    # Its update is its own, not the fitter's rule: no engine takes its batches by that rule's compiled
    # forms (the responsibilities' pass runs before the statistics'); the fitter's ``observe`` still runs
    # its own compiled rule.
    rule = None
    compiled = None

    def __init__(self, fitter: Fitter, background: Background):
        self.fitter = fitter
        self.background = background
        self._epoch = 0
        self._sums = [0.0, 0.0]  # this epoch's (sum of r_i, total weight): batch EM's update

    def __getattr__(self, name):
        return getattr(self.fitter, name)

    @property
    def per_batch(self) -> bool:
        return not self.fitter.scores_its_pass

    def start_epoch(self, epoch: int) -> None:
        self._epoch, self._sums = epoch, [0.0, 0.0]
        self.fitter.start_epoch(epoch)

    def observe(self, stats: Statistics) -> None:
        if stats.background is None:
            raise RuntimeError("a fit with a background takes statistics with their background sums")
        responsibility = float(stats.background)
        total = float(stats.n_points) + responsibility
        if self.per_batch and total > 0:
            step = self.fitter.step_size(self._epoch)
            weight = (1.0 - step) * self.background.weight + step * responsibility / total
            self.background = self.background.with_weight(min(weight, _HIGHEST))
        else:
            self._sums = [self._sums[0] + responsibility, self._sums[1] + total]
        self.fitter.observe(stats)

    def end_epoch(self) -> None:
        if not self.per_batch and self._sums[1] > 0:
            self.background = self.background.with_weight(min(self._sums[0] / self._sums[1], _HIGHEST))
        self.fitter.end_epoch()

    def diagnostics(self) -> dict:
        return {**self.fitter.diagnostics(), "background_weight": self.background.weight}

    def state_dict(self) -> dict:
        sums = torch.tensor([self.background.weight, *self._sums], dtype=torch.float64)
        return {**self.fitter.state_dict(), "background": sums}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        weight, *sums = state.pop("background").tolist()
        self.background = self.background.with_weight(weight)
        self._sums = sums
        self.fitter.load_state_dict(state)


# The background's weight stays below 1, where the Gaussian part keeps a share to fit.
_HIGHEST = 1.0 - 1e-9


def check_background(background: Background, train, settings, selection) -> None:
    """Refuse, naming the setting, what a fit with a background cannot take (``train``: the training
    ``DataSource``; ``settings``: its ``FitSettings``; ``selection``: the fit's, or None)."""
    if not isinstance(background, Background):
        raise ValueError(f"background must be a background.Background, got {background!r}")
    if selection is not None:
        raise ValueError("background: not with a selection (the points drawn for what it removed would need a share)")
    if settings.split_merge:
        raise ValueError("background: not with split_merge (its moves judge the mixture without the background)")
    refuse_unsupported(train)
    if background.dim != train.obs_dim:
        raise ValueError(f"background: its box has {background.dim} features, the data {train.obs_dim}")


def refuse_unsupported(data) -> None:
    """Refuse data (a training source, or a batch of a streamed one) that a background's box cannot describe:
    projected (R) or with missing entries, whose measured features differ from point to point."""
    for name, what in (("R", "projections R"), ("observed", "missing entries")):
        if getattr(data, name, None) is not None:
            raise ValueError(f"background: not with {what} (its box is one region of the measured features)")


def background_of(fitter) -> Background | None:
    """The fitter's background (a ``BackgroundFit``'s), or None."""
    return fitter.background if isinstance(fitter, BackgroundFit) else None
