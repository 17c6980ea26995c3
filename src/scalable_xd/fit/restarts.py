"""Restarts (scikit-learn's ``n_init``): a plan fitted from that many starts, the best kept.

XD's likelihood has many local optima, and which one a fit reaches depends on its start (k-means' seeding)
and, for the minibatch methods, on its batch order. Start s is the fit of seed ``random_state + s`` (so a
start can be fitted alone, and ``n_init = 1`` is the plain fit); each is judged by its final mean
log-likelihood on the validation data where the plan has them, else on the training data (the history's
last ``val_loglik`` or ``train_loglik``), and every start's score is kept beside the best's fit. A start
whose fit diverges is left out, with one warning naming each; where every start diverges, the last one's
error is raised. The kept start's warnings (not converged, components left empty) are the user's, given at
the user's line; a discarded start's are logged (INFO), naming it. With a checkpoint, each start has its
own file beside it (``start_checkpoint``), so an interrupted run resumes the start it was in, and the
starts already done are read back, not refitted; without ``random_state``, with the seeds it drew (read
from the files).
The data are read and checked once, for all of them (``fit.plan``); the minibatch methods' starts on the
CPU, and replayed on CUDA, advance in lockstep, each step one pass and one update call for all of them
(``fit.run.lockstep``), and each start ends as it would alone. Starts are fitted ``STARTS_AT_ONCE`` at a time and
only the best fit so far is kept, so any ``n_init`` runs in the memory of one group.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

from .._torch import resolve_device
from ..errors import FitDivergedError, warn_at_user
from ..settings import FitSettings, resolve_seed
from .driver import Fitted, fit_mixture
from .methods import method
from .plan import FitPlan
from .run.checkpoint import Checkpoint
from .run.lockstep import Lockstep, Member, raise_failure
from .run.parallel import Group, check_same_fit, shared_seed


@dataclasses.dataclass
class Restarts:
    """What restarts found: each start's score (None where it diverged) and which start was kept."""

    scores: list[float | None]
    best: int


log = logging.getLogger("scalable_xd.fit")
# Starts fitted at once (in lockstep where they can be), at most: the starts are fitted in groups of this many
# and only the best fit so far is kept, so memory does not grow with ``n_init`` (a lockstep start holds its
# fitter, its batch's statistics and its loop: 6 MB at K = 64, D = 7, 12 MB at K = 256, measured as peak
# memory; n_init = 10**6 at once grew past 2 GB within minutes). Ten starts together already take 7-8 times
# one fit's time where ten alone take ten (docs/performance.md, "Fits in lockstep"): larger groups gain little.
STARTS_AT_ONCE = 16


def fit_best_of(plan: FitPlan) -> tuple[Fitted, Restarts]:
    """The best of ``plan.settings.n_init`` starts' fits, and every start's score."""
    n_init = plan.settings.n_init
    if n_init is None:
        raise ValueError("n_init=None is resolved when the fit is planned (plan.with_starts)")
    # what decides the starts' collectives, compared first: a rank with fewer starts, or one that draws the seed
    # where another was given it, would otherwise leave the others waiting in a collective it never joins
    random_state = "given" if plan.random_state is not None else "none (rank 0's seed is drawn)"
    check_same_fit(Group.current(), {"n_init": n_init, "random_state": random_state})
    if n_init == 1:
        fitted = fit_mixture(plan)
        _say(fitted.warnings)
        return fitted, Restarts([_score(fitted, plan)], 0)
    base = plan.random_state
    if base is None:  # the seeds an interrupted run drew, else one drawn for every start and process: rank 0's
        base = _drawn_before(plan.checkpoint, n_init)
    if base is None:
        base = shared_seed(Group.current(), resolve_seed(None))
    base = resolve_seed(base)
    seeds = [(base + start) % 2**63 for start in range(n_init)]
    kept = _Kept(seeds)
    for first in range(0, n_init, STARTS_AT_ONCE):
        group = range(first, min(first + STARTS_AT_ONCE, n_init))
        kept.add(group, fit_together([_start_plan(plan, seeds[s], s) for s in group]), plan)
    if kept.fit is None:  # every start diverged: the others named, the last one's error raised
        warn_at_user("n_init: every start diverged; " + "; ".join(kept.diverged[:-1]), UserWarning)
        raise kept.last_error  # type: ignore[misc]
    if kept.diverged:
        warn_at_user(
            f"n_init: {len(kept.diverged)} of {n_init} starts diverged and are left out: " + "; ".join(kept.diverged),
            UserWarning,
        )
    _say(kept.fit.warnings)
    return kept.fit, Restarts(kept.scores, kept.start)


