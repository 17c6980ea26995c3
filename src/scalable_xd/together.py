"""Several estimators fitted to one data set: a grid cell's seeds, or any set of fits a study compares.

``fit_together`` fits each of a list of ``XDGMM`` estimators, which differ at most in their seed
(``random_state``) and initial arrays (``weights_init``, ``means_init``, ``covariances_init``). Where their
method steps in lockstep (the minibatch methods on the CPU, and replayed on CUDA: ``steps_together``), each
step is one statistics pass and one update call for all of them (``fit.run.lockstep``); otherwise they are
fitted one after another. Either way each ends with the parameters its own ``fit`` would give, to the bit on
the CPU (``tests/estimator/test_together.py``), and each keeps its own checkpoint. A fit in lockstep keeps its
own history, but its clock counts the others' work too: time a fit alone (docs/performance.md, "Fits in
lockstep": ten fits together cost 6 to 8 times one on 2 cores).
"""

from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .errors import warn_at_user
from .estimator import XDGMM
from .fit.run.lockstep import current

# What the fits may differ in: their seed and their start.
_PER_FIT = ("random_state", "weights_init", "means_init", "covariances_init")


def steps_together(models: list[XDGMM]) -> bool:
    """Whether ``fit_together`` fits these estimators in lockstep: more than one, every setting the same
    but the seed and start, a method that steps so on their device, and one process."""
    _check_models(models)
    return _in_lockstep(models)


def _in_lockstep(models: list[XDGMM]) -> bool:
    """``steps_together`` for models already checked (``_check_models``)."""
    from .fit.restarts import in_lockstep

    return len(models) > 1 and in_lockstep(models[0]._validated()[0])


def fit_together(models: list[XDGMM], X, Xcov=None, *, checkpoints=None, **fit_params) -> list[XDGMM]:
    """Fit every estimator of ``models`` to X (and Xcov), each as its ``fit`` would alone, and return them.
    ``checkpoints``: one file (or None) a fit, in the models' order; ``fit_params``: the other arguments of
    ``XDGMM.fit`` (validation data, ``eval_sets``, a ``selection``), the same for every fit. The first error
    a fit raises is raised, the others stopped at their next step; their checkpoints let a rerun resume each.
    What a fit warns of is said at the caller's line, naming the model (``models[1]: ...``)."""
    from .fit.run.lockstep import Lockstep, raise_failure

    _check_models(models)
    paths = [None] * len(models) if checkpoints is None else list(checkpoints)
    if len(paths) != len(models):
        raise ValueError(f"checkpoints: {len(paths)} for {len(models)} models; give one (or None) a model")
    named = [str(Path(p).resolve()) for p in paths if p is not None]
    if len(set(named)) != len(named):
        raise ValueError("checkpoints: two models share a checkpoint file; give each its own")
    fits = [
        functools.partial(model.fit, X, Xcov=Xcov, checkpoint=path, **fit_params) for model, path in zip(models, paths)
    ]
    said: list[tuple[int, warnings.WarningMessage]] = []
    try:
        if not _in_lockstep(models):
            for index, fit in enumerate(fits):
                with _told(said, lambda index=index: index):
                    fit()
        else:
            with _told(said, lambda: getattr(current(), "index", -1)):  # the member whose greenlet warns
                raise_failure(Lockstep().run([functools.partial(_as_member, fit) for fit in fits]))
    finally:
        for index, record in said:
            warn_at_user(f"models[{index}]: {record.message}", record.category)
    return models


@contextmanager
def _told(said: list, index):
    """Collect the warnings the block issues (through the caller's filters) as (``index()``, warning)."""
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, category, *rest: said.append(
            (index(), warnings.WarningMessage(message, category, *rest))
        )
        yield


def _as_member(fit, member) -> XDGMM:
    with member.joined():  # the fit's plan takes the member (``fit.plan.plan_fit``), its engine steps through it
        return fit()


def _check_models(models: list[XDGMM]) -> None:
    """Refuse an empty list, a model that is not an ``XDGMM``, one listed twice, and models whose settings
    differ in more than their seed and start (naming the first setting)."""
    if not models:
        raise ValueError("models: an empty list; give at least one XDGMM")
    for index, model in enumerate(models):
        if not isinstance(model, XDGMM):
            raise TypeError(f"models[{index}]: an XDGMM, not {type(model).__name__}")
    if len({id(model) for model in models}) != len(models):
        raise ValueError("models: an estimator listed twice; give each fit its own XDGMM (sklearn.base.clone)")
    first = models[0].get_params()
    for index, model in enumerate(models[1:], start=1):
        for name, value in model.get_params().items():
            if name not in _PER_FIT and not _same(value, first[name]):
                raise ValueError(
                    f"models[{index}].{name} = {value!r} but models[0].{name} = {first[name]!r}: the fits "
                    f"may differ only in {', '.join(_PER_FIT)}"
                )


def _same(a, b) -> bool:
    """Equal settings, arrays (the fixed-parameter masks) compared by value."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    return bool(a == b)
