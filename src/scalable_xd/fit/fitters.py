"""What the training loop drives: the ``Fitter`` protocol, the defaults of its capability flags, and what
the fitter families (``batch_em``, ``minibatch_em``, ``sgd``, ``averaging``; ``squarem``, ``split_merge``) share.

Each fitter sees the same stream of kernel statistics: ``start_epoch(epoch)``, then ``observe(stats)``
for every batch, then ``end_epoch()``. Batch EM sums the statistics over the whole data set and updates
once an epoch; minibatch EM and SGD update after every batch. ``state_dict``/``load_state_dict`` carry
everything needed to resume from a checkpoint and continue exactly as an uninterrupted fit would. A
fitter's update rule is defined once, in torch (``rules``); where a device has a compiled form of it
(``rules.forms``, by the name ``rule``), the fitter's ``compiled`` runs it instead.

Parameters and their updates are kept in float64 whatever precision the statistics pass runs in: they are
K x D x D numbers, and Gaia's features need the range (a component can be 1e7 times narrower in parallax
than on the sky, a condition number float32 cannot even store as a positive-definite matrix).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..kernel.statistics import Statistics
from ..mixture import Mixture


class Fitter(Protocol):
    """What the loop drives: ``mixture`` is the model the E-step uses; ``result`` the one the fit reports
    (the same, except under Polyak averaging)."""

    @property
    def mixture(self) -> Mixture: ...

    @property
    def result(self) -> Mixture: ...

    @property
    def samples_assignments(self) -> bool:
        """Stochastic EM: the loop passes uniforms for the S-step."""

    @property
    def wants_criteria(self) -> bool:
        """Split-and-merge: the loop asks the kernel for the criteria's sums."""

    @property
    def finished(self) -> bool:
        """Split-and-merge: no move left to try, so the fit is done."""

    @property
    def trial_mixture(self) -> Mixture | None:
        """Stochastic split-and-merge: a trial model that gets its own statistics pass."""

    @property
    def scores_its_pass(self) -> bool:
        """Batch EM: an epoch's sums hold the training log-likelihood of its starting model."""

    @property
    def reads_batch_loglik(self) -> bool:
        """Whether ``observe`` reads its statistics' summed log-likelihood (minibatch EM's and SGD's updates
        do not: the pass may skip summing it)."""

    def step_size(self, epoch: int) -> float:
        """The step size (1 for batch EM, the learning rate for SGD) used in ``epoch`` (0-based)."""

    def start_epoch(self, epoch: int) -> None: ...

    def observe(self, stats: Statistics) -> None:
        """Take one batch's kernel statistics (an update, or a sum towards one)."""

    @property
    def rule(self) -> str | None:
        """The name its update rule's compiled forms are registered under (``rules.forms``); None
        where no engine takes its batches by such a form (a wrapper, an update made once an epoch)."""

    @property
    def compiled(self) -> CompiledRule | None:
        """The compiled form of its rule on its device, which its every update runs; None: its torch rule."""

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

    def observe_trial(self, stats: Statistics) -> None:
        """(Called where ``trial_mixture`` is not None.) The statistics of the trial model's pass over the batch."""


class CompiledRule(Protocol):
    """A compiled form of a fitter's update rule (``rules.forms``), bound to the fitter whose
    parameters it updates. ``observe`` is the fitter's update from a batch's statistics; each engine asks
    more of the forms in its own tables (the CPU's take the pass's arrays, CUDA's replay in place)."""

    def observe(self, stats: Statistics) -> None: ...


@runtime_checkable
class TrialFitter(Fitter, Protocol):
    """What stochastic split-and-merge asks of a minibatch fitter to run a trial copy beside it."""

    @property
    def starting_point(self) -> Mixture:
        """The parameters a copy of this fit starts from."""

    def continue_schedule(self, other: TrialFitter) -> None:
        """Take up ``other``'s step-size schedule where it is."""

    def release_fixed(self) -> None:
        """Let every parameter move again (the trial's partial updates are over)."""


class Capabilities:
    """``Fitter``'s capability flags at their common values, which a fitter overrides where it differs: it
    takes the assignments' expected values (stochastic EM samples them), asks for no split-and-merge
    criteria, runs until its budget or ``tol``, has no trial model beside it, its pass does not score the
    model it started from (batch EM's does), and it reads its statistics' summed log-likelihood (minibatch
    EM's and SGD's updates do not); the methods the loop calls only where a flag says so refuse to be
    called elsewhere."""

    # The flags' values, which a fitter sets (or overrides the property of) where it differs.
    _samples_assignments = False
    _wants_criteria = False
    _scores_its_pass = False
    _reads_batch_loglik = True
    rule: str | None = None
    compiled: CompiledRule | None = None

    @property
    def samples_assignments(self) -> bool:
        return self._samples_assignments

    @property
    def wants_criteria(self) -> bool:
        return self._wants_criteria

    @property
    def finished(self) -> bool:
        return False

    @property
    def trial_mixture(self) -> Mixture | None:
        return None

    @property
    def scores_its_pass(self) -> bool:
        return self._scores_its_pass

    @property
    def reads_batch_loglik(self) -> bool:
        return self._reads_batch_loglik

    def pass_loglik(self) -> float:
        raise TypeError(f"{type(self).__name__}'s pass does not score the model it started from (scores_its_pass)")

    def pass_objective(self) -> float | None:
        raise TypeError(f"{type(self).__name__}'s pass does not score the model it started from (scores_its_pass)")

    def observe_trial(self, stats: Statistics) -> None:
        raise TypeError(f"{type(self).__name__} has no trial model beside it (trial_mixture)")


def mixture_state(mixture: Mixture) -> dict:
    return {"weights": mixture.weights, "means": mixture.means, "covariances": mixture.covariances}


def mixture_from_state(state: dict, like: Mixture) -> Mixture:
    device = like.means.device
    return Mixture(*(state[k].to(device=device, dtype=torch.float64) for k in ("weights", "means", "covariances")))
