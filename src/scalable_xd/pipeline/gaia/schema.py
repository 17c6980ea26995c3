"""Column names, dtypes and units of the Gaia DR2 subset the experiment uses (gaiadr2.gaia_source).

The raw catalogue (from the archive query or the mock) has exactly ``QUERY_COLUMNS``, with archive NULLs
as NaN in float columns. Features follow the paper's appendix B: five astrometric parameters, the BP-RP
colour and the G magnitude.
"""

from __future__ import annotations

from ..features_file import FeatureSpec

# The archive query's defaults (``query.query_gaia`` and ``scalable-xd query``).
QUERY_DEFAULTS: dict[str, int | float] = {
    "chunk_rows": 200_000,
    "retries": 5,
    "request_timeout": 300.0,
    "job_timeout": 5400.0,
}

MAS_PER_DEG = 3.6e6  # the archive gives ra_error and dec_error in mas, ra and dec in degrees

FEATURES = ("ra", "dec", "parallax", "pmra", "pmdec", "bp_rp", "phot_g_mean_mag")
ASTROMETRY = FEATURES[:5]
PHOTOMETRY = FEATURES[5:]
ERRORS = tuple(f"{name}_error" for name in ASTROMETRY)

# The ten astrometric correlation columns, in archive order, with the feature indices they couple.
CORRELATIONS = tuple(
    (f"{a}_{b}_corr", ASTROMETRY.index(a), ASTROMETRY.index(b))
    for i, a in enumerate(ASTROMETRY)
    for b in ASTROMETRY[i + 1 :]
)
CORRELATION_PAIRS = tuple((i, j) for _, i, j in CORRELATIONS)

_MAS_PER_YR = "mas / yr"

# DR2 publishes fluxes with errors, not magnitude errors: the signal-to-noise column of each passband.
FLUX_OVER_ERROR = {band: f"phot_{band}_mean_flux_over_error" for band in ("g", "bp", "rp")}
# Uncertainty (mag) of each passband's Vega zero-point (Evans et al. 2018): the floor of a magnitude error.
ZERO_POINT_ERROR = {"g": 0.0018, "bp": 0.0014, "rp": 0.0019}

# name -> (numpy dtype, astropy unit string or None), in the order the query selects them.
QUERY_COLUMNS = {
    "source_id": ("int64", None),
    "random_index": ("int64", None),
    "ra": ("float64", "deg"),
    "dec": ("float64", "deg"),
    "parallax": ("float64", "mas"),
    "pmra": ("float64", _MAS_PER_YR),
    "pmdec": ("float64", _MAS_PER_YR),
    "ra_error": ("float64", "mas"),
    "dec_error": ("float64", "mas"),
    "parallax_error": ("float64", "mas"),
    "pmra_error": ("float64", _MAS_PER_YR),
    "pmdec_error": ("float64", _MAS_PER_YR),
    **{name: ("float32", None) for name, _, _ in CORRELATIONS},
    "bp_rp": ("float32", "mag"),
    "phot_g_mean_mag": ("float32", "mag"),
    **{name: ("float32", None) for name in FLUX_OVER_ERROR.values()},
}

# Columns that are NULL for two-parameter solutions (position only).
FIVE_PARAMETER_ONLY = ("parallax", "pmra", "pmdec", "parallax_error", "pmra_error", "pmdec_error") + tuple(
    name for name, _, _ in CORRELATIONS if name != "ra_dec_corr"
)

GAIA_TABLE = "gaiadr2.gaia_source"

# The features file's description of DR2's features (``features_file``): units as in the features
# (degrees for ra and dec, as the mas of the archive's errors are converted; see ``features``).
GAIA_DR2 = FeatureSpec(
    "gaia_dr2",
    FEATURES,
    ("deg", "deg", "mas", _MAS_PER_YR, _MAS_PER_YR, "mag", "mag"),
    CORRELATIONS,
    roles=(
        ("ra", "ra"),
        ("dec", "dec"),
        ("parallax", "parallax"),
        ("colour", "bp_rp"),
        ("magnitude", "phot_g_mean_mag"),
    ),
    labels=("ra [deg]", "dec [deg]", "parallax [mas]", "pmra [mas/yr]", "pmdec [mas/yr]", "BP-RP [mag]", "G [mag]"),
)
