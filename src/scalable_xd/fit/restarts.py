"""Restarts (scikit-learn's ``n_init``): a plan fitted from that many starts, the best kept.

XD's likelihood has many local optima, and which one a fit reaches depends on its start (k-means' seeding)
and, for the minibatch methods, on its batch order. Start s is the fit of seed ``random_state + s`` (so a
start can be fitted alone, and ``n_init = 1`` is the plain fit); each is judged by its final mean
log-likelihood on the validation data where the plan has them, else on the training data (the history's
last ``val_loglik`` or ``train_loglik``), and every start's score is kept beside the best's fit. A start
whose fit diverges is left out, with a warning naming it; where every start diverges, the last one's error
is raised. With a checkpoint, each start has its own file beside it (``start_checkpoint``), so an
interrupted run resumes the start it was in, and the starts already done are read back, not refitted.
The starts run one after another: the data are read and checked once, for all of them (``fit.plan``).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

from ..errors import FitDivergedError
from ..settings import resolve_seed
from .driver import Fitted, fit_mixture
from .parallel import Group, shared_seed
from .plan import FitPlan


@dataclasses.dataclass
class Restarts:
    """What restarts found: each start's score (None where it diverged) and which start was kept."""

    scores: list[float | None]
    best: int


def fit_best_of(plan: FitPlan) -> tuple[Fitted, Restarts]:
    """The best of ``plan.settings.n_init`` starts' fits, and every start's score."""
    n_init = plan.settings.n_init
    if n_init == 1:
        fitted = fit_mixture(plan)
        return fitted, Restarts([_score(fitted, plan)], 0)
    base = plan.random_state
    if base is None:  # one seed drawn for every start, and every process: rank 0's
        base = shared_seed(Group.current(), resolve_seed(None))
    base = resolve_seed(base)
    best: tuple[int, float, Fitted] | None = None  # the best start so far, its score and its fit
    scores: list[float | None] = []
    failure: FitDivergedError | None = None
    for start in range(n_init):
        seed = (base + start) % 2**63
        checkpoint = None if plan.checkpoint is None else start_checkpoint(plan.checkpoint, start)
        try:
            fitted = fit_mixture(dataclasses.replace(plan, random_state=seed, checkpoint=checkpoint))
        except FitDivergedError as err:
            warnings.warn(f"n_init: start {start} (seed {seed}) diverged and is left out: {err}", stacklevel=3)
            scores.append(None)
            failure = err
            continue
        score = _score(fitted, plan)
        scores.append(score)
        if best is None or score > best[1]:  # a tie keeps the earlier start
            best = (start, score, fitted)
    if best is None:
        assert failure is not None
        raise failure
    return best[2], Restarts(scores, best[0])


def _score(fitted: Fitted, plan: FitPlan) -> float:
    """A start's final mean log-likelihood: on the validation data where the plan has them, else training."""
    return float(fitted.history[-1]["val_loglik" if plan.val is not None else "train_loglik"])


def start_checkpoint(path, start: int) -> Path:
    """Start ``start``'s checkpoint file, beside ``path``: fit.ckpt -> fit.start2.ckpt."""
    path = Path(path)
    return path.with_name(f"{path.stem}.start{start}{path.suffix}")
