"""The Milky Way and Magellanic Clouds of the mock catalogue: true positions, motions and magnitudes.

Stars are drawn from a simple Milky Way (thin and thick exponential disks, a bar-shaped bulge, a power-law
halo) and the two Magellanic Clouds, seen through a dust layer by a magnitude-limited survey:

* Positions: disks with scale lengths 2.6 / 2.0 kpc and heights 0.3 / 0.9 kpc; bulge a Gaussian ellipsoid
  (0.9 x 0.35 x 0.3 kpc) tilted 27 deg; halo rho ~ r^-3.5 from 1 to 80 kpc; Sun at 8.122 kpc (astropy's
  Galactocentric frame). LMC at (80.894, -69.756) deg and 49.6 kpc, SMC at (13.187, -72.829) deg and
  62.1 kpc, exponential disks of 1.5 and 0.7 kpc.
* Kinematics: flat rotation curve 229 km/s with dispersions (35, 25, 18) / (60, 45, 40) km/s for the
  disks (thick disk lagging by 30 km/s), bulge and halo dispersions 100 / 120 km/s; LMC and SMC bulk proper
  motions (1.91, 0.23) and (0.77, -1.12) mas/yr (Gaia Collaboration, Helmi et al. 2018). Proper motions
  and positions come from astropy's Galactocentric -> ICRS transformation.
* Photometry: absolute G from a dwarf/giant mixture per population; extinction 0.8 mag/kpc in a 110 pc
  dust layer; E(BP-RP) = A_G / 2. The survey keeps stars brighter than a completeness limit that falls
  from G = 21.3 to 18.9 towards the crowded Galactic centre (Gaia DR2's 99%-completeness limit), with a soft roll-off.
"""

from __future__ import annotations

import numpy as np

R_SUN_KPC = 8.122
LMC = dict(ra=80.894, dec=-69.756, distance=49.6, scale=1.5, pm=(1.91, 0.229))
SMC = dict(ra=13.187, dec=-72.829, distance=62.1, scale=0.7, pm=(0.772, -1.117))

# Fractions of catalogue stars (after the magnitude limit) per population.
POPULATIONS = {"thin_disk": 0.60, "thick_disk": 0.20, "bulge": 0.12, "halo": 0.0695, "lmc": 0.008, "smc": 0.0025}


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


def draw_true_values(rng, n_rows: int) -> tuple[dict, np.ndarray]:
    """The noise-free ra, dec, parallax, pmra, pmdec, bp_rp and G of ``n_rows`` catalogue stars, in a
    random order, and each star's population."""
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
    return true, population