@dataclasses.dataclass
class _Kept:
    """The best start so far (its index, score and fit), every start's score, and the diverged ones named."""

    seeds: list[int]
    start: int = -1
    score: float = -float("inf")
    fit: Fitted | None = None
    scores: list[float | None] = dataclasses.field(default_factory=list)
    diverged: list[str] = dataclasses.field(default_factory=list)
    last_error: FitDivergedError | None = None

    def add(self, group: range, fits: list, plan: FitPlan) -> None:
        """Take a group of starts' fits (in start order); log what the starts left out said (INFO)."""
        previous_start, previous_fit = self.start, self.fit
        for start, result in zip(group, fits):
            if isinstance(result, FitDivergedError):
                self.scores.append(None)
                self.diverged.append(f"start {start} (seed {self.seeds[start]}): {result}")
                self.last_error = result
                continue
            self.scores.append(score := _score(result, plan))
            if self.fit is None or score > self.score:  # a tie keeps the earlier start
                self.start, self.score, self.fit = start, score, result
        left_out = [(s, f) for s, f in zip(group, fits) if isinstance(f, Fitted) and s != self.start]
        if previous_fit is not None and previous_start != self.start:
            left_out.insert(0, (previous_start, previous_fit))
        for start, fit in left_out:
            for message, _ in fit.warnings:  # about a model the user does not get
                log.info(
                    "n_init: start %d (seed %d), left out for start %d: %s",
                    start,
                    self.seeds[start],
                    self.start,
                    message,
                )


def _start_plan(plan: FitPlan, seed: int, start: int) -> FitPlan:
    """Start ``start``'s plan: seed ``seed``, and its own checkpoint beside the plan's."""
    path = None if plan.checkpoint is None else start_checkpoint(plan.checkpoint, start)
    return dataclasses.replace(plan, random_state=seed, checkpoint=path)


def _say(said: list) -> None:
    """The kept fit's warnings, at the user's line."""
    for message, category in said:
        warn_at_user(message, category)


def fit_together(plans: list[FitPlan]) -> list[Fitted | FitDivergedError]:
    """Each plan's fit, or its divergence (any other error is raised, the first plan's first): in lockstep
    where their steps can be taken together (``lockstep``: minibatch methods on the CPU or replayed on CUDA, one
    process), else
    one after another. Each fit is the one its plan gives alone."""
    if len(plans) > 1 and plans[0].lockstep is None and in_lockstep(plans[0].settings):
        results = Lockstep(survivable=(FitDivergedError,)).run([functools.partial(_member_fit, p) for p in plans])
    else:
        results = [_fit_or_divergence(plan) for plan in plans]
    raise_failure(results, survivable=(FitDivergedError,))
    return results


def _member_fit(plan: FitPlan, member: Member) -> Fitted:
    return fit_mixture(dataclasses.replace(plan, lockstep=member))


def _fit_or_divergence(plan: FitPlan) -> Fitted | FitDivergedError:
    try:
        return fit_mixture(plan)
    except FitDivergedError as err:
        return err


def in_lockstep(settings: FitSettings) -> bool:
    """Whether fits of these settings step together: minibatch steps on the CPU, or replayed on CUDA
    (``cuda_graphs``), in one process (the threads' turns are not the same in every process, and
    collectives would meet out of order)."""
    per_batch = method(settings.method).per_batch
    device = resolve_device(settings.device).type
    together = device == "cpu" or (device == "cuda" and settings.cuda_graphs)
    return per_batch and together and not Group.current().parallel


def _score(fitted: Fitted, plan: FitPlan) -> float:
    """A start's final mean log-likelihood: on the validation data where the plan has them, else training."""
    return float(fitted.history[-1]["val_loglik" if plan.val is not None else "train_loglik"])


def _drawn_before(checkpoint, n_init: int) -> int | None:
    """The base seed an interrupted run of these starts drew (start s's checkpoint holds seed base + s), so
    that a fit without ``random_state`` resumes with its own seeds; None where no start has a checkpoint."""
    for start in range(n_init if checkpoint is not None else 0):
        seed = Checkpoint(start_checkpoint(checkpoint, start)).seed
        if seed is not None:
            return (seed - start) % 2**63
    return None


def start_checkpoint(path, start: int) -> Path:
    """Start ``start``'s checkpoint file, beside ``path``: fit.ckpt -> fit.start2.ckpt."""
    path = Path(path)
    return path.with_name(f"{path.stem}.start{start}{path.suffix}")
