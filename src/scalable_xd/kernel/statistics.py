"""What a statistics pass returns, shared by every kernel backend.

For a batch of points and every component j, with T_ij = R_i V_j R_i^T + S_i, d_ij = x_i - R_i m_j and
u_ij = T_ij^-1 d_ij::

    log N_ij = -(d.u + log det T + d log 2 pi) / 2,     r_ij = softmax_j(log alpha_j + log N_ij)
    q_j = sum_i r_ij                 U_j  = sum_i r_ij R_i^T u_ij
    UU_j = sum_i r_ij R_i^T u u^T R_i    P_j = sum_i r_ij R_i^T T_ij^-1 R_i

These sums are all that batch EM, minibatch EM and SGD need (see ``updates``): the posterior mean and
covariance of each point's true value, b_ij = m_j + V_j R^T u and B_ij = V_j - V_j R^T T^-1 R V_j, enter
only through ``sum r b = q m + V U`` and ``sum r [(b - m)(b - m)^T + B] = q V + V (UU - P) V``, so no per-pair
B_ij is ever formed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import NotPositiveDefiniteError

LOG_2PI = math.log(2.0 * math.pi)


@dataclass
class Statistics:
    """Per-component sums over a batch of ``n_points`` points (with per-point weights: their total weight,
    which is what every update divides by in place of the count)."""

    n_points: float
    q: torch.Tensor  # (K,)
    U: torch.Tensor  # (K, D)
    UU: torch.Tensor  # (K, D, D)
    P: torch.Tensor  # (K, D, D)

    def double(self) -> Statistics:
        """The sums in float64, the precision every parameter update works in."""
        return Statistics(self.n_points, self.q.double(), self.U.double(), self.UU.double(), self.P.double())

    def combine(self, other: Statistics) -> Statistics:
        return Statistics(self.n_points + other.n_points, self.q + other.q, self.U + other.U, self.UU + other.UU,
                          self.P + other.P)  # fmt: skip


def raise_for_failed_pairs(failed: torch.Tensor, row_offset: int) -> None:
    """``failed`` (B, K) marks pairs whose T_ij could not be factorised; name the first one."""
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


def n_points(x: torch.Tensor, point_weights=None) -> float:
    """The batch's size for the updates: its number of points, or their total weight."""
    return x.shape[0] if point_weights is None else float(point_weights.sum(dtype=torch.float64))
