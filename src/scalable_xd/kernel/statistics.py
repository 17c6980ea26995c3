"""What a statistics pass returns, shared by every kernel backend.

For a batch of points and every component j, with T_ij = R_i V_j R_i^T + S_i, d_ij = x_i - R_i m_j and
u_ij = T_ij^-1 d_ij::

    log N_ij = -(d.u + log det T + d log 2 pi) / 2,     r_ij = softmax_j(log alpha_j + log N_ij)
    q_j = sum_i r_ij                 U_j  = sum_i r_ij R_i^T u_ij
    UU_j = sum_i r_ij R_i^T u u^T R_i    P_j = sum_i r_ij R_i^T T_ij^-1 R_i

These sums are all that batch EM, minibatch EM and SGD need (see ``fit.rules``): the posterior mean and
covariance of each point's true value, b_ij = m_j + V_j R^T u and B_ij = V_j - V_j R^T T^-1 R V_j, enter
only through ``sum r b = q m + V U`` and ``sum r [(b - m)(b - m)^T + B] = q V + V (UU - P) V``, so no per-pair
B_ij is ever formed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Protocol

import torch

from .. import deferred_checks
from ..errors import NotPositiveDefiniteError

if TYPE_CHECKING:
    from ..mixture import Mixture

LOG_2PI = math.log(2.0 * math.pi)


@dataclass
class Statistics:
    """Per-component sums over a batch of ``n_points`` points (with per-point weights: their total weight,
    which is what every update divides by in place of the count), the batch's summed log-likelihood, and,
    when asked for, the split-and-merge criteria's sums (``Criteria``)."""

    n_points: float | torch.Tensor  # a 0-dim tensor where checks are deferred (``deferred_checks``)
    q: torch.Tensor  # (K,)
    U: torch.Tensor  # (K, D)
    UU: torch.Tensor  # (K, D, D)
    P: torch.Tensor  # (K, D, D)
    loglik: torch.Tensor | None = None  # () sum over the batch of (weighted) log p(x_i) under the E-step's model
    criteria: Criteria | None = None
    background: torch.Tensor | None = None  # () sum of (weighted) background responsibilities (``background``)

    @classmethod
    def zeros(cls, k: int, d: int, device, with_criteria: bool = False) -> Statistics:
        """The sums of no point (a process whose share of a small batch is empty)."""
        z = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=device)  # noqa: E731
        criteria = Criteria(z(k, k), z(k), z(k)) if with_criteria else None
        return cls(0, z(k), z(k, d), z(k, d, d), z(k, d, d), z(), criteria)

    def to(self, dtype: torch.dtype) -> Statistics:
        """The sums in ``dtype``; the summed log-likelihood is float64 whatever the sums' dtype."""
        return Statistics(
            self.n_points,
            self.q.to(dtype),
            self.U.to(dtype),
            self.UU.to(dtype),
            self.P.to(dtype),
            None if self.loglik is None else self.loglik.double(),
            None if self.criteria is None else self.criteria.to(dtype),
            self.background,
        )

    def double(self) -> Statistics:
        """The sums in float64, the precision every parameter update works in."""
        return self.to(torch.float64)

    def combine(self, other: Statistics) -> Statistics:
        loglik = None if self.loglik is None or other.loglik is None else self.loglik + other.loglik
        criteria = None if self.criteria is None or other.criteria is None else self.criteria.combine(other.criteria)
        return Statistics(
            self.n_points + other.n_points,
            self.q + other.q,
            self.U + other.U,
            self.UU + other.UU,
            self.P + other.P,
            loglik,
            criteria,
            None if self.background is None or other.background is None else self.background + other.background,
        )


@dataclass
class Criteria:
    """Sums behind Ueda et al.'s split-and-merge criteria (as Bovy et al. 2011 use them), from the soft
    responsibilities r_ij (times the point weights) and log N_ij = log N(x_i | m_j, V_j + S_i):

        overlap (K, K) = sum_i r_ij r_ik      (merge: components that claim the same stars)
        r_log_r (K,)   = sum_i r_ij log r_ij,   r_log_n (K,) = sum_i r_ij log N_ij

    so that the local Kullback-Leibler divergence of component j's stars from the component itself is
    sum_i f_ij log(f_ij / N_ij) with f_ij = r_ij / q_j, i.e. (r_log_r - r_log_n) / q_j - log q_j.
    """

    overlap: torch.Tensor
    r_log_r: torch.Tensor
    r_log_n: torch.Tensor

    def to(self, dtype: torch.dtype) -> Criteria:
        return Criteria(self.overlap.to(dtype), self.r_log_r.to(dtype), self.r_log_n.to(dtype))

    def combine(self, other: Criteria) -> Criteria:
        return Criteria(self.overlap + other.overlap, self.r_log_r + other.r_log_r, self.r_log_n + other.r_log_n)


