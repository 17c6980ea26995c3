"""The mixture of some features given noisy measurements of the others (Holoien et al.'s ``condition``).

For component j with mean m_j and covariance V_j split into the features kept (a) and those measured (b),
a measurement x_b with noise covariance S_b gives, by the Gaussian conditioning formulas with V_bb + S_b
in place of V_bb,

    m_j|b = m_a + V_ab (V_bb + S_b)^-1 (x_b - m_b),     V_j|b = V_aa - V_ab (V_bb + S_b)^-1 V_ba,
    alpha_j|b  proportional to  alpha_j N(x_b | m_b, V_bb + S_b).

With S_b = 0 this is the exact conditional of the deconvolved density p(v_a | v_b = x_b).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .errors import brief
from .mixture import Mixture

LOG_2PI = math.log(2.0 * math.pi)


def floats(value, name: str) -> np.ndarray:
    """``value`` as a float64 array, or a ValueError naming the argument (numpy's names neither)."""
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must hold numbers, got {brief(value)}") from None


def measured_features(x_given, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The measured features' mask and values from ``x_given`` (D,), where NaN marks a feature to keep."""
    x_given = floats(x_given, "X_given")
    if x_given.shape != (dim,):
        raise ValueError(
            f"X_given must have shape ({dim},), one entry per feature (NaN for those to keep), got {x_given.shape}"
        )
    if np.isinf(x_given).any():
        raise ValueError(f"X_given feature {int(np.flatnonzero(np.isinf(x_given))[0])} is infinite")
    limit = math.sqrt(np.finfo(np.float64).max / (4 * dim))  # as a fit's range check (Dataset.check_range)
    beyond = np.abs(np.nan_to_num(x_given)) > limit
    if beyond.any():
        raise ValueError(
            f"X_given feature {int(np.flatnonzero(beyond)[0])} is beyond {limit:.3g}, whose squares overflow "
            "float64; rescale the features"
        )
    measured = ~np.isnan(x_given)
    if measured.all() or not measured.any():
        raise ValueError("X_given must leave at least one feature NaN (kept) and measure at least one")
    return measured, x_given[measured]


def measurement_noise(noise, n_measured: int) -> np.ndarray:
    """The measured features' noise covariance (d_b, d_b) from None, variances (d_b,) or a matrix."""
    if noise is None:
        return np.zeros((n_measured, n_measured))
    noise = floats(noise, "Xcov_given")
    if noise.shape == (n_measured,):
        noise = np.diag(noise)
    if noise.shape != (n_measured, n_measured):
        raise ValueError(
            f"Xcov_given must be variances ({n_measured},) or a covariance ({n_measured}, "
            f"{n_measured}) of the measured features, got {noise.shape}"
        )
    if not np.isfinite(noise).all() or not np.allclose(noise, noise.T) or np.linalg.eigvalsh(noise)[0] < 0:
        raise ValueError("Xcov_given must be a finite, symmetric, positive semi-definite covariance")
    return noise


def condition(mixture: Mixture, measured: np.ndarray, x_b: np.ndarray, S_b: np.ndarray) -> Mixture:
    """The conditional mixture over the features not ``measured``, in float64 on the mixture's device."""
    m, V = mixture.means.double(), mixture.covariances.double()
    a = torch.as_tensor(np.flatnonzero(~measured), device=m.device)
    b = torch.as_tensor(np.flatnonzero(measured), device=m.device)
    given = torch.as_tensor(x_b, dtype=torch.float64, device=m.device)
    V_ab = V[:, a][:, :, b]
    T = V[:, b][:, :, b] + torch.as_tensor(S_b, dtype=torch.float64, device=m.device)  # (K, d_b, d_b)
    chol = torch.linalg.cholesky(T)
    diff = given - m[:, b]
    solved = torch.cholesky_solve(diff.unsqueeze(-1), chol).squeeze(-1)  # T^-1 (x_b - m_b)
    gain = torch.cholesky_solve(V_ab.mT, chol).mT  # V_ab T^-1
    means = m[:, a] + (V_ab @ solved.unsqueeze(-1)).squeeze(-1)
    covariances = V[:, a][:, :, a] - gain @ V_ab.mT
    covariances = 0.5 * (covariances + covariances.mT)
    log_det = 2.0 * torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)
    log_n = -0.5 * ((diff * solved).sum(-1) + log_det + len(b) * LOG_2PI)
    weights = torch.softmax(torch.log(mixture.weights.double()) + log_n, dim=0)
    return Mixture(weights, means, covariances)
