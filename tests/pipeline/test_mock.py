"""The DR2-like mock against published Gaia DR2 facts and the shared real DR2 sample."""

import numpy as np
import pandas as pd
import pytest
from helpers import SHARED_SAMPLE, needs_shared_sample

from scalable_xd.pipeline.gaia.galaxy import LMC, SMC
from scalable_xd.pipeline.gaia.mock import make_mock
from scalable_xd.pipeline.gaia.schema import CORRELATIONS, FEATURES, FIVE_PARAMETER_ONLY, QUERY_COLUMNS

# G bins and median parallax_error (mas) of real five-parameter DR2 stars (the shared sample; Lindegren 2018).
G_BINS = [(14, 16, 0.042), (16, 18, 0.098), (18, 19.5, 0.31), (19.5, 20.5, 0.68), (20.5, 22, 1.27)]


@pytest.fixture(scope="module")
def mock():
    return make_mock(100_000, seed=0)


def test_columns_dtypes_and_identifiers(mock):
    expected = list(QUERY_COLUMNS) + [f"true_{f}" for f in FEATURES] + ["population"]
    assert list(mock.columns) == expected
    for name, (dtype, _) in QUERY_COLUMNS.items():
        assert str(mock[name].dtype) == dtype, name
    np.testing.assert_array_equal(np.sort(mock.random_index), np.arange(len(mock)))
    assert mock.source_id.is_unique and mock.source_id.is_monotonic_increasing
    assert mock.ra.between(0, 360).all() and mock.dec.between(-90, 90).all()


def test_deterministic_for_rows_and_seed():
    pd.testing.assert_frame_equal(make_mock(3000, seed=5), make_mock(3000, seed=5))
    assert not make_mock(3000, seed=5).ra.equals(make_mock(3000, seed=6).ra)


def test_missing_fractions_match_dr2(mock):
    two_parameter = mock.parallax.isna()
    assert two_parameter.mean() == pytest.approx(0.213, abs=0.02)
    assert mock.bp_rp.isna().mean() == pytest.approx(0.18, abs=0.03)
    # Two-parameter solutions lack every five-parameter column but keep ra_dec_corr.
    assert mock.loc[two_parameter, list(FIVE_PARAMETER_ONLY)].isna().all().all()
    assert mock.loc[~two_parameter, list(FIVE_PARAMETER_ONLY)].notna().all().all()
    assert mock.ra_dec_corr.notna().all()
    assert mock.loc[two_parameter, "phot_g_mean_mag"].median() > mock.loc[~two_parameter, "phot_g_mean_mag"].median()


def test_parallax_error_against_g_matches_dr2(mock):
    five = mock[mock.parallax.notna()]
    for lo, hi, median in G_BINS:
        in_bin = five[(five.phot_g_mean_mag >= lo) & (five.phot_g_mean_mag < hi)]
        assert len(in_bin) > 500
        assert in_bin.parallax_error.median() == pytest.approx(median, rel=0.15), (lo, hi)
    ratios = {"ra_error": 0.8, "dec_error": 0.78, "pmra_error": 1.7, "pmdec_error": 1.56}
    for name, ratio in ratios.items():
        assert (five[name] / five.parallax_error).median() == pytest.approx(ratio, rel=0.1), name


def test_correlations_have_realistic_size(mock):
    for name, _, _ in CORRELATIONS:
        values = mock[name].dropna()
        assert -0.35 < values.median() < 0.2, name
        assert 0.12 < values.abs().median() < 0.36, name
        assert values.quantile(0.05) > -0.8 and values.quantile(0.95) < 0.7, name


def test_noise_matches_the_stated_errors(mock):
    """(observed - true) / error is standard normal for every astrometric parameter."""
    five = mock[mock.parallax.notna()]
    cos_dec = np.cos(np.radians(five.true_dec))
    ra_offset = ((five.ra - five.true_ra + 180) % 360 - 180) * 3.6e6 * cos_dec
    pulls = {
        "ra": ra_offset / five.ra_error,
        "dec": (five.dec - five.true_dec) * 3.6e6 / five.dec_error,
        "parallax": (five.parallax - five.true_parallax) / five.parallax_error,
        "pmra": (five.pmra - five.true_pmra) / five.pmra_error,
        "pmdec": (five.pmdec - five.true_pmdec) / five.pmdec_error,
    }
    for name, pull in pulls.items():
        assert abs(pull.mean()) < 0.03 and pull.std() == pytest.approx(1.0, abs=0.03), name
    # Correlated noise: the ra-pmra pull correlation follows ra_pmra_corr.
    assert np.corrcoef(pulls["ra"], pulls["pmra"])[0, 1] == pytest.approx(five.ra_pmra_corr.mean(), abs=0.03)


def test_sky_has_a_galactic_plane_bulge_and_magellanic_clouds(mock):
    from astropy.coordinates import SkyCoord

    coords = SkyCoord(mock.ra.to_numpy(), mock.dec.to_numpy(), unit="deg")
    b = coords.galactic.b.deg
    assert (np.abs(b) < 10).mean() > 0.4  # |b| < 10 deg is 17% of the sky
    area = 2 * np.pi * (1 - np.cos(np.radians(3.0))) * (180 / np.pi) ** 2  # square degrees within 3 deg
    mean_density = len(mock) / 41253.0
    for cloud in (LMC, SMC):
        centre = SkyCoord(cloud["ra"], cloud["dec"], unit="deg")
        density = (coords.separation(centre).deg < 3.0).sum() / area
        assert density > 3 * mean_density
    assert mock.population.value_counts(normalize=True)["bulge"] == pytest.approx(0.12, abs=0.01)


@needs_shared_sample
@pytest.mark.filterwarnings("ignore::astropy.units.UnitsWarning")  # units of columns we do not use
def test_mock_resembles_the_real_sample(mock):
    from astropy.table import Table

    real = Table.read(SHARED_SAMPLE / "gdr2_sm.fits").to_pandas()
    five = mock[mock.parallax.notna()]

    def median_error(frame, lo, hi):
        return frame[(frame.phot_g_mean_mag >= lo) & (frame.phot_g_mean_mag < hi)].parallax_error.median()

    for lo, hi, _ in G_BINS[:4]:  # the real sample has too few stars beyond G = 20.5
        assert median_error(five, lo, hi) == pytest.approx(median_error(real, lo, hi), rel=0.2), (lo, hi)
    mock_g = np.percentile(five.phot_g_mean_mag, [25, 50, 75])
    real_g = np.percentile(real.phot_g_mean_mag, [25, 50, 75])
    np.testing.assert_allclose(mock_g, real_g, atol=0.7)
    np.testing.assert_allclose(
        np.nanpercentile(mock.bp_rp, [5, 50, 95]), np.nanpercentile(real.bp_rp, [5, 50, 95]), atol=0.15
    )
    # Photometric signal-to-noise as the archive publishes it, per passband, in G bins of the real sample.
    for band in ("g", "bp", "rp"):
        column = f"phot_{band}_mean_flux_over_error"
        for lo, hi in ((12, 14), (16.5, 17.5), (19.5, 20.5)):

            def median(frame, lo=lo, hi=hi, column=column):
                in_bin = frame[(frame.phot_g_mean_mag >= lo) & (frame.phot_g_mean_mag < hi)]
                return np.nanmedian(1.0857 / in_bin[column].to_numpy(dtype=float))

            assert median(mock) == pytest.approx(median(real), rel=0.4), (band, lo, hi)
