"""A uniform background component over a box of the data space, for catalogues with outliers (the
background of Melchior & Goulding 2018, pygmmis).

With background weight beta and box [lower, upper], each point's likelihood is

    p(x_i) = (1 - beta) sum_j alpha_j N(x_i | m_j, V_j + S_i) + beta U(x_i),    U = 1 / volume inside, 0 outside,

and its background responsibility r_i = beta U(x_i) / p(x_i). EM weights each point's part in the Gaussian
sums by 1 - r_i (so the alpha_j stay the Gaussian part's own weights, summing to 1) and sets beta to the
weighted mean of r_i. As in pygmmis, the background is uniform in the measured values, not convolved with
each point's noise: exact inside the box up to the noise's width from its edges, so the box should be
wider than the noise.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import torch

_RANGE = re.compile(r"^\s*(\S+?)\s*:\s*(\S+)\s*$")


@dataclass(frozen=True)
class Background:
    """The box's ``lower`` and ``upper`` corners (D,) in the data's features, and the weight beta in [0, 1)."""

    lower: tuple[float, ...]
    upper: tuple[float, ...]
    weight: float

    def __post_init__(self):
        lower, upper = np.asarray(self.lower, dtype=float), np.asarray(self.upper, dtype=float)
        if lower.ndim != 1 or lower.shape != upper.shape or len(lower) == 0:
            raise ValueError(f"background: lower {lower.shape} and upper {upper.shape} must be two (D,) corners")
        bad = ~(np.isfinite(lower) & np.isfinite(upper) & (upper > lower))
        if bad.any():
            feature = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"background: feature {feature}'s range [{lower[feature]}, {upper[feature]}] must be finite, "
                "lower below upper"
            )
        if not 0.0 <= self.weight < 1.0:
            raise ValueError(f"background: its weight must lie in [0, 1), got {self.weight!r}")
        object.__setattr__(self, "lower", tuple(lower.tolist()))
        object.__setattr__(self, "upper", tuple(upper.tolist()))
        object.__setattr__(self, "weight", float(self.weight))

    @property
    def dim(self) -> int:
        return len(self.lower)

    @property
    def log_volume(self) -> float:
        return float(sum(math.log(hi - lo) for lo, hi in zip(self.lower, self.upper)))

    def with_weight(self, weight: float) -> Background:
        return Background(self.lower, self.upper, weight)

    def log_density(self, x: torch.Tensor) -> torch.Tensor:
        """log U(x_i) (B,), float64: minus the log of the box's volume inside it (its faces included), -inf outside."""
        lower = torch.tensor(self.lower, dtype=torch.float64, device=x.device)
        upper = torch.tensor(self.upper, dtype=torch.float64, device=x.device)
        values = x.to(torch.float64)
        inside = ((values >= lower) & (values <= upper)).all(dim=1)
        density = torch.full(inside.shape, -self.log_volume, dtype=torch.float64, device=x.device)
        return density.masked_fill(~inside, -math.inf)

    def log_weighted_density(self, x: torch.Tensor) -> torch.Tensor:
        """log (beta U(x_i)) (B,), float64: the background's term of each point's likelihood."""
        return (math.log(self.weight) if self.weight > 0 else -math.inf) + self.log_density(x)

    def combine(self, gaussian_loglik: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p(x_i), log r_i) (B,) in float64, from the Gaussian mixture's log-likelihood (B,) of x (B, D)."""
        gaussian = math.log1p(-self.weight) + gaussian_loglik.to(torch.float64)
        background = self.log_weighted_density(x)
        loglik = torch.logaddexp(gaussian, background)
        return loglik, background - loglik

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """n points (n, D) drawn uniformly from the box, float64 on the CPU."""
        lower, upper = torch.tensor(self.lower, dtype=torch.float64), torch.tensor(self.upper, dtype=torch.float64)
        return lower + (upper - lower) * torch.rand(n, self.dim, generator=generator, dtype=torch.float64)

    def as_dict(self) -> dict:
        return {"lower": list(self.lower), "upper": list(self.upper), "weight": self.weight}

    @classmethod
    def from_dict(cls, saved: dict) -> Background:
        return cls(tuple(saved["lower"]), tuple(saved["upper"]), float(saved["weight"]))


def from_setting(spec: str, X: torch.Tensor | None, weight: float) -> Background:
    """The background the ``background`` setting names: "auto", the training data's bounding box (X, the
    data in memory), or one "lower:upper" range per feature, in the features' order, joined by commas."""
    if spec.strip() == "auto":
        if X is None:
            raise ValueError(
                "background='auto' takes the box from the training data in memory; for data read from disk "
                "or batches, give one 'lower:upper' range per feature"
            )
        values = X.to(torch.float64)
        lower, upper = values.amin(dim=0), values.amax(dim=0)
        flat = torch.nonzero(upper <= lower)
        if len(flat):
            raise ValueError(
                f"background='auto': feature {int(flat[0, 0])} takes one value only in the training data, so its "
                "box has no width: give the ranges ('lower:upper' per feature)"
            )
        return Background(tuple(lower.tolist()), tuple(upper.tolist()), weight)
    ranges = [part for part in spec.split(",")]
    parsed = [_RANGE.match(part) for part in ranges]
    for number, (part, match) in enumerate(zip(ranges, parsed)):
        if match is None:
            raise ValueError(
                f"background: range {number} {part.strip()!r} is not 'lower:upper' (give 'auto', or one "
                "'lower:upper' per feature joined by commas)"
            )
    try:
        bounds = [(float(m.group(1)), float(m.group(2))) for m in parsed if m is not None]
    except ValueError:
        raise ValueError(f"background: {spec!r} holds a bound that is not a number") from None
    if X is not None and len(bounds) != X.shape[1]:
        raise ValueError(f"background: {len(bounds)} ranges given for {X.shape[1]} features: give one per feature")
    return Background(tuple(lo for lo, _ in bounds), tuple(hi for _, hi in bounds), weight)
