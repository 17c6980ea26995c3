"""Batch EM accelerated by SQUAREM (Varadhan & Roland 2008), converging to EM's own fixed point.

EM's map F moves the parameters a little further each iteration along nearly the same direction once
the fit is past its first few steps; SQUAREM extrapolates along it. A cycle, one statistics pass each:

1. the pass at theta0 scores it and gives theta1 = F(theta0);
2. the pass at theta1 gives theta2 = F(theta1); with r = theta1 - theta0 and v = theta2 - theta1 - r, the
   step alpha = |r| / |v| (scheme S3), clamped to [1, step_max], extrapolates to
   theta' = theta0 + 2 alpha r + alpha^2 v (alpha = 1 gives theta2, plain EM's two steps);
3. the pass at theta' scores it: if its objective is at least theta0's, the cycle ends at F(theta')
   (the stabilising EM step, Varadhan & Roland's section 6); otherwise, or where F(theta') is not a valid
   mixture (a nearly empty component that float32 sums leave indefinite), at theta2 (the monotone
   safeguard: the cycle is then plain EM's two steps, one pass wasted). A theta' that collapses a
   component (its smallest variance below ``COLLAPSE`` of theta2's) is refused before its pass, likewise.

The objective is what EM increases: the log-likelihood, plus, where w > 0, the log of the prior that Bovy et
al.'s regularisation V = (sum + W) / (q + 1) (W = diag(w), their w I) is the maximum of, sum_j -(log|V_j| +
tr(W V_j^-1)) / 2 (with w > 0 an EM step can lower the log-likelihood itself, and plain EM, stopped by its
log-likelihood gain, halts well short of its own fixed point on the objective's flat ridges). Each cycle
starts from where the last ended, so the cycles' starts have ever higher objectives. step_max starts at 1,
grows fourfold each time the step reaches it and shrinks fourfold on a rejection (the defaults of Varadhan &
Roland's SQUAREM package). The extrapolation works in unconstrained coordinates (log weights, means,
Cholesky factors with log diagonals), so theta' is always a valid mixture, with each component's means
and factors in units of its own spread at the cycle's start, so that the step length (which weighs all
coordinates together) is the same whatever units the features are in; fixed parameters and frozen (empty)
components do not move.

Every pass is one epoch of the loop and one entry of ``history_``, which also records each scored
model's mean objective (``train_objective``). ``tol`` judges convergence on the gain in objective of one
EM step, and only of the cycles' first steps (theta0 to theta1), which start on EM's own path: an
entry's ``em_step`` says whether it is one (an extrapolation may gain anything, or lose).
"""

from __future__ import annotations

import torch

from ...mixture import Mixture
from ..fitters import mixture_from_state, mixture_state
from ..rules.em import FixedParameters, em_update, ridge_vector, share_weights
from ..rules.sgd import component_scale
from .batch_em import EpochSums

STEP_FACTOR = 4.0  # step_max grows (and shrinks) by this factor: Varadhan & Roland's mstep
# An extrapolation may shrink a component's smallest variance to this fraction of EM's two steps', no further
COLLAPSE = 1e-6


