"""From raw Gaia DR2 columns to the seven features and their per-star 7x7 noise covariances.

Features: ra, dec (deg), parallax (mas), pmra, pmdec (mas/yr), bp_rp, phot_g_mean_mag (mag). Noise is
stored compactly, 7 standard deviations plus the 10 astrometric correlations a star (``CompactCovariance``
builds the 7x7 matrices batch by batch on the fitting device). Two modes:

``corrected`` (default)
    Units converted to the features' own: sigma_ra = ra_error / (3.6e6 cos dec) deg (``ra_error`` is
    sigma_ra* in mas), sigma_dec = dec_error / 3.6e6 deg. bp_rp and G, which have no published error, get
    variance 1e-2 as the paper's appendix B states. Any missing value, bp_rp included, becomes x = 0
    with variance 1e12 and no correlations.
``paper``
    What the paper's public preprocessing code did: ra_error and dec_error in mas used as if in degrees,
    bp_rp/G variance 1e-4, missing astrometry x = 0 with variance 1e12, but a missing bp_rp (or G) becomes
    x = 0 with variance 1e-4: a confident wrong colour. Use it to compare with the paper's Table 1.

Bad rows are repaired by a fixed rule and counted in ``Features.counts``, never silently:

* ``invalid_error``: a value present but its error (for photometry in ``corrected`` mode: a passband's
  flux_over_error) NaN or not positive -> treated as missing.
* ``missing_correlation``: a correlation NaN while both its values are present -> 0.
* ``correlation_out_of_range``: a correlation with |rho| > 1 -> 0.
* ``not_positive_definite``: a star whose astrometric correlation matrix is not positive definite
  (smallest eigenvalue below 1e-6) -> all its correlations set to 0.

``n_missing`` counts each star's entries with variance 1e12; each adds -log(2 pi 1e12)/2 to its
log-likelihood, which reports remove to give log-likelihoods of the observed entries alone.

Features files and the train/val/test split are ``features_file``'s; ``storage`` writes them from a raw
catalogue.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ...data.missing import MISSING_VARIANCE
from ..features_file import Features
from .schema import (
    ASTROMETRY,
    CORRELATION_PAIRS,
    CORRELATIONS,
    FEATURES,
    FLUX_OVER_ERROR,
    GAIA_DR2,
    MAS_PER_DEG,
    ZERO_POINT_ERROR,
)

MODES = ("corrected", "paper")
TRUE_COLUMNS = GAIA_DR2.true_columns
MISSING_SIGMA = math.sqrt(MISSING_VARIANCE)  # the library's missing-entry convention (``dataset``)
PAPER_PHOTOMETRIC_SIGMA = 0.01  # what the paper's code gave bp_rp and G
MAG_PER_LN_FLUX = 2.5 / np.log(10)
_PD_FLOOR = 1e-6
# The kinds of bad row that are repaired and counted (see the module docstring).
REPAIRS = ("invalid_error", "missing_correlation", "correlation_out_of_range", "not_positive_definite")


def _as_frame(table) -> pd.DataFrame:
    """pandas DataFrame from a DataFrame, an astropy Table (masked entries -> NaN) or a pyarrow Table."""
    if isinstance(table, pd.DataFrame):
        return table
    if hasattr(table, "to_pandas") and hasattr(table, "colnames"):  # astropy Table
        return table.to_pandas()
    if hasattr(table, "to_pandas"):  # pyarrow Table
        return table.to_pandas()
    raise TypeError(f"expected a pandas DataFrame, astropy Table or pyarrow Table, got {type(table).__name__}")


def _column(frame: pd.DataFrame, name: str) -> np.ndarray:
    if name not in frame:
        raise ValueError(f"the table has no column {name!r}; the features need the query's columns")
    return frame[name].to_numpy(dtype=np.float64, na_value=np.nan)


def compute_features(table, mode: str = "corrected") -> Features:
    """Features and compact noise for every row of a raw DR2-schema table (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown covariance mode {mode!r}: choose one of {', '.join(MODES)}")
    frame = _as_frame(table)
    n = len(frame)
    counts = dict.fromkeys(REPAIRS, 0)
    values = np.stack([_column(frame, name) for name in FEATURES], axis=1)
    present = np.isfinite(values)
    sigma = np.empty((n, len(FEATURES)))

    errors = np.stack([_column(frame, f"{name}_error") for name in ASTROMETRY], axis=1)
    bad_error = present[:, :5] & ~(errors > 0)  # NaN or non-positive
    if mode == "corrected":
        errors = errors.copy()
        errors[:, 0] /= MAS_PER_DEG * np.cos(np.radians(values[:, 1]))
        errors[:, 1] /= MAS_PER_DEG
    sigma[:, :5] = errors
    sigma[:, 5:] = photometric_errors(frame) if mode == "corrected" else PAPER_PHOTOMETRIC_SIGMA
    bad_error = np.concatenate([bad_error, present[:, 5:] & ~(sigma[:, 5:] > 0)], axis=1)  # flux_over_error
    counts["invalid_error"] = int(bad_error.any(axis=1).sum())
    present &= ~bad_error

    gets_missing_variance = ~present
    if mode == "paper":  # the paper's code gave a missing colour (or G) the ordinary photometric variance
        gets_missing_variance[:, 5:] = False
    X = np.where(present, values, 0.0)
    sigma = np.where(gets_missing_variance, MISSING_SIGMA, sigma)

    corr = np.stack([_column(frame, name) for name, _, _ in CORRELATIONS], axis=1)
    both = np.stack([present[:, i] & present[:, j] for i, j in CORRELATION_PAIRS], axis=1)
    counts["missing_correlation"] = int((both & np.isnan(corr)).any(axis=1).sum())
    out_of_range = both & (np.abs(corr) > 1)
    counts["correlation_out_of_range"] = int(out_of_range.any(axis=1).sum())
    corr = np.where(both & np.isfinite(corr) & ~out_of_range, corr, 0.0)
    not_pd = _not_positive_definite(corr)
    counts["not_positive_definite"] = int(not_pd.sum())
    corr[not_pd] = 0.0

    return Features(
        GAIA_DR2,
        X=X,
        sigma=sigma,
        corr=corr,
        n_missing=gets_missing_variance.sum(axis=1).astype(np.int8),
        source_id=frame["source_id"].to_numpy(dtype=np.int64),
        random_index=frame["random_index"].to_numpy(dtype=np.int64),
        mode=mode,
        counts=counts,
        true=_true_values(frame),
    )


def _true_values(frame: pd.DataFrame) -> np.ndarray | None:
    """The noise-free values the mock carries (``true_<feature>``), or None for real data."""
    if not all(name in frame for name in TRUE_COLUMNS):
        return None
    return np.stack([_column(frame, name) for name in TRUE_COLUMNS], axis=1)


def photometric_errors(table) -> np.ndarray:
    """(N, 2) errors in mag of bp_rp and phot_g_mean_mag from the flux_over_error columns (see the module
    docstring); NaN where a passband's flux_over_error is missing or not positive."""
    frame = _as_frame(table)

    def magnitude_error(band):
        snr = _column(frame, FLUX_OVER_ERROR[band])
        snr = np.where(snr > 0, snr, np.nan)
        return np.hypot(MAG_PER_LN_FLUX / snr, ZERO_POINT_ERROR[band])

    return np.stack([np.hypot(magnitude_error("bp"), magnitude_error("rp")), magnitude_error("g")], axis=1)


def _not_positive_definite(corr: np.ndarray, chunk: int = 1 << 18) -> np.ndarray:
    rows = np.array([i for i, _ in CORRELATION_PAIRS])
    cols = np.array([j for _, j in CORRELATION_PAIRS])
    bad = np.zeros(len(corr), dtype=bool)
    for start in range(0, len(corr), chunk):
        block = corr[start : start + chunk]
        matrices = np.broadcast_to(np.eye(len(ASTROMETRY)), (len(block), 5, 5)).copy()
        matrices[:, rows, cols] = matrices[:, cols, rows] = block
        bad[start : start + chunk] = np.linalg.eigvalsh(matrices)[:, 0] < _PD_FLOOR
    return bad
