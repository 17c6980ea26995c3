"""Exceptions that carry enough context (row, component, epoch) to act on, and how a value is shown in one."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path


def warn_at_user(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` at the first caller outside this library and scikit-learn (whose wrappers call
    ``fit``): the user's line, however deep in the library the warning was found (the outermost frame where
    every caller is the library's, as under its command line)."""
    import sklearn

    inside = tuple(str(Path(str(module.__file__)).parent) + "/" for module in (sys.modules[__package__], sklearn))
    frame, level = sys._getframe(1), 2  # stacklevel 2: the frame that called this
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


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
        self.reason = reason
        super().__init__(f"{self.diagnosis}. Try {cures}.")

    @property
    def diagnosis(self) -> str:
        """What diverged and where: the message without its cures."""
        where = f"epoch {self.epoch}" + (f", batch {self.batch}" if self.batch is not None else "")
        return f"fit diverged at {where}: component {self.component} {self.reason}"