class Chunk(Protocol):
    """What a backend implements (``kernel.TABLE`` names it): the pass over one chunk of points, returning
    (log p(x_i) (B,), log alpha_j N_ij (B, K) or None where neither ``with_stats`` is False nor the criteria
    need them, ``Statistics`` or None without ``with_stats``). ``R`` is None for R = I, else (B, d, D)
    (only a backend with projections is given one); ``point_weights`` (B,) weight the sums, ``uniforms``
    (B,) replace the responsibilities by sampled assignments (``assign``), ``with_criteria`` adds
    ``Criteria``. A pair whose V_j + S_i cannot be factorised raises ``NotPositiveDefiniteError`` naming
    row ``row_offset`` + its index (``raise_for_failed_pairs``)."""

    def __call__(
        self,
        x: torch.Tensor,
        S: torch.Tensor,
        mixture: Mixture,
        R: torch.Tensor | None,
        with_stats: bool,
        row_offset: int,
        point_weights: torch.Tensor | None = None,
        uniforms: torch.Tensor | None = None,
        with_criteria: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, Statistics | None]: ...


def criteria_sums(log_dens, loglik, log_weights, point_weights=None, *, dim: int) -> tuple:
    """(overlap, r_log_r, r_log_n) of ``Criteria`` from log alpha_j N_ij (components along ``dim``) and
    log p(x_i); pairs of responsibility zero contribute nothing."""
    log_r = log_dens - loglik.unsqueeze(dim)
    r = torch.exp(log_r)
    if point_weights is not None:
        r = r * point_weights.unsqueeze(dim)
    shape = (-1, 1) if dim == 0 else (1, -1)
    zero = torch.zeros_like(r)
    r_log_r = torch.where(r > 0, r * log_r, zero)
    r_log_n = torch.where(r > 0, r * (log_dens - log_weights.reshape(shape)), zero)
    other = 1 - dim
    overlap = r @ r.mT if dim == 0 else r.mT @ r
    return overlap, r_log_r.sum(other), r_log_n.sum(other)


def symmetric_from_triangle(entries: torch.Tensor, dim: int, lower: bool = True) -> torch.Tensor:
    """Symmetric (..., D, D) matrices from their row-major lower (or upper) triangles (..., D (D + 1) / 2):
    one gather (one kernel on a GPU, where a fill and a scatter of each half took three)."""
    index = _triangle_positions(dim, lower, entries.device)
    return entries[..., index].view(*entries.shape[:-1], dim, dim)


@cache
def _triangle_positions(dim: int, lower: bool, device: torch.device) -> torch.Tensor:
    """(D * D,) where each entry of a symmetric D x D matrix, row by row, sits in its row-major lower (or
    upper) triangle; made once per device (a replayed CUDA graph reads it)."""
    rows, cols = (torch.tril_indices if lower else torch.triu_indices)(dim, dim)
    where = torch.empty((dim, dim), dtype=torch.long)
    where[rows, cols] = where[cols, rows] = torch.arange(len(rows))
    return where.reshape(-1).to(device)


def raise_for_failed_pairs(failed: torch.Tensor, row_offset: int) -> None:
    """``failed`` (B, K) marks pairs whose T_ij could not be factorised; name the first one (or, where
    checks are deferred, record that one failed: see ``deferred_checks``)."""
    checks = deferred_checks.active()
    if checks is not None:
        checks.note(failed)
        return
    if failed.any():
        row, component = (int(v) for v in torch.nonzero(failed)[0])
        raise NotPositiveDefiniteError(row_offset + row, component)


def assign(resp: torch.Tensor, point_weights=None, uniforms=None, *, dim: int) -> torch.Tensor:
    """The weights each point gives the components' sums, from its responsibilities ``resp`` (components
    along ``dim``).

    ``uniforms`` (B,), in [0, 1): stochastic EM's S-step. Each point is assigned to one component, the
    first whose cumulative responsibility exceeds u times the total (inverse-CDF sampling, so a component
    of responsibility zero is never drawn), and its responsibilities become that one-hot vector; the sums
    are then linear in the one-hot vectors, so their expectation is the soft sums. ``point_weights`` (B,):
    each point's responsibilities are multiplied by its weight (``sample_weight``), so that a point of
    weight 2 counts as the point twice.
    """
    if uniforms is not None:
        cdf = torch.cumsum(resp, dim=dim)
        total = cdf.narrow(dim, resp.shape[dim] - 1, 1)
        chosen = (cdf < uniforms.unsqueeze(dim) * total).sum(dim, keepdim=True).clamp_max(resp.shape[dim] - 1)
        resp = torch.zeros_like(resp).scatter_(dim, chosen, 1.0)
    if point_weights is not None:
        resp = resp * point_weights.unsqueeze(dim)
    return resp


def summed_loglik(loglik: torch.Tensor, point_weights=None) -> torch.Tensor:
    """The batch's (weighted) total log-likelihood, in float64."""
    return loglik.sum(dtype=torch.float64) if point_weights is None else (loglik.double() * point_weights).sum()


def n_points(x: torch.Tensor, point_weights=None) -> float | torch.Tensor:
    """The batch's size for the updates: its number of points, or their total weight (left on the device
    where checks are deferred: see ``deferred_checks``)."""
    if point_weights is None:
        return x.shape[0]
    total = point_weights.sum(dtype=torch.float64)
    return total if deferred_checks.active() is not None else float(total)
