"""Noise covariance containers: compact (sigmas + correlations) and diagonal forms against dense ones."""

import numpy as np
import pytest
import torch
from helpers import draw_xd_data, random_spd

from scalable_xd import XDGMM, CompactCovariance
from scalable_xd.data.noise import CHECK_CHUNK

PAIRS = [(0, 1), (0, 2), (1, 2)]


def _compact(rng, n):
    sigma = rng.uniform(0.1, 2.0, size=(n, 4))
    corr = rng.uniform(-0.4, 0.4, size=(n, 3))
    dense = np.zeros((n, 4, 4))
    for i in range(n):
        c = np.eye(4)
        for p, (a, b) in enumerate(PAIRS):
            c[a, b] = c[b, a] = corr[i, p]
        dense[i] = np.outer(sigma[i], sigma[i]) * c
    return CompactCovariance(sigma, corr, PAIRS), dense


def test_compact_covariance_builds_the_dense_matrices():
    compact, dense = _compact(np.random.default_rng(50), 200)
    index = torch.tensor([5, 0, 199, 17])
    np.testing.assert_allclose(compact.batch(index, "cpu", torch.float64).numpy(), dense[[5, 0, 199, 17]], rtol=1e-14)
    np.testing.assert_allclose(compact.dense().numpy(), dense, rtol=1e-14)
    compact.validate()


def test_fit_is_the_same_with_compact_diagonal_or_dense_noise():
    rng = np.random.default_rng(51)
    compact, dense = _compact(rng, 1000)
    x, _, _, _ = draw_xd_data(rng, 1000, np.ones(2) / 2, rng.normal(scale=3, size=(2, 4)), random_spd(rng, 2, 4), 0, 0)
    settings = dict(n_components=2, method="minibatch_em", epochs=2, dtype="float64", device="cpu", random_state=0)
    a = XDGMM(**settings).fit(x, Xcov=compact)
    b = XDGMM(**settings).fit(x, Xcov=dense)
    np.testing.assert_allclose(a.covariances_, b.covariances_, rtol=1e-10)
    variances = rng.uniform(0.1, 1.0, size=(1000, 4))
    c = XDGMM(**settings).fit(x, Xcov=variances)
    d = XDGMM(**settings).fit(x, Xcov=np.einsum("nd,de->nde", variances, np.eye(4)))
    np.testing.assert_allclose(c.covariances_, d.covariances_, rtol=1e-10)


@pytest.mark.parametrize(
    "field, row, value, message",
    [
        ("corr", 9, 1.5, "corr row 9, column 0 has a correlation outside"),
        ("sigma", 4, -0.1, "sigma row 4, column 0 has a negative standard deviation"),
        ("sigma", 2, np.nan, "sigma row 2, column 0 contains NaN"),
    ],
)
def test_compact_covariance_names_bad_rows(field, row, value, message):
    compact, _ = _compact(np.random.default_rng(52), 20)
    getattr(compact, field)[row, 0] = value
    with pytest.raises(ValueError, match=message):
        compact.validate()


def test_compact_covariance_rejects_inconsistent_correlations():
    compact, _ = _compact(np.random.default_rng(53), 20)
    compact.corr[11] = torch.tensor([0.99, 0.99, -0.99], dtype=compact.corr.dtype)  # no such 3x3 correlation
    with pytest.raises(ValueError, match="noise covariance row 11 is not positive semi-definite"):
        compact.validate()


def test_compact_covariance_checks_every_chunk_of_many_rows():
    """Rows are checked CHECK_CHUNK at a time: a catalogue of several chunks passes, and an inconsistent
    correlation in a later chunk is named by its row in the whole catalogue."""
    n = 2 * CHECK_CHUNK + 5
    rng = np.random.default_rng(54)
    compact = CompactCovariance(rng.uniform(0.1, 2.0, (n, 4)), rng.uniform(-0.4, 0.4, (n, 3)), PAIRS)
    compact.validate()
    compact.corr[CHECK_CHUNK + 7] = torch.tensor([0.99, 0.99, -0.99], dtype=compact.corr.dtype)
    with pytest.raises(ValueError, match=f"noise covariance row {CHECK_CHUNK + 7} is not positive semi-definite"):
        compact.validate()


@pytest.mark.parametrize("smallest", [0.0, -5e-9, -2e-8, -1e-3])
def test_the_factorisation_screen_decides_as_the_eigenvalues_do(smallest):
    """Correlation matrices are screened by a Cholesky factor of corr + 1e-8 I, the eigenvalues deciding
    only where it fails: at the boundary (smallest eigenvalue 0, just above and below -1e-8) the verdict and
    the row named are those of numpy's eigenvalues."""
    rng = np.random.default_rng(55)
    q = np.linalg.qr(rng.normal(size=(3, 3)))[0]
    eig = np.array([smallest, 1.0, 3.0 - smallest - 1.0])  # trace 3, as a correlation matrix's
    covariance = q @ np.diag(eig) @ q.T
    spread = np.sqrt(np.diag(covariance))
    correlation = covariance / np.outer(spread, spread)
    dense = np.repeat(np.eye(3)[None], 40, axis=0)
    dense[[17, 29]] = correlation * 4.0  # variances of 4: the check is on the correlations
    oracle = np.linalg.eigvalsh(dense / 4.0)[:, 0] < -1e-8
    if not oracle.any():
        XDGMM(1, epochs=1).fit(rng.normal(size=(40, 3)), Xcov=dense)  # accepted
    else:
        assert np.flatnonzero(oracle)[0] == 17
        with pytest.raises(ValueError, match="Xcov row 17 is not positive semi-definite"):
            XDGMM(1, epochs=1).fit(rng.normal(size=(40, 3)), Xcov=dense)


def test_an_asymmetric_covariance_is_refused_at_any_mix_of_scales():
    """Symmetry judged entry by entry against sqrt(S_ii S_jj): on features of spread 1e-3, 1 and 1e3 an upper
    entry at correlation 5 (the lower one 0) passed a test relative to the row's largest entry, and only the
    lower triangle was read."""
    rng = np.random.default_rng(3)
    scales = np.array([1e-3, 1.0, 1e3])
    x = rng.normal(size=(50, 3)) * scales
    S = np.tile(np.diag(0.1 * scales**2), (50, 1, 1))
    S[5, 0, 1] = 5 * np.sqrt(S[5, 0, 0] * S[5, 1, 1])
    with pytest.raises(ValueError, match=r"Xcov row 5, entry \(0, 1\) is not symmetric"):
        XDGMM(2, epochs=1).fit(x, Xcov=S)
    S[5, 0, 1] = S[5, 1, 0] * (1 + 1e-9)  # float rounding of a symmetric matrix: accepted
    XDGMM(2, epochs=1, random_state=0).fit(x, Xcov=S)
