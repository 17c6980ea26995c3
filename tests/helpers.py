"""Independent reference computations and data generators for the tests (numpy/scipy, no project code),
and running a benchmark's quick mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.special import logsumexp
from scipy.stats import multivariate_normal

REPO = Path(__file__).resolve().parents[1]
# The real Gaia DR2 rows beside the checkout (never copied into it); tests that read them skip without them.
SHARED_SAMPLE = REPO.parent / "shared" / "data" / "gaia_dr2_real_sample"
needs_shared_sample = pytest.mark.skipif(
    not SHARED_SAMPLE.exists(), reason=f"the shared real DR2 sample ({SHARED_SAMPLE}) is not beside the checkout"
)


def random_spd(rng, k, d, scale=1.0, condition=10.0):
    """k random symmetric positive-definite d x d matrices with eigenvalues in [scale/condition, scale]."""
    out = np.empty((k, d, d))
    for j in range(k):
        q, _ = np.linalg.qr(rng.normal(size=(d, d)))
        eig = scale * np.exp(rng.uniform(np.log(1 / condition), 0, size=d))
        out[j] = (q * eig) @ q.T
    return out


def draw_xd_data(rng, n, weights, means, covs, noise_low, noise_high, correlated=True):
    """True values from a Gaussian mixture plus heteroscedastic Gaussian noise with known covariances."""
    d = means.shape[1]
    labels = rng.choice(len(weights), size=n, p=weights)
    chol = np.linalg.cholesky(covs)
    v = means[labels] + np.einsum("nij,nj->ni", chol[labels], rng.normal(size=(n, d)))
    sd = rng.uniform(noise_low, noise_high, size=(n, d))
    if correlated:
        rho = rng.uniform(-0.5, 0.5, size=n)
        corr = np.broadcast_to(np.eye(d), (n, d, d)).copy()
        corr[:, 0, 1] = corr[:, 1, 0] = rho
    else:
        corr = np.broadcast_to(np.eye(d), (n, d, d))
    S = sd[:, :, None] * corr * sd[:, None, :]
    x = v + sd * np.einsum("nij,nj->ni", np.linalg.cholesky(corr), rng.normal(size=(n, d)))
    return x, S, v, labels


def xd_log_densities(x, S, weights, means, covs, R=None):
    """log alpha_j N(x_i | R_i m_j, R_i V_j R_i^T + S_i), shape (N, K), by scipy one pair at a time."""
    n, k = x.shape[0], len(weights)
    out = np.empty((n, k))
    for i in range(n):
        Ri = np.eye(means.shape[1]) if R is None else R[i]
        for j in range(k):
            T = Ri @ covs[j] @ Ri.T + S[i]
            out[i, j] = np.log(weights[j]) + multivariate_normal(Ri @ means[j], T).logpdf(x[i])
    return out


def xd_loglik(x, S, weights, means, covs, R=None):
    return logsumexp(xd_log_densities(x, S, weights, means, covs, R), axis=1)


def xd_pair_posteriors(x, S, weights, means, covs, R=None):
    """The paper's eq. 4 per pair: r_ij, b_ij (N, K, D) and B_ij (N, K, D, D), written out explicitly."""
    n, k, dim = x.shape[0], len(weights), means.shape[1]
    log_dens = xd_log_densities(x, S, weights, means, covs, R)
    r = np.exp(log_dens - logsumexp(log_dens, axis=1, keepdims=True))
    b = np.empty((n, k, dim))
    B = np.empty((n, k, dim, dim))
    for i in range(n):
        Ri = np.eye(dim) if R is None else R[i]
        for j in range(k):
            T = Ri @ covs[j] @ Ri.T + S[i]
            gain = covs[j] @ Ri.T @ np.linalg.inv(T)
            b[i, j] = means[j] + gain @ (x[i] - Ri @ means[j])
            B[i, j] = covs[j] - gain @ Ri @ covs[j]
    return r, b, B


def xd_em_step(x, S, weights, means, covs, w=0.0):
    """One Bovy et al. EM iteration from eq. 4-5 with explicit b_ij, B_ij (their regularisation when w > 0)."""
    r, b, B = xd_pair_posteriors(x, S, weights, means, covs)
    q = r.sum(0)
    new_means = np.einsum("nk,nkd->kd", r, b) / q[:, None]
    centred = b - new_means[None]
    scatter = np.einsum("nk,nkd,nke->kde", r, centred, centred) + np.einsum("nk,nkde->kde", r, B)
    eye = np.eye(means.shape[1])
    new_covs = (scatter + w * eye) / (q[:, None, None] + 1.0) if w > 0 else scatter / q[:, None, None]
    return q / q.sum(), new_means, new_covs


