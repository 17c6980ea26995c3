"""What the CPU's compiled (numba) forms of the rules share, none of it compiled: a rule bound to its fitter
(``ArrayRule``), a batch's sums as arrays, the views of long-lived tensors, D as a tuple numba unrolls by."""

from __future__ import annotations

import numpy as np
import torch

from ...kernel.statistics import Statistics
from .em import ridge_vector


def dimensions(dim: int) -> tuple[int, ...]:
    """D as the length of a tuple, which numba knows when it compiles a loop (one compilation per D): its
    D x D loops then unroll (a quarter off online EM's update at D = 7: docs/performance.md), with the same
    arithmetic in the same order, so the same results to the bit."""
    return (0,) * dim


def sums_of(stats: Statistics) -> tuple:
    """A CPU batch's Statistics as the compiled steps take them: (n points, q, U, UU, P) as arrays."""
    return (float(stats.n_points), stats.q.numpy(), stats.U.numpy(), stats.UU.numpy(), stats.P.numpy())


def ridge_array(w, dim: int, dtype: torch.dtype) -> np.ndarray | None:
    """W's diagonal (``ridge_vector``) as a (D,) array of ``dtype`` for a compiled update, None for none."""
    ridge = ridge_vector(w, torch.empty(dim, dtype=dtype))
    return None if ridge is None else ridge.numpy()


class CachedViews:
    """The arrays a compiled step reads from tensors that live from step to step (SGD's parameters, Adam's
    moments, the fixed parameters), made once and made again only where one of those tensors was replaced
    (a state loaded, fixed parameters released): the step updates them in place, so the views stay theirs.
    SGD's step reads 17 of them: made at every step, they added a third to its call (docs/performance.md)."""

    def __init__(self) -> None:
        self._held: tuple[tuple, tuple] = ((), ())

    def __getstate__(self) -> dict:
        """Nothing: a copy (pickled, deep-copied) holds copies of the tensors and arrays that no longer
        share memory, so it makes its own views."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self._held = ((), ())

    def __call__(self, tensors: tuple, make) -> tuple:
        """``make(tensors)``, from the last call where it was given these same tensor objects."""
        held, arrays = self._held
        if len(held) != len(tensors) or any(mine is not theirs for mine, theirs in zip(held, tensors)):
            arrays = make(tensors)
            self._held = (tensors, arrays)  # one assignment: a reader sees the old pair or the new
        return arrays


class ArrayRule:
    """A compiled rule bound to its fitter: ``observe_sums`` takes a batch's sums as the pass's arrays (n
    points, q, U, UU, P), ``observe`` a batch's ``Statistics`` (made arrays), ``arrays`` is the mixture the
    pass reads; ``views`` keeps the arrays of the tensors that live from step to step."""

    def __init__(self, fitter):
        self.fitter, self.views = fitter, CachedViews()

    def observe(self, stats: Statistics) -> None:
        self.observe_sums(*sums_of(stats))

    def observe_sums(self, n: float, q, U, UU, P) -> None:
        raise NotImplementedError

    def arrays(self) -> tuple:
        raise NotImplementedError

    @staticmethod
    def update_together(rules: list, n: float, sums: tuple) -> None:
        """The updates of several fits of this form in one compiled call, their batches' sums stacked on a
        leading fit axis (``EnsemblePass``); each fit's arithmetic as its own call's."""
        raise NotImplementedError
