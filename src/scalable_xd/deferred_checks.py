"""Checks deferred to the epoch's end, so that a GPU never waits for a batch.

A per-batch test of a rare event (a pair whose V_j + S_i cannot be factorised in float32, a covariance
that rounding left indefinite, a batch of zero total weight) asks the device a question, and on a GPU
each question stops the host until the device has caught up with everything queued before it. Within
``deferring(device)`` such tests record on the device that the event happened instead, and the training
loop asks once, at the epoch's end (``DeferredChecks.tripped``). Where it did happen, the loop runs the
epoch again from its start with every test made at its batch, so the fit's result is the same as with
no deferring; the common epoch never waits.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch


class DeferredChecks:
    """A flag on the device, raised by any event ``note``d since it was made."""

    def __init__(self, device):
        self._flag = torch.zeros((), dtype=torch.bool, device=device)

    def note(self, event: torch.Tensor) -> None:
        """Record (without waiting for the device) whether any entry of ``event`` is true."""
        self._flag |= event.any()

    def clear(self) -> None:
        """Lower the flag, in place (a captured CUDA graph keeps writing to the same flag)."""
        self._flag.zero_()

    def tripped(self) -> bool:
        """Whether any event was noted: the one question asked of the device."""
        return bool(self._flag)


_active: ContextVar[DeferredChecks | None] = ContextVar("deferred_checks", default=None)


def defers_on(device) -> bool:
    """Whether work on ``device`` defers its per-batch tests (a fit's epochs, a scoring's batches): on GPUs,
    where a test waits for the device; on the CPU a test costs nothing."""
    return torch.device(device).type == "cuda"


def active() -> DeferredChecks | None:
    """The checks of the enclosing ``deferring`` block, or None where tests run at their batch."""
    return _active.get()


@contextmanager
def deferring(device, checks: DeferredChecks | None = None):
    """Defer the per-batch tests within the block to the ``DeferredChecks`` it yields: ``checks``, cleared,
    where given (the flag a captured step writes to, ``fit.engines.cuda``), else new ones."""
    if checks is None:
        checks = DeferredChecks(device)
    else:
        checks.clear()
    with noting(checks):
        yield checks


@contextmanager
def noting(checks: DeferredChecks):
    """Defer the tests within the block to ``checks`` as they stand (not cleared): a fit's step taken
    outside its own loop, beside other fits' (``fit.engines.cuda``'s ensemble step)."""
    token = _active.set(checks)
    try:
        yield checks
    finally:
        _active.reset(token)


def positive_weight(n_points) -> bool:
    """Whether a batch's total weight ``n_points`` is positive; where it is a tensor on the device (checks
    deferred), noted for the epoch's end and taken as true."""
    checks = active()
    if checks is not None and torch.is_tensor(n_points):
        checks.note(n_points <= 0)
        return True
    return n_points > 0
