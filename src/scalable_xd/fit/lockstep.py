"""Several fits of one data set in lockstep: each step, every fit's minibatch in one statistics pass and
one update call (restarts, ``n_init``; a grid cell's seeds, ``pipeline.steps.fit``).

Each fit runs its own loop (``loop.run``: its start, batch order, scoring, checkpoints and history, as
alone) in a thread of its own, but the threads take turns: one runs at a time, holding the baton
(``Lockstep``), so nothing they share (torch's and numba's thread pools, the data) is used twice at once
and no fit's arithmetic depends on the others'. Where a fit's loop asks its engine for a step, it posts
the batch and hands the baton on; the last fit to post runs every posted step at once (the engine's
``together``: on the CPU, ``engines.cpu.steps_together``, one ensemble pass over the S batches,
``kernel.ensemble_pass``, and for online EM the S updates in one compiled call,
``cpu_rules.online_em_steps``; SGD's Adam steps one compiled call a fit). A fit that scores, checkpoints
or has finished posts nothing, and the others wait for it, so the fits stay in step. Each fit's
statistics and update are computed as alone, so a fit in lockstep ends with the parameters it ends with
alone, to the bit (``tests/fit/test_lockstep.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


class Lockstep:
    """The baton S fits' threads pass: ``run`` runs each job in its thread, one at a time; ``step`` posts a
    job's step, a request whose ``together(requests)`` runs every posted step at once (called by the last
    live fit to post; it returns each request's error or None). A job that fails with an error not
    ``survivable`` (an interrupt, a bug) stops the others at their next step (``LockstepStopped``), as the
    error would stop fits run one after another."""

    def __init__(self, survivable: tuple[type[BaseException], ...] = ()) -> None:
        self._baton = threading.Condition()
        self._survivable = survivable
        self._live = 0
        self._posted: dict[int, Any] = {}
        self._done: dict[int, BaseException | None] = {}
        self._stopped: BaseException | None = None

    def run(self, jobs: list[Callable[[Member], Any]]) -> list[Any]:
        """Each job's result, or the exception it raised, in order; job s is called with its ``Member``."""
        results: list[Any] = [None] * len(jobs)

        def body(index: int) -> None:
            with self._baton:
                try:
                    results[index] = jobs[index](Member(self, index))
                except BaseException as err:  # handed to the caller, which decides
                    results[index] = err
                    if not isinstance(err, self._survivable) and self._stopped is None:
                        self._stop(err)
                finally:
                    self._leave()

        self._live = len(jobs)
        threads = [
            threading.Thread(target=body, args=(s,), name=f"lockstep-fit-{s}", daemon=True) for s in range(len(jobs))
        ]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                thread.join()
        except BaseException as err:  # an interrupt of the caller's thread stops every fit
            with self._baton:
                self._stop(err)
            raise
        return results

    def step(self, index: int, request) -> None:
        """Post fit ``index``'s step and wait until it is done (with the others'), holding the baton."""
        if self._stopped is not None:
            raise LockstepStopped(self._stopped)
        self._posted[index] = request
        if len(self._posted) == self._live:
            self._flush()
        while index not in self._done and self._stopped is None:
            self._baton.wait()
        if index not in self._done:
            raise LockstepStopped(self._stopped)
        error = self._done.pop(index)
        if error is not None:
            raise error

    def _stop(self, err: BaseException) -> None:
        self._stopped = err
        self._baton.notify_all()

    def _leave(self) -> None:
        """A fit finished (or failed): the others no longer wait for its steps."""
        self._live -= 1
        if self._posted and len(self._posted) == self._live:
            self._flush()

    def _flush(self) -> None:
        posted, self._posted = sorted(self._posted.items()), {}
        try:
            requests = [request for _, request in posted]
            errors = requests[0].together(requests)  # each fit's own error, or None
        except BaseException as err:  # every fit of the step learns of it (an interrupt too: none waits on)
            errors = [err] * len(posted)
        self._done.update((index, error) for (index, _), error in zip(posted, errors))
        self._baton.notify_all()


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


class LockstepStopped(RuntimeError):
    """A fit in lockstep stopped because another failed (its error is the cause)."""

    def __init__(self, cause: BaseException | None):
        super().__init__(f"stopped with the fits in lockstep: another failed ({cause!r})")
        self.__cause__ = cause
