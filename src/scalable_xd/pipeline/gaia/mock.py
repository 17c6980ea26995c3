"""A Gaia-DR2-like mock catalogue: the query's columns, units and dtypes, plus the true values.

Stars are drawn from a simple Milky Way and the two Magellanic Clouds, seen through a dust layer by a
magnitude-limited survey (``galaxy``); here they get DR2-like uncertainties and missing entries:

* Uncertainties: the parallax error follows G through the medians of real DR2 five-parameter stars
  (0.042 / 0.098 / 0.31 / 0.68 / 1.27 mas in G bins 14-16 / 16-18 / 18-19.5 / 19.5-20.5 / >20.5,
  measured on a real DR2 sample; Lindegren et al. 2018), with 0.3 dex scatter and a scanning-law factor that varies
  with ecliptic latitude; the other errors scale by 0.80 (ra*), 0.78 (dec), 1.70 (pmra), 1.56 (pmdec)
  (Lindegren et al. 2018). ``ra_error`` is sigma_ra* in mas, as in the archive.
* Photometry errors: each passband's photon-noise error in mag is a + b 10^(c (G - 17)), through the
  medians of a real DR2 sample (Evans et al. 2018; mmag: G 0.3 / 1.0 / 6.6, BP 1.8 / 10 / 120, RP 1.0 / 5.0 / 53
  at G 13 / 17 / 20), with 0.1 dex scatter, capped at 0.5 mag. The catalogue publishes them as the archive
  does, ``phot_<band>_mean_flux_over_error`` = (2.5 / ln 10) / error; the noise drawn also includes the
  zero-point uncertainty (Evans et al. 2018), which ``features`` adds back as its floor.
* Correlations: Fisher-z normal per coefficient with the medians and spreads of the real sample plus a
  sky pattern in ecliptic longitude (the scanning law), shrunk towards zero where a star's 5x5 matrix
  would not be positive definite.
* Missing data: about 21% two-parameter solutions (no parallax, proper motion or their errors and
  correlations; ra_dec_corr kept), mostly faint; about 18% without bp_rp.
* ``random_index`` is a uniform permutation of 0..N-1; ``source_id`` is a 1-degree sky cell times 2^35
  plus a serial number (unique and sky-ordered like the archive's, but not its HEALPix level-12 index).

Observed values are the true values plus noise drawn from each star's covariance. The mock is fully
determined by (n_rows, seed).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .galaxy import POPULATIONS, draw_true_values
from .schema import (
    ASTROMETRY,
    CORRELATIONS,
    FEATURES,
    FIVE_PARAMETER_ONLY,
    FLUX_OVER_ERROR,
    MAS_PER_DEG,
    QUERY_COLUMNS,
    ZERO_POINT_ERROR,
)

# Parallax error (mas) against G: log-linear through the medians of real DR2 five-parameter stars.
_PLX_ERR_G = np.array([6.0, 13.0, 15.0, 17.0, 18.75, 20.0, 21.0, 22.0])
_PLX_ERR_MAS = np.array([0.018, 0.022, 0.036, 0.085, 0.29, 0.66, 1.40, 2.8])
_ERROR_RATIOS = {"ra": 0.80, "dec": 0.78, "parallax": 1.0, "pmra": 1.70, "pmdec": 1.56}

# Fisher-z location and spread of each correlation (real DR2 sample medians and spreads), and the
# amplitude of its ecliptic-longitude pattern.
_CORR_MEDIAN = {
    "ra_dec_corr": 0.11,
    "ra_parallax_corr": -0.03,
    "ra_pmra_corr": -0.21,
    "ra_pmdec_corr": -0.11,
    "dec_parallax_corr": -0.08,
    "dec_pmra_corr": -0.07,
    "dec_pmdec_corr": -0.25,
    "parallax_pmra_corr": -0.09,
    "parallax_pmdec_corr": 0.07,
    "pmra_pmdec_corr": 0.12,
}
_CORR_SPREAD = 0.26
_CORR_PATTERN = 0.15

_OBLIQUITY = np.deg2rad(23.4393)

# Photon-noise magnitude error a + b 10^(c (G - 17)) per passband, a and b in mag.
_PHOT_ERR = {"g": (0.00025, 0.00075, 0.309), "bp": (0.0015, 0.0085, 0.381), "rp": (0.0008, 0.0042, 0.365)}
_PHOT_ERR_CAP = 0.5


def _ecliptic_coordinates(ra_deg, dec_deg):
    ra, dec = np.radians(ra_deg), np.radians(dec_deg)
    sin_beta = np.sin(dec) * np.cos(_OBLIQUITY) - np.cos(dec) * np.sin(_OBLIQUITY) * np.sin(ra)
    lam = np.arctan2(np.sin(ra) * np.cos(_OBLIQUITY) + np.tan(dec) * np.sin(_OBLIQUITY), np.cos(ra))
    return lam, np.arcsin(np.clip(sin_beta, -1, 1))


def _correlations(rng, ecl_lon, ecl_lat):
    """(N, 10) correlation coefficients forming a positive-definite 5x5 matrix for every star."""
    n = len(ecl_lon)
    phases = np.linspace(0, np.pi, len(CORRELATIONS), endpoint=False)
    z = np.empty((n, len(CORRELATIONS)))
    for p, (name, _, _) in enumerate(CORRELATIONS):
        pattern = _CORR_PATTERN * np.sin(2 * ecl_lon + phases[p]) * np.cos(ecl_lat) ** 2
        z[:, p] = np.arctanh(_CORR_MEDIAN[name]) + pattern + rng.normal(0, _CORR_SPREAD, n)
    rho = np.tanh(z)
    rows = np.array([i for _, i, _ in CORRELATIONS])
    cols = np.array([j for _, _, j in CORRELATIONS])
    suspects = np.arange(n)
    for _ in range(60):
        matrices = np.broadcast_to(np.eye(5), (len(suspects), 5, 5)).copy()
        matrices[:, rows, cols] = matrices[:, cols, rows] = rho[suspects]
        suspects = suspects[np.linalg.eigvalsh(matrices)[:, 0] < 1e-3]
        if len(suspects) == 0:
            return rho
        rho[suspects] *= 0.9
    raise RuntimeError("could not make the mock correlation matrices positive definite")


def _parallax_error(rng, g, ecl_lat):
    base = np.exp(np.interp(g, _PLX_ERR_G, np.log(_PLX_ERR_MAS)))
    scan = 1.15 - 0.3 * np.abs(np.sin(ecl_lat))  # fewer transits near the ecliptic
    return base * scan * np.exp(rng.normal(0, 0.3 * np.log(10) / 2, len(g)))


def _photometric_errors(rng, g) -> dict:
    """Photon-noise magnitude error per passband (see the module docstring)."""
    errors = {}
    for band, (a, b, c) in _PHOT_ERR.items():
        scatter = np.exp(rng.normal(0, 0.1 * np.log(10) / 2, len(g)))
        errors[band] = np.minimum((a + b * 10 ** (c * (g - 17.0))) * scatter, _PHOT_ERR_CAP)
    return errors


def make_mock(n_rows: int, seed: int = 0) -> pd.DataFrame:
    """A DR2-like catalogue of ``n_rows`` stars: the query's columns (``schema.QUERY_COLUMNS``) plus
    ``true_<feature>`` noise-free values and ``population``. Deterministic for (n_rows, seed)."""
    if n_rows < 1:
        raise ValueError(f"n_rows must be positive, got {n_rows}")
    rng = np.random.default_rng(seed)
    true, population = draw_true_values(rng, n_rows)
    return _observe(rng, true, population)


def _observe(rng, true: dict, population: np.ndarray) -> pd.DataFrame:
    """Attach DR2-like uncertainties, correlations and missing entries, then add the noise."""
    n = len(population)
    g = true["phot_g_mean_mag"]
    ecl_lon, ecl_lat = _ecliptic_coordinates(true["ra"], true["dec"])
    two_parameter = rng.random(n) < 1.0 / (1.0 + np.exp(-(g - 20.7) / 0.3))
    no_colour = rng.random(n) < 0.025 + 0.5 * two_parameter + 0.2 / (1.0 + np.exp(-(g - 20.3) / 0.3))

    plx_err = _parallax_error(rng, g, ecl_lat)
    errors = {name: plx_err * ratio * np.exp(rng.normal(0, 0.08, n)) for name, ratio in _ERROR_RATIOS.items()}
    errors["ra"] = np.where(two_parameter, 1.6 * errors["ra"], errors["ra"])
    errors["dec"] = np.where(two_parameter, 1.6 * errors["dec"], errors["dec"])
    rho = _correlations(rng, ecl_lon, ecl_lat)

    # Noise in the archive's units: mas (positions as sigma_ra* and sigma_dec), mas/yr, mas.
    corr = np.broadcast_to(np.eye(5), (n, 5, 5)).copy()
    for p, (_, i, j) in enumerate(CORRELATIONS):
        corr[:, i, j] = corr[:, j, i] = rho[:, p]
    sigma = np.stack([errors[name] for name in ASTROMETRY], axis=1)
    noise = sigma * np.einsum("nij,nj->ni", np.linalg.cholesky(corr), rng.normal(size=(n, 5)))
    cos_dec = np.cos(np.radians(true["dec"]))
    dec = true["dec"] + noise[:, 1] / MAS_PER_DEG
    phot = _photometric_errors(rng, g)
    total = {band: np.hypot(phot[band], ZERO_POINT_ERROR[band]) for band in phot}
    colour_sigma = np.hypot(total["bp"], total["rp"])
    observed = {
        "ra": (true["ra"] + noise[:, 0] / (MAS_PER_DEG * cos_dec)) % 360.0,
        "dec": np.clip(dec, -90.0, 90.0),
        "parallax": true["parallax"] + noise[:, 2],
        "pmra": true["pmra"] + noise[:, 3],
        "pmdec": true["pmdec"] + noise[:, 4],
        "bp_rp": true["bp_rp"] + rng.normal(0, 1, n) * colour_sigma,
        "phot_g_mean_mag": g + rng.normal(0, 1, n) * total["g"],
    }
    frame = pd.DataFrame(
        {
            "source_id": _source_ids(observed["ra"], observed["dec"]),
            "random_index": rng.permutation(n).astype(np.int64),
            **{name: observed[name] for name in ASTROMETRY},
            **{f"{name}_error": errors[name] for name in ASTROMETRY},
            **{name: rho[:, p] for p, (name, _, _) in enumerate(CORRELATIONS)},
            "bp_rp": observed["bp_rp"],
            "phot_g_mean_mag": observed["phot_g_mean_mag"],
            **{FLUX_OVER_ERROR[band]: 2.5 / np.log(10) / phot[band] for band in phot},
        }
    )
    frame.loc[two_parameter, list(FIVE_PARAMETER_ONLY)] = np.nan
    frame.loc[no_colour, ["bp_rp", FLUX_OVER_ERROR["bp"], FLUX_OVER_ERROR["rp"]]] = np.nan
    frame = frame.astype({name: dtype for name, (dtype, _) in QUERY_COLUMNS.items()})
    for name in FEATURES:
        frame[f"true_{name}"] = true[name]
    frame["population"] = pd.Categorical(population, categories=list(POPULATIONS))
    return frame.sort_values("source_id", kind="stable", ignore_index=True)


def _source_ids(ra, dec):
    """Unique, sky-ordered int64 ids: a 1x1 degree cell number times 2^35 plus a serial within the cell."""
    cell = np.floor(np.clip(dec, -90, 89.999999) + 90).astype(np.int64) * 360 + np.floor(ra).astype(np.int64) % 360
    order = np.lexsort((np.arange(len(cell)), cell))
    serial = np.empty(len(cell), dtype=np.int64)
    sorted_cells = cell[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_cells)) + 1]
    run_start = np.repeat(starts, np.diff(np.r_[starts, len(cell)]))
    serial[order] = np.arange(len(cell)) - run_start
    return cell * (1 << 35) + serial
