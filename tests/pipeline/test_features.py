"""Features and noise covariances from raw DR2 columns: hand-computed rows, bad rows, splits, storage."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from helpers import SHARED_SAMPLE, needs_shared_sample

from scalable_xd.data.missing import MISSING_LOGLIK_CONSTANT
from scalable_xd.pipeline.features_file import read_features, split_of
from scalable_xd.pipeline.gaia.features import compute_features
from scalable_xd.pipeline.gaia.mock import make_mock
from scalable_xd.pipeline.gaia.schema import ASTROMETRY, CORRELATIONS, FEATURES
from scalable_xd.pipeline.steps import features


@pytest.fixture(scope="module")
def mock():
    return make_mock(100_000, seed=1)


@pytest.mark.parametrize("mode", ["corrected", "paper"])
def test_every_assembled_covariance_is_symmetric_positive_definite(mock, mode):
    X, Xcov = _dense(compute_features(mock, mode))
    assert X.shape == (len(mock), 7) and Xcov.shape == (len(mock), 7, 7)
    assert np.isfinite(X).all() and np.isfinite(Xcov).all()
    np.testing.assert_array_equal(Xcov, np.transpose(Xcov, (0, 2, 1)))
    np.linalg.cholesky(Xcov)  # raises if any of the 100,000 is not positive definite
    sd = np.sqrt(np.diagonal(Xcov, axis1=1, axis2=2))
    assert np.linalg.eigvalsh(Xcov / (sd[:, :, None] * sd[:, None, :]))[:, 0].min() > 1e-6  # scale-free


def _hand_covariance(row, sigmas):
    cov = np.diag(np.square(sigmas))
    for name, i, j in CORRELATIONS:
        if math.isfinite(row[name]) and sigmas[i] < 1e6 and sigmas[j] < 1e6:
            cov[i, j] = cov[j, i] = row[name] * sigmas[i] * sigmas[j]
    return cov


def _g_sigma(row):
    return math.sqrt((2.5 / math.log(10) / row.phot_g_mean_flux_over_error) ** 2 + 0.0018**2)


def _colour_sigma(row):
    bp = (2.5 / math.log(10) / row.phot_bp_mean_flux_over_error) ** 2 + 0.0014**2
    rp = (2.5 / math.log(10) / row.phot_rp_mean_flux_over_error) ** 2 + 0.0019**2
    return math.sqrt(bp + rp)


def test_hand_computed_rows(mock):
    full = mock[mock.parallax.notna() & mock.bp_rp.notna()].iloc[0]
    sparse = mock[mock.parallax.isna() & mock.bp_rp.isna()].iloc[0]
    rows = pd.DataFrame([full, sparse]).astype(mock.dtypes.to_dict())
    X = {mode: _dense(compute_features(rows, mode)) for mode in ("corrected", "paper")}

    # corrected: sigma_ra = ra_error / (3.6e6 cos dec) deg, sigma_dec = dec_error / 3.6e6 deg; photometry from
    # the flux signal-to-noise, 1.0857 / (flux / error) mag, with the zero-points' 1.8 / 1.4 / 1.9 mmag floors.
    cos_dec = math.cos(math.radians(full.dec))
    sig = [
        full.ra_error / 3.6e6 / cos_dec,
        full.dec_error / 3.6e6,
        full.parallax_error,
        full.pmra_error,
        full.pmdec_error,
        _colour_sigma(full),
        _g_sigma(full),
    ]
    np.testing.assert_allclose(X["corrected"][1][0], _hand_covariance(full, sig), rtol=1e-6)
    np.testing.assert_array_equal(
        X["corrected"][0][0], [full[f] for f in ("ra", "dec", "parallax", "pmra", "pmdec", "bp_rp", "phot_g_mean_mag")]
    )
    # paper: errors used as they come (mas taken for degrees), photometry 0.01.
    sig = [full.ra_error, full.dec_error, full.parallax_error, full.pmra_error, full.pmdec_error, 0.01, 0.01]
    np.testing.assert_allclose(X["paper"][1][0], _hand_covariance(full, sig), rtol=1e-6)

    # A two-parameter star without colour: missing entries are x = 0 with variance 1e12 and no correlations;
    # the paper's code gave the missing colour x = 0 and variance 1e-4 instead.
    x, cov = X["corrected"][0][1], X["corrected"][1][1]
    np.testing.assert_array_equal(x[[2, 3, 4, 5]], 0.0)
    np.testing.assert_array_equal(np.diag(cov)[[2, 3, 4, 5]], 1e12)
    expected = np.diag(
        [
            (sparse.ra_error / 3.6e6 / math.cos(math.radians(sparse.dec))) ** 2,
            (sparse.dec_error / 3.6e6) ** 2,
            1e12,
            1e12,
            1e12,
            1e12,
            _g_sigma(sparse) ** 2,
        ]
    )
    expected[0, 1] = expected[1, 0] = sparse.ra_dec_corr * math.sqrt(expected[0, 0] * expected[1, 1])
    np.testing.assert_allclose(cov, expected, rtol=1e-6)
    assert X["paper"][0][1][5] == 0.0 and X["paper"][1][1][5, 5] == pytest.approx(1e-4)
    assert X["paper"][1][1][2, 2] == 1e12
    counts = {m: compute_features(rows, m).n_missing.tolist() for m in ("corrected", "paper")}
    assert counts == {"corrected": [0, 4], "paper": [0, 3]}


def test_missing_constant_is_that_of_variance_1e12():
    assert MISSING_LOGLIK_CONSTANT == pytest.approx(-0.5 * math.log(2 * math.pi * 1e12))


def test_bad_rows_follow_the_documented_rule_and_are_counted(mock):
    rows = mock[mock.parallax.notna()].head(6).reset_index(drop=True).copy()
    rows.loc[0, "parallax_error"] = np.nan  # invalid error on a present value -> the value is missing
    rows.loc[1, "pmra_error"] = -1.0
    rows.loc[2, "ra_pmra_corr"] = np.float32(1.5)  # out of range -> 0
    rows.loc[3, "dec_pmdec_corr"] = np.nan  # missing correlation -> 0
    for name in ("ra_dec_corr", "ra_parallax_corr", "dec_parallax_corr"):
        rows.loc[4, name] = np.float32(0.95)  # three strong correlations...
    rows.loc[4, "dec_parallax_corr"] = np.float32(-0.95)  # ...that no correlation matrix can have
    features = compute_features(rows)
    assert features.counts == {
        "invalid_error": 2,
        "missing_correlation": 1,
        "correlation_out_of_range": 1,
        "not_positive_definite": 1,
    }
    assert features.X[0, 2] == 0 and features.sigma[0, 2] == 1e6 and features.n_missing[0] == 1
    assert features.sigma[1, 3] == 1e6
    corr = dict(zip([c for c, _, _ in CORRELATIONS], features.corr.T))
    assert corr["ra_pmra_corr"][2] == 0 and corr["dec_pmdec_corr"][3] == 0
    assert np.all(features.corr[4] == 0)
    assert corr["ra_parallax_corr"][0] == 0  # correlations of a missing value are dropped too
    np.linalg.cholesky(features.covariance().dense().numpy())
    with pytest.raises(ValueError, match="unknown covariance mode 'exact'"):
        compute_features(rows, "exact")
    with pytest.raises(ValueError, match="no column 'bp_rp'"):
        compute_features(rows.drop(columns="bp_rp"))


def test_split_is_deterministic_and_80_10_10():
    index = np.arange(200_000)
    splits = split_of(index, seed=0)
    np.testing.assert_array_equal(splits, split_of(index, seed=0))
    fractions = {name: (splits == name).mean() for name in ("train", "val", "test")}
    assert fractions == pytest.approx({"train": 0.8, "val": 0.1, "test": 0.1}, abs=0.005)
    assert (split_of(index, seed=1) != splits).mean() > 0.2


def test_feature_files_hold_every_row_once(mock, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for k, start in enumerate(range(0, len(mock), 40_000)):  # three download chunks
        mock.iloc[start : start + 40_000].to_parquet(raw / f"chunk{k}.parquet")
    features(raw, tmp_path / "features", mode="corrected", split_seed=0)  # the step: Gaia's module, its summary
    assert sorted(p.name for p in (tmp_path / "features").iterdir()) == [
        "features.json",
        "test.parquet",
        "train.parquet",
        "val.parquet",
    ]
    summary = json.loads((tmp_path / "features" / "features.json").read_text())
    assert summary["survey"] == "gaia_dr2" and summary["mode"] == "corrected"
    parts = {name: read_features(tmp_path / "features" / f"{name}.parquet") for name in ("train", "val", "test")}
    assert {k: len(v) for k, v in parts.items()} == summary["rows"]
    ids = np.concatenate([p.source_id for p in parts.values()])
    assert len(ids) == len(mock) and set(ids) == set(mock.source_id)
    direct = compute_features(mock.set_index("source_id").loc[parts["val"].source_id].reset_index())
    np.testing.assert_array_equal(parts["val"].X, direct.X)
    np.testing.assert_allclose(parts["val"].corr, direct.corr, rtol=1e-6)
    assert parts["val"].mode == "corrected"
    assert summary["missing_entries"]["val"] == int(direct.n_missing.sum())
    # The mock's noise-free values travel with their stars, for the truth metrics.
    assert summary["true_values"]
    true = mock.set_index("source_id").loc[parts["val"].source_id]
    np.testing.assert_array_equal(parts["val"].true, true[[f"true_{f}" for f in FEATURES]].to_numpy())


def test_features_carry_no_truth_for_real_data(mock):
    real_like = mock.drop(columns=[c for c in mock if c.startswith("true_")])
    assert compute_features(real_like).true is None


def test_the_mock_noise_is_what_the_features_say(mock):
    """(observed - true) / sigma is standard normal for every feature: a fit deconvolves the noise the
    mock drew, no more and no less (before, photometry got 0.1 mag against a real 0.005 to 0.03)."""
    features = compute_features(mock)
    for k, name in enumerate(FEATURES):
        present = features.sigma[:, k] < 1e6
        residual = features.X[present, k] - mock[f"true_{name}"].to_numpy()[present]
        if name == "ra":
            residual = (residual + 180.0) % 360.0 - 180.0
        pull = residual / features.sigma[present, k]
        assert np.std(pull) == pytest.approx(1.0, abs=0.05), name


def test_a_bad_flux_error_makes_the_magnitude_missing(mock):
    rows = mock[mock.bp_rp.notna()].head(3).copy()
    rows.loc[rows.index[0], "phot_bp_mean_flux_over_error"] = np.nan
    rows.loc[rows.index[1], "phot_g_mean_flux_over_error"] = -1.0
    features = compute_features(rows)
    assert features.counts["invalid_error"] == 2
    assert features.sigma[0, 5] == 1e6 and features.X[0, 5] == 0.0
    assert features.sigma[1, 6] == 1e6 and features.sigma[1, 5] < 1
    assert features.n_missing.tolist() == [1, 1, 0]


@needs_shared_sample
@pytest.mark.filterwarnings("ignore::astropy.units.UnitsWarning")
def test_real_rows_give_valid_features():
    from astropy.table import Table

    real = Table.read(SHARED_SAMPLE / "gdr2_sm.fits")
    features = compute_features(real)
    np.linalg.cholesky(features.covariance().dense().numpy())
    assert (features.n_missing == np.isnan(np.asarray(real["bp_rp"], dtype=float)).astype(int)).all()
    assert sum(features.counts.values()) == 0
    assert set(ASTROMETRY) <= set(real.colnames)
    # Photometric errors from the archive's flux columns: the medians measured on this sample.
    g = np.asarray(real["phot_g_mean_mag"], dtype=float)
    sigma_g = features.sigma[:, 6]
    for (lo, hi), expected in (((12, 14), 0.0018), ((16.5, 17.5), 0.0021), ((19.5, 20.5), 0.0068)):
        assert np.median(sigma_g[(g >= lo) & (g < hi)]) == pytest.approx(expected, rel=0.25), (lo, hi)


def _dense(features):
    """X (N, 7) and dense Xcov (N, 7, 7) as numpy arrays."""
    return features.X, features.covariance().dense().numpy()