def kernel_problem(rng, n=40, k=5, d=3, d_obs=None):
    """A random mixture (k components in d dimensions) and n noisy points of dimension d_obs."""
    weights = rng.dirichlet(np.ones(k))
    means = rng.normal(scale=3, size=(k, d))
    covs = random_spd(rng, k, d)
    d_obs = d if d_obs is None else d_obs
    S = random_spd(rng, n, d_obs, scale=0.5)
    x = rng.normal(scale=3, size=(n, d_obs))
    return x, S, weights, means, covs


def hard_kernel_problem(rng, n=300, k=16, d=7):
    """Gaia-like trouble: entries missing with variance 1e12, tiny and huge noise, nearly singular V_j."""
    x, S, weights, means, covs = kernel_problem(rng, n=n, k=k, d=d)
    missing = rng.random((n, d)) < 0.15
    for i, j in zip(*np.nonzero(missing)):
        x[i, j] = 0.0
        S[i, j, :] = S[i, :, j] = 0.0
        S[i, j, j] = 1e12
    scale = np.ones(d)
    scale[:2] = 1e-7  # positions: variances ~1e-16 deg^2 next to a sky spread of ~1e2
    S[: n // 4] *= np.outer(scale, scale)
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    covs[: k // 4] = (q * np.geomspace(1e-5, 10.0, d)) @ q.T  # condition number 1e6
    return x, S, weights, means, covs


def float32_unfactorisable_problem(rng, n=200):
    """``kernel_problem`` (4 components in 7 dimensions) with component 2 of condition number 1e11 and stars
    of tiny noise (variances 1e-10 to 1e-8): float32's Cholesky of V_2 + S_i fails where float64's does not."""
    x, S, weights, means, covs = kernel_problem(rng, n=n, k=4, d=7)
    q, _ = np.linalg.qr(rng.normal(size=(7, 7)))
    covs[2] = (q * np.geomspace(1e-7, 1e4, 7)) @ q.T
    S[:] = np.eye(7) * rng.uniform(1e-10, 1e-8, size=(n, 1, 1))
    return x, S, weights, means, covs


def rounding_prone_fit(method: str, copies: int = 1):
    """(x, S, XDGMM settings) of a fit whose float32 update leaves a covariance indefinite by rounding: two
    stars with positional-size noise (1e-16), ``copies`` times over, in one wide component. The exact
    scatter is singular but for the noise; float32 sums miss it by ~eps q |V| ~ 1e-4, far above w = 1e-6."""
    x = np.array([[120.0, -30.0, 5.0], [121.0, -29.5, 5.2]] * copies)
    S = np.broadcast_to(np.eye(3) * 1e-16, (len(x), 3, 3))
    settings = dict(
        n_components=1,
        method=method,
        epochs=1,
        w=1e-6,
        online_regularisation="paper",  # w I itself: the prior's w / (c + 1) would be larger with two stars
        step_size=1.0,
        step_schedule="cappe_moulines",  # decreasing steps: a constant step of 1 would fit the two stars exactly
        batch_size=2,
        tol=None,
        device="cpu",
        random_state=0,
        means_init=[[100.0, -20.0, 4.0]],
        covariances_init=[np.diag([1e3, 1e2, 10.0])],
    )
    return x, S, settings


def max_row_relative_error(got, want):
    """Largest |got - want| relative to the largest |want| of its row (its component, for (K, ...) sums; the
    whole array for a vector); rows that are exactly zero compare absolutely."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if want.ndim == 1:
        scale = np.abs(want).max()
    else:
        scale = np.abs(want).max(axis=tuple(range(1, want.ndim)), keepdims=True)
    return float((np.abs(got - want) / np.maximum(scale, 1e-300)).max())


def damage_file(path, kind: str) -> bool:
    """Damage a file as a crash, a full disk or a wrong path would: ``empty``, ``truncated`` (half of it) or
    ``garbage`` (random bytes). Returns False for any other kind, left to the caller."""
    payload = path.read_bytes()
    damaged = {
        "empty": b"",
        "truncated": payload[: len(payload) // 2],
        "garbage": np.random.default_rng(0).bytes(4096),
    }.get(kind)
    if damaged is None:
        return False
    path.write_bytes(damaged)
    return True


def run_quick(script: str, tmp_path: Path, *args: str) -> list[dict]:
    """``script --quick`` in a fresh process; the JSON files it wrote."""
    env = {**os.environ, "BENCH_QUICK_RESULTS": str(tmp_path)}
    command = [sys.executable, str(REPO / "benchmarks" / f"{script}.py"), "--quick", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, f"{script} --quick failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
