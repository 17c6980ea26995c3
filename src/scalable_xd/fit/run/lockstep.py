"""Several fits of one data set in lockstep: each step, every fit's minibatch in one statistics pass and
one update call (restarts, ``n_init``; a grid cell's seeds, ``pipeline.fit_steps.fit``).

Each fit runs its own loop (``loop.run``: its start, batch order, scoring, checkpoints and history, as alone)
as a greenlet (a coroutine with its own stack) on the caller's thread, so one fit runs at a time, nothing they
share (torch's and numba's thread pools, the data) is used twice at once, and no fit's arithmetic depends on
the others'. On threads of their own each fit's parallel regions would start an OpenMP team of their own,
whose spinning workers took a 2-core machine's time (an ensemble's epoch at twice the cost). Where a fit's
loop asks its engine for a step, it posts the batch and hands the turn back; once every fit has posted, every
posted step runs at once (the engine's ``together``: on the CPU, ``engines.cpu.steps_together``, one ensemble
pass over the S batches, ``kernel.ensemble_pass``, and the S updates in one compiled call,
``ArrayRule.update_together`` (``rules.online_em_numba``'s or ``rules.sgd_numba``'s); on CUDA,
``engines.cuda.steps_together``, one replayed graph of one Triton pass over the S batches and the rule's
update kernels over the S fits). On CUDA a fit's scorings are posted too, and the fits that score one data set
at once share one pass over it (``scoring.scores_together``). A fit that checkpoints or has finished posts
nothing, and the others wait for it, so the fits stay in step. Each fit's statistics and update are computed
as alone, so a fit in lockstep ends with the parameters it ends with alone: to the bit on the CPU
(``tests/fit/test_lockstep.py``), to float rounding through the Triton pass (``test_cuda_engine.py``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


class Lockstep:
    """S fits as greenlets on the caller's thread: ``run`` resumes each in turn until it posts a step
    (``step``) or ends; once every live fit has posted, the first posted request's ``together(requests)``
    runs them all at once (returning each request's error or None) and each fit resumes with its own. A
    job that fails with an error not ``survivable`` (an interrupt, a bug) stops the others at their next
    step (``LockstepStopped``), as the error would stop fits run one after another."""

    def __init__(self, survivable: tuple[type[BaseException], ...] = ()) -> None:
        self._survivable = survivable
        self._posted: dict[int, Any] = {}
        self._hub: Any = None  # the greenlet ``run`` resumes the fits from
        self._stopped: BaseException | None = None
        self.shared: dict[str, dict] = {}  # what the fits' engines keep for their steps together, by engine

    def run(self, jobs: list[Callable[[Member], Any]]) -> list[Any]:
        """Each job's result, or the exception it raised, in order; job s is called with its ``Member``."""
        from greenlet import getcurrent, greenlet

        results: list[Any] = [None] * len(jobs)

        def body(index: int) -> None:
            try:
                results[index] = jobs[index](Member(self, index))
            except BaseException as err:  # handed to the caller, which decides
                results[index] = err
                if not isinstance(err, self._survivable) and self._stopped is None:
                    self._stopped = err

        self._hub = getcurrent()
        fits = {s: greenlet(functools.partial(body, s), parent=self._hub) for s in range(len(jobs))}
        replies: dict[int, BaseException | None] = dict.fromkeys(fits)
        while fits:
            for index in sorted(fits):  # each runs to its next step, or to its end
                reply = replies[index]
                if self._stopped is not None and index in self._posted:
                    reply = LockstepStopped(self._stopped)
                fit = fits[index]
                fit.switch(reply) if reply is not None else fit.switch()  # started with no argument
                if fit.dead:
                    del fits[index]
            posted, self._posted = sorted(self._posted.items()), {}
            if posted and self._stopped is None:
                replies = {}
                for together, group in _by_kind(posted):
                    try:
                        errors = together([request for _, request in group])  # each fit's own error, or None
                    except Exception as err:  # every fit of the group learns of it
                        errors = [err] * len(group)
                    replies.update({index: error for (index, _), error in zip(group, errors)})
            else:
                self._posted = dict(posted)  # stopped: each is told so when resumed
        return results

    def step(self, index: int, request) -> None:
        """Post fit ``index``'s step, hand the turn back, and take up its outcome once every fit's step ran."""
        self._posted[index] = request
        error = self._hub.switch()  # (): resumed with no error
        if isinstance(error, BaseException):
            raise error


def _by_kind(posted: list[tuple[int, Any]]) -> list[tuple[Callable, list[tuple[int, Any]]]]:
    """The posted (fit, request) pairs grouped by the function that takes them together (steps of one
    engine, scorings: ``scoring.scores_together``), in the order each kind was first posted."""
    kinds: dict[Callable, list[tuple[int, Any]]] = {}
    for index, request in posted:
        kinds.setdefault(request.together, []).append((index, request))
    return list(kinds.items())


@dataclass
class StepRequest:
    """A fit's step posted to its lockstep: its engine, the batch, the epoch and the batch's number, and
    ``together``, the engine module's function that takes every posted step at once and returns each fit's
    error or None (``engines.cpu.steps_together``, ``engines.cuda.steps_together``)."""

    engine: Any
    batch: Any
    epoch: int
    number: int
    together: Callable[[list[StepRequest]], list[BaseException | None]]


def caught(step: Callable, *args) -> BaseException | None:
    """The error ``step(*args)`` raised, or None: one fit's failure in a step taken for several is its own."""
    try:
        step(*args)
    except Exception as err:
        return err
    return None


@dataclass(frozen=True)
class Member:
    """One fit's place in a ``Lockstep``: what its engine posts its steps to."""

    lockstep: Lockstep
    index: int

    def step(self, request) -> None:
        self.lockstep.step(self.index, request)

    @contextmanager
    def joined(self):
        """Fits made inside the block (by ``XDGMM.fit``: ``plan.plan_fit`` asks ``current``) step as this
        member: how a job of ``Lockstep.run`` fits an estimator in lockstep with the other jobs'."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)


_current: ContextVar[Member | None] = ContextVar("lockstep_member", default=None)


def current() -> Member | None:
    """The member a fit made now steps as (``Member.joined``), or None: alone."""
    return _current.get()


def raise_failure(results: list, survivable: tuple[type[BaseException], ...] = ()) -> None:
    """Raise the error a ``Lockstep.run``'s results hold that is not ``survivable``: the one that stopped
    the others, not the ``LockstepStopped`` it left them with."""
    failed = [r for r in results if isinstance(r, BaseException) and not isinstance(r, survivable)]
    if failed:
        raise next((r for r in failed if not isinstance(r, LockstepStopped)), failed[0])


class LockstepStopped(RuntimeError):
    """A fit in lockstep stopped because another failed (its error is the cause)."""

    def __init__(self, cause: BaseException | None):
        super().__init__(f"stopped with the fits in lockstep: another failed ({cause!r})")
        self.__cause__ = cause