class SquaremEM(EpochSums):
    """Batch EM (``BatchEM``'s update) with SQUAREM's extrapolation and monotone safeguard (see above)."""

    _scores_its_pass = True
    _SCALARS = ("phase", "objective0", "step_max", "em_step", "extrapolations", "rejections")  # in state_dict

    def __init__(self, mixture: Mixture, *, w: float | torch.Tensor | None, fixed: FixedParameters | None = None):
        self.mixture = mixture
        self.w = ridge_vector(w, mixture.means)
        self.fixed = fixed or FixedParameters.none(mixture.n_components, mixture.means.device)
        self.phase = 0  # what the next pass scores: 0 theta0, 1 theta1, 2 the extrapolation
        self.theta0: Mixture | None = None
        self.theta2: Mixture | None = None
        self.objective0 = -float("inf")
        self.step_max = 1.0
        self.em_step = True  # whether ``mixture`` is one EM step from a cycle's start (what tol judges)
        self.extrapolations = self.rejections = 0

    @property
    def result(self) -> Mixture:
        """The fit so far: an extrapolation not yet validated by its pass is not it (a budget that ends
        there returns the cycle's EM step, theta2, which the monotone safeguard would fall back to)."""
        return self.theta2 if self.phase == 2 and self.theta2 is not None else self.mixture

    def end_epoch(self) -> None:
        scored, sums = self.mixture, self.epoch_sums
        self._sums = None
        mapped = em_update(scored, sums, self.w, self.fixed)
        if self.phase == 0:
            self.theta0, self.objective0 = scored, self._objective(scored, sums)
            self._next(mapped, em_step=True, phase=1)
        elif self.phase == 1:
            assert self.theta0 is not None  # set by phase 0's pass
            extrapolated = self._extrapolate(self.theta0, scored, mapped)
            if extrapolated is None:  # a step of 1: theta2 itself
                self._next(mapped, em_step=False, phase=0)
            else:
                self.theta2 = mapped
                self.extrapolations += 1
                self._next(extrapolated, em_step=False, phase=2)
        elif self._objective(scored, sums) >= self.objective0 and mapped.first_invalid_component() is None:
            self._next(mapped, em_step=False, phase=0)
        else:
            assert self.theta2 is not None  # set with the extrapolation phase 2 scored
            self._reject()
            self._next(self.theta2, em_step=False, phase=0)

    def pass_objective(self) -> float:
        """The objective (above) of the model the epoch's pass scored."""
        return self._objective(self.mixture, self._sums)

    def _objective(self, mixture: Mixture, sums) -> float:
        """The (weighted) total log-likelihood of the scored ``mixture`` plus the log prior of w (above)."""
        if self.w is None:
            return float(sums.loglik)
        chol = torch.linalg.cholesky(mixture.covariances)
        log_det = 2.0 * torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum()
        inverse = torch.linalg.inv(chol)  # tr(W V^-1) = sum_d w_d |column d of L^-1|^2
        trace_inverse = (inverse.square().sum(-2) * self.w).sum()
        return float(sums.loglik - 0.5 * (log_det + trace_inverse))

    def _reject(self) -> None:
        """Count a refused extrapolation and shrink the step bound (Varadhan & Roland's mstep)."""
        self.rejections += 1
        self.step_max = max(1.0, self.step_max / STEP_FACTOR)

    def _next(self, mixture: Mixture, em_step: bool, phase: int) -> None:
        self.mixture, self.em_step, self.phase = mixture, em_step, phase

    def _extrapolate(self, theta0: Mixture, theta1: Mixture, theta2: Mixture) -> Mixture | None:
        """theta' from the cycle's three models, or None where the step is 1 (theta' = theta2)."""
        if any(theta.first_invalid_component() is not None for theta in (theta0, theta1, theta2)):
            return None  # no coordinates for a singular covariance: theta2 goes on to the loop's check
        moving = (theta0.weights > 0) & (theta1.weights > 0) & (theta2.weights > 0)
        scale = component_scale(theta0)  # a step's length in each component's own units: the same in any units
        c0, c1, c2 = (_coordinates(m, moving, scale) for m in (theta0, theta1, theta2))
        r = [b - a for a, b in zip(c0, c1)]
        v = [c - 2 * b + a for a, b, c in zip(c0, c1, c2)]
        r2, v2 = (float(sum(t.square().sum() for t in ts)) for ts in (r, v))
        if not v2 > 0:
            return None
        alpha = min(max((r2 / v2) ** 0.5, 1.0), self.step_max)
        if alpha == self.step_max:
            self.step_max *= STEP_FACTOR
        if alpha == 1.0:
            return None
        coords = [a + 2 * alpha * dr + alpha**2 * dv for a, dr, dv in zip(c0, r, v)]
        extrapolated = _mixture(coords, theta2, moving, self.fixed, scale)
        if extrapolated.first_invalid_component() is not None:
            return None
        if _collapses(extrapolated, theta2):  # refused, as a drop in the objective would be
            self._reject()
            return None
        return extrapolated

    def diagnostics(self) -> dict:
        return {"em_step": self.em_step, "extrapolations": self.extrapolations, "rejections": self.rejections}

    def state_dict(self) -> dict:
        models = {"mixture": self.mixture, "theta0": self.theta0, "theta2": self.theta2}
        return {
            **{name: getattr(self, name) for name in self._SCALARS},
            **{name: None if m is None else mixture_state(m) for name, m in models.items()},
            "sums": self._sums_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        like = self.mixture
        for name in ("mixture", "theta0", "theta2"):
            setattr(self, name, None if state[name] is None else mixture_from_state(state[name], like))
        for name in self._SCALARS:
            setattr(self, name, state[name])
        self._load_sums(state["sums"], like.means.device)


def _collapses(extrapolated: Mixture, em_steps: Mixture) -> bool:
    """Whether theta' shrinks some component's smallest variance below ``COLLAPSE`` times theta2's: valid in
    exact arithmetic (its Cholesky factors' log diagonals far below zero), but no sensible step, and one the
    pass cannot factorise even in float64. The demo's oracle reference at K = 64 met one (a variance ~1e-17
    of the component's largest), which ended the fit as a divergence, or not, as the BLAS's rounding fell."""
    smallest = torch.linalg.eigvalsh(extrapolated.covariances)[:, 0]
    return bool((smallest < COLLAPSE * torch.linalg.eigvalsh(em_steps.covariances)[:, 0]).any())


def _coordinates(mixture: Mixture, moving: torch.Tensor, scale: torch.Tensor) -> list[torch.Tensor]:
    """Log weights, means and Cholesky factors with log diagonals, each component's features in units of
    ``scale`` (K, D); zero for the components not ``moving``."""
    chol = torch.linalg.cholesky(mixture.covariances) / scale[:, :, None]
    log_diag = torch.log(torch.diagonal(chol, dim1=-2, dim2=-1))
    log_weights = torch.log(torch.where(moving, mixture.weights, torch.ones_like(mixture.weights)))
    coords = [log_weights, mixture.means / scale, torch.tril(chol, -1) + torch.diag_embed(log_diag)]
    return [torch.where(moving.reshape(-1, *[1] * (c.ndim - 1)), c, torch.zeros_like(c)) for c in coords]


def _mixture(
    coords: list[torch.Tensor], last: Mixture, moving: torch.Tensor, fixed: FixedParameters, scale: torch.Tensor
) -> Mixture:
    """The mixture at ``coords`` (in units of ``scale``); the components not ``moving`` and the fixed
    parameters as in ``last``."""
    log_weights, means, raw = coords
    means = means * scale
    chol = scale[:, :, None] * (
        torch.tril(raw, -1) + torch.diag_embed(torch.exp(torch.diagonal(raw, dim1=-2, dim2=-1)))
    )
    held = ~moving | fixed.weights
    top = torch.where(moving, log_weights, torch.full_like(log_weights, -torch.inf)).max()
    weights = share_weights(torch.exp(log_weights - top), last.weights, held)
    return Mixture(
        weights,
        torch.where((moving & ~fixed.means)[:, None], means, last.means),
        torch.where((moving & ~fixed.covariances)[:, None, None], chol @ chol.mT, last.covariances),
    )
