"""Exceptions that carry enough context (row, component, epoch) to act on, and how a value is shown in one."""

from __future__ import annotations


def brief(value) -> str:
    """``value``'s repr for an error message, or for a long list (a K-long mask) its length and first entries."""
    text = repr(value)
    if len(text) <= 60:
        return text
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(repr, value[:4]))}, ... ({len(value)} entries)]"
    return text[:57] + "..."


class NotPositiveDefiniteError(ValueError):
    """A convolved covariance T = R V R^T + S could not be factorised.

    ``row`` indexes the data point within the array passed in, ``component`` the mixture component.
    """

    def __init__(self, row: int, component: int, message: str | None = None):
        self.row = row
        self.component = component
        super().__init__(
            message or f"the covariance V_j + S_i of data row {row} and component {component} is not positive definite"
        )


class FitDivergedError(RuntimeError):
    """A fit produced non-finite or non-positive-definite parameters.

    Raised instead of returning NaNs; the message names the epoch, batch and component and the cures that
    would change something for this fit (``cures``, e.g. from ``fit.driver.divergence_cures``).
    """

    def __init__(self, epoch: int, component: int, reason: str, cures: str, batch: int | None = None):
        self.epoch = epoch
        self.batch = batch
        self.component = component
        where = f"epoch {epoch}" + (f", batch {batch}" if batch is not None else "")
        super().__init__(f"fit diverged at {where}: component {component} {reason}. Try {cures}.")
