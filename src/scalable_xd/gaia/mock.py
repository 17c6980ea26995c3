"""A Gaia-DR2-like mock catalogue: the query's columns, units and dtypes, plus the true values.

Stars are drawn from a simple Milky Way (thin and thick exponential disks, a bar-shaped bulge, a power-law
halo) and the two Magellanic Clouds, seen through a dust layer by a magnitude-limited survey:

* Positions: disks with scale lengths 2.6 / 2.0 kpc and heights 0.3 / 0.9 kpc; bulge a Gaussian ellipsoid
  (0.9 x 0.35 x 0.3 kpc) tilted 27 deg; halo rho ~ r^-3.5 from 1 to 80 kpc; Sun at 8.122 kpc (astropy's
  Galactocentric frame). LMC at (80.894, -69.756) deg and 49.6 kpc, SMC at (13.187, -72.829) deg and
  62.1 kpc (GAIA_FACTS.md), exponential disks of 1.5 and 0.7 kpc.
* Kinematics: flat rotation curve 229 km/s with dispersions (35, 25, 18) / (60, 45, 40) km/s for the
  disks (thick disk lagging by 30 km/s), bulge and halo dispersions 100 / 120 km/s; LMC and SMC bulk proper
  motions (1.91, 0.23) and (0.77, -1.12) mas/yr (Gaia Collaboration, Helmi et al. 2018). Proper motions
  and positions come from astropy's Galactocentric -> ICRS transformation.
* Photometry: absolute G from a dwarf/giant mixture per population; extinction 0.8 mag/kpc in a 110 pc
  dust layer; E(BP-RP) = A_G / 2. The survey keeps stars brighter than a completeness limit that falls
  from G = 21.3 to 18.9 towards the crowded Galactic centre (GAIA_FACTS.md), with a soft roll-off.
* Uncertainties: the parallax error follows G through the medians of real DR2 five-parameter stars
  (0.042 / 0.098 / 0.31 / 0.68 / 1.27 mas in G bins 14-16 / 16-18 / 18-19.5 / 19.5-20.5 / >20.5,
  GAIA_FACTS.md and the shared real sample), with 0.3 dex scatter and a scanning-law factor that varies
  with ecliptic latitude; the other errors scale by 0.80 (ra*), 0.78 (dec), 1.70 (pmra), 1.56 (pmdec)
  (Lindegren et al. 2018). ``ra_error`` is sigma_ra* in mas, as in the archive.
* Photometry errors: each passband's photon-noise error in mag is a + b 10^(c (G - 17)), through the
  medians of the real sample (GAIA_FACTS.md; mmag: G 0.3 / 1.0 / 6.6, BP 1.8 / 10 / 120, RP 1.0 / 5.0 / 53
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

from .schema import (
    ASTROMETRY, CORRELATIONS, FEATURES, FIVE_PARAMETER_ONLY, FLUX_OVER_ERROR, MAS_PER_DEG, QUERY_COLUMNS,
    ZERO_POINT_ERROR,
)  # fmt: skip
R_SUN_KPC = 8.122
LMC = dict(ra=80.894, dec=-69.756, distance=49.6, scale=1.5, pm=(1.91, 0.229))
SMC = dict(ra=13.187, dec=-72.829, distance=62.1, scale=0.7, pm=(0.772, -1.117))

# Fractions of catalogue stars (after the magnitude limit) per population.
POPULATIONS = {"thin_disk": 0.60, "thick_disk": 0.20, "bulge": 0.12, "halo": 0.0695, "lmc": 0.008, "smc": 0.0025}

# Parallax error (mas) against G: log-linear through the medians of real DR2 five-parameter stars.
_PLX_ERR_G = np.array([6.0, 13.0, 15.0, 17.0, 18.75, 20.0, 21.0, 22.0])
_PLX_ERR_MAS = np.array([0.018, 0.022, 0.036, 0.085, 0.29, 0.66, 1.40, 2.8])
_ERROR_RATIOS = {"ra": 0.80, "dec": 0.78, "parallax": 1.0, "pmra": 1.70, "pmdec": 1.56}

# Fisher-z location and spread of each correlation (real DR2 sample medians and spreads), and the
# amplitude of its ecliptic-longitude pattern.
_CORR_MEDIAN = {"ra_dec_corr": 0.11, "ra_parallax_corr": -0.03, "ra_pmra_corr": -0.21, "ra_pmdec_corr": -0.11,
                "dec_parallax_corr": -0.08, "dec_pmra_corr": -0.07, "dec_pmdec_corr": -0.25,
                "parallax_pmra_corr": -0.09, "parallax_pmdec_corr": 0.07, "pmra_pmdec_corr": 0.12}  # fmt: skip
_CORR_SPREAD = 0.26
_CORR_PATTERN = 0.15

_OBLIQUITY = np.deg2rad(23.4393)

# Photon-noise magnitude error a + b 10^(c (G - 17)) per passband, a and b in mag.
_PHOT_ERR = {"g": (0.00025, 0.00075, 0.309), "bp": (0.0015, 0.0085, 0.381), "rp": (0.0008, 0.0042, 0.365)}
_PHOT_ERR_CAP = 0.5


def _galactocentric_icrs(x, y, z, vx, vy, vz):
    """(ra, dec, distance kpc, pmra*, pmdec mas/yr) of Galactocentric positions (kpc) and velocities (km/s)."""
    import astropy.units as u
    from astropy.coordinates import ICRS, CartesianDifferential, CartesianRepresentation, Galactocentric

    rep = CartesianRepresentation(x * u.kpc, y * u.kpc, z * u.kpc).with_differentials(
        CartesianDifferential(vx * u.km / u.s, vy * u.km / u.s, vz * u.km / u.s)
    )
    icrs = Galactocentric(rep).transform_to(ICRS())
    return (
        icrs.ra.deg,
        icrs.dec.deg,
        icrs.distance.to_value(u.kpc),
        icrs.pm_ra_cosdec.to_value(u.mas / u.yr),
        icrs.pm_dec.to_value(u.mas / u.yr),
    )


def _heliocentric_galactic(x, y, z):
    """Galactic (l, b) in degrees and distance (kpc) of Galactocentric positions, for the selection."""
    dx, dz = x + R_SUN_KPC, z - 0.0208
    d = np.sqrt(dx**2 + y**2 + dz**2)
    return np.degrees(np.arctan2(y, dx)) % 360.0, np.degrees(np.arcsin(np.clip(dz / d, -1, 1))), d


def _extinction(b_deg, d_kpc, per_kpc=0.8, height=0.11):
    """A_G through an exponential dust layer: per_kpc * h / |sin b| * (1 - exp(-d |sin b| / h))."""
    s = np.abs(np.sin(np.radians(b_deg)))
    path = np.where(s * d_kpc / height > 1e-6, height / np.maximum(s, 1e-12) * -np.expm1(-d_kpc * s / height), d_kpc)
    return per_kpc * path


def _completeness_limit(l_deg, b_deg):
    """The G of 99% completeness: 21.3 over most of the sky, down to 18.9 at the crowded Galactic centre."""
    cos_theta = np.cos(np.radians(b_deg)) * np.cos(np.radians(l_deg))
    theta = np.degrees(np.arccos(np.clip(cos_theta, -1, 1)))
    return 21.3 - 2.4 * np.exp(-0.5 * (theta / 7.0) ** 2)


def _absolute_magnitudes(rng, n, giant_fraction, dwarf_mean, dwarf_sd):
    giant = rng.random(n) < giant_fraction
    mag = np.where(giant, rng.normal(0.7, 0.9, n), np.clip(rng.normal(dwarf_mean, dwarf_sd, n), -1.0, 14.0))
    colour = np.where(
        giant,
        1.05 + 0.12 * (1.0 - mag) + rng.normal(0, 0.15, n),
        np.clip(0.47 + 0.19 * (mag - 2.5), 0.3, 3.2) + rng.normal(0, 0.08, n),
    )
    return mag, colour


def _disk(rng, n, scale_length, scale_height, v_lag, dispersion):
    radius = rng.gamma(2.0, scale_length, n)
    phi = rng.uniform(0, 2 * np.pi, n)
    z = rng.laplace(0.0, scale_height, n)
    v_phi = 229.0 - v_lag + rng.normal(0, dispersion[1], n)
    v_r, v_z = rng.normal(0, dispersion[0], n), rng.normal(0, dispersion[2], n)
    # Rotation carries the Sun (phi = pi) towards +y, as in astropy's Galactocentric frame.
    vx = v_r * np.cos(phi) + v_phi * np.sin(phi)
    vy = v_r * np.sin(phi) - v_phi * np.cos(phi)
    return radius * np.cos(phi), radius * np.sin(phi), z, vx, vy, v_z


def _bulge(rng, n):
    local = rng.normal(0, 1, (n, 3)) * np.array([0.9, 0.35, 0.3])
    angle = np.radians(27.0)
    x = local[:, 0] * np.cos(angle) - local[:, 1] * np.sin(angle)
    y = local[:, 0] * np.sin(angle) + local[:, 1] * np.cos(angle)
    radius = np.hypot(x, y)
    v_rot = 60.0 * np.minimum(radius, 1.0)
    vx = v_rot * np.sin(np.arctan2(y, x)) + rng.normal(0, 100, n)
    vy = -v_rot * np.cos(np.arctan2(y, x)) + rng.normal(0, 100, n)
    return x, y, local[:, 2], vx, vy, rng.normal(0, 90, n)


def _halo(rng, n, r_min=1.0, r_max=80.0):
    u = rng.random(n)
    r = (r_min**-0.5 - u * (r_min**-0.5 - r_max**-0.5)) ** -2  # rho ~ r^-3.5: p(r) ~ r^-1.5
    cos_t, phi = rng.uniform(-1, 1, n), rng.uniform(0, 2 * np.pi, n)
    sin_t = np.sqrt(1 - cos_t**2)
    v = rng.normal(0, 120, (3, n))
    return r * sin_t * np.cos(phi), r * sin_t * np.sin(phi), r * cos_t, v[0], v[1], v[2]


_MILKY_WAY = {
    # name: (sampler, giant fraction, dwarf absolute-magnitude mean and spread)
    "thin_disk": (lambda rng, n: _disk(rng, n, 2.6, 0.3, 0.0, (35, 25, 18)), 0.02, 8.0, 2.0),
    "thick_disk": (lambda rng, n: _disk(rng, n, 2.0, 0.9, 30.0, (60, 45, 40)), 0.03, 7.0, 1.8),
    "bulge": (_bulge, 0.10, 5.0, 1.6),
    "halo": (_halo, 0.06, 6.0, 1.6),
}


def _select(rng, galactic_l, galactic_b, apparent_g):
    """Keep a star with the probability that a survey with a soft completeness limit detects it."""
    limit = _completeness_limit(galactic_l, galactic_b)
    keep_probability = 1.0 / (1.0 + np.exp((apparent_g - limit) / 0.3))
    return (rng.random(len(apparent_g)) < keep_probability) & (apparent_g > 3.0)


def _rejection_sample(n: int, oversample: int, draw) -> dict:
    """The first n kept candidates, column by column: ``draw(batch)`` returns (columns, keep mask) and is
    called with batches ``oversample`` times the shortfall until enough are kept."""
    kept, total = [], 0
    while total < n:
        columns, keep = draw(max(oversample * (n - total), 2000))
        kept.append({name: values[keep] for name, values in columns.items()})
        total += int(keep.sum())
    return {name: np.concatenate([part[name] for part in kept])[:n] for name in kept[0]}


def _milky_way_population(rng, name: str, n: int) -> dict:
    sampler, giant_fraction, dwarf_mean, dwarf_sd = _MILKY_WAY[name]

    def draw(batch):
        x, y, z, vx, vy, vz = sampler(rng, batch)
        gl, gb, dist = _heliocentric_galactic(x, y, z)
        mag, colour = _absolute_magnitudes(rng, batch, giant_fraction, dwarf_mean, dwarf_sd)
        a_g = _extinction(gb, dist)
        g = mag + 5 * np.log10(dist * 100.0) + a_g
        columns = dict(x=x, y=y, z=z, vx=vx, vy=vy, vz=vz, g=g, bp_rp=colour + 0.45 * a_g)
        return columns, _select(rng, gl, gb, g)

    cat = _rejection_sample(n, 4, draw)
    ra, dec, dist, pmra, pmdec = _galactocentric_icrs(cat["x"], cat["y"], cat["z"], cat["vx"], cat["vy"], cat["vz"])
    return dict(ra=ra, dec=dec, distance=dist, pmra=pmra, pmdec=pmdec, g=cat["g"], bp_rp=cat["bp_rp"])


def _magellanic_population(rng, cloud: dict, n: int) -> dict:
    def draw(batch):
        radius = rng.gamma(2.0, cloud["scale"], batch) / cloud["distance"]  # radians
        angle = rng.uniform(0, 2 * np.pi, batch)
        dist = cloud["distance"] + rng.normal(0, 0.05 * cloud["distance"], batch)
        mag, colour = _absolute_magnitudes(rng, batch, 0.55, 2.5, 1.5)
        a_g = 0.15 + rng.exponential(0.1, batch)
        g = mag + 5 * np.log10(dist * 100.0) + a_g
        keep = (rng.random(batch) < 1.0 / (1.0 + np.exp((g - 20.7) / 0.2))) & (g > 3.0)
        return dict(radius=radius, angle=angle, dist=dist, g=g, bp_rp=colour + 0.45 * a_g), keep

    cat = _rejection_sample(n, 6, draw)
    dec = cloud["dec"] + np.degrees(0.8 * cat["radius"] * np.sin(cat["angle"]))
    ra = (cloud["ra"] + np.degrees(cat["radius"] * np.cos(cat["angle"])) / np.cos(np.radians(dec))) % 360.0
    dispersion = 20.0 / (4.74 * cat["dist"])  # 20 km/s internal motions, in mas/yr
    pmra = cloud["pm"][0] + rng.normal(0, 1, n) * dispersion
    pmdec = cloud["pm"][1] + rng.normal(0, 1, n) * dispersion
    return dict(ra=ra, dec=dec, distance=cat["dist"], pmra=pmra, pmdec=pmdec, g=cat["g"], bp_rp=cat["bp_rp"])


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
    counts = rng.multinomial(n_rows, list(POPULATIONS.values()))
    parts, labels = [], []
    for (name, _), count in zip(POPULATIONS.items(), counts):
        if count == 0:
            continue
        if name in ("lmc", "smc"):
            parts.append(_magellanic_population(rng, LMC if name == "lmc" else SMC, count))
        else:
            parts.append(_milky_way_population(rng, name, count))
        labels.append(np.full(count, name))
    true = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    population = np.concatenate(labels)
    order = rng.permutation(n_rows)  # mix the populations before anything depends on row order
    true = {k: v[order] for k, v in true.items()}
    population = population[order]
    true["parallax"] = 1.0 / true.pop("distance")  # mas, for distances in kpc
    true["phot_g_mean_mag"] = true.pop("g")
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
    cell = (np.floor(np.clip(dec, -90, 89.999999) + 90).astype(np.int64) * 360 + np.floor(ra).astype(np.int64) % 360)
    order = np.lexsort((np.arange(len(cell)), cell))
    serial = np.empty(len(cell), dtype=np.int64)
    sorted_cells = cell[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_cells)) + 1]
    run_start = np.repeat(starts, np.diff(np.r_[starts, len(cell)]))
    serial[order] = np.arange(len(cell)) - run_start
    return cell * (1 << 35) + serial
