"""Figure 2: the density of stars on the sky, data beside model samples, as astronomers draw it.

Counts go into HEALPix pixels (``healpy``), are divided by the pixel area, and are shown in an equal-area
Mollweide projection, so that a colour means the same number of stars per square degree at the poles as
at the equator. Data and model share one logarithmic colour scale: the model's samples are scaled to the
number of data stars, so the two maps are directly comparable. The resolution follows the data: the
finest HEALPix grid on which at most ``MAX_EMPTY`` of the pixels hold no data star, so that the sparse
halo is not salt and pepper. Empty pixels are grey, not the colour of low density.
"""

from __future__ import annotations

import numpy as np

from .metrics import fit_name
from .style import PAGE, SAMPLES, pyplot, save

MAX_EMPTY = 0.05
EMPTY = "0.85"  # light grey


def resolution(lon_deg, lat_deg, max_empty: float = MAX_EMPTY) -> int:
    """The finest HEALPix nside (a power of two, 2 to 256) on which at most ``max_empty`` of the pixels
    hold none of the given points."""
    import healpy as hp

    for nside in (256, 128, 64, 32, 16, 8, 4):
        counts = np.bincount(hp.ang2pix(nside, lon_deg, lat_deg, lonlat=True), minlength=hp.nside2npix(nside))
        if np.mean(counts == 0) <= max_empty:
            return nside
    return 2


def density_map(lon_deg, lat_deg, nside: int, scale: float = 1.0) -> np.ndarray:
    """Points per square degree in each HEALPix pixel (RING order), times ``scale``: summed over the pixels
    and multiplied by the pixel area, ``scale`` times the number of points."""
    import healpy as hp

    pixels = hp.ang2pix(nside, np.asarray(lon_deg), np.asarray(lat_deg), lonlat=True)
    counts = np.bincount(pixels, minlength=hp.nside2npix(nside)).astype(float)
    return scale * counts / hp.nside2pixarea(nside, degrees=True)


def to_galactic(ra_deg, dec_deg):
    """(l, b) in degrees of ICRS (ra, dec), through astropy."""
    import astropy.units as u
    from astropy.coordinates import SkyCoord

    galactic = SkyCoord(ra=np.asarray(ra_deg) * u.deg, dec=np.asarray(dec_deg) * u.deg, frame="icrs").galactic
    return galactic.l.deg, galactic.b.deg


def _label_graticule(hp, ax, lon: str) -> None:
    """Longitudes along the equator, latitudes along the left edge, and which way is east (left: the sky
    as seen from inside, as astronomers draw it)."""
    from matplotlib import patheffects

    style = dict(
        lonlat=True, fontsize=5, color="0.1", path_effects=[patheffects.withStroke(linewidth=1.5, foreground="w")]
    )
    for degrees in (0, 60, 120, 240, 300):
        hp.projtext(degrees, 2.0, f"{degrees}°", ha="center", va="bottom", **style)
    for degrees in (-60, -30, 30, 60):
        label = f"{degrees:+d}° ".replace("-", "\N{MINUS SIGN}")  # a minus sign, not a hyphen
        hp.projtext(179.0, degrees, label, ha="right", va="center", **style)
    ax.text(0.0, 1.0, f"← east ({lon} grows)", transform=ax.transAxes, fontsize=5, color="0.3", va="bottom")


def plot_sky_density(
    model_path, data_path, outputs, n_samples: int = SAMPLES, seed: int = 0, frame: str = "icrs", metrics_path=None
) -> dict:
    """Mollweide maps of the data's and the model samples' stars per square degree (Figure 2), in ``frame``
    ``"icrs"`` (ra, dec) or ``"galactic"`` (l, b). A Gaussian does not know that ra is periodic or that
    |dec| <= 90: samples' ra are taken modulo 360 (a component near ra = 0 spills across it, as the data
    do), and samples beyond the poles are left out and their fraction stated. The model is named as its
    metrics (``metrics_path``) name its fit where given (``metrics.fit_name``). Returns the maps, their
    scale and the panels' titles."""
    import healpy as hp
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LogNorm

    from .figures import data_rows, model_samples, read_split

    if frame not in ("icrs", "galactic"):
        raise ValueError(f"unknown frame {frame!r}: choose icrs or galactic")
    model, samples = model_samples(model_path, n_samples, seed)
    data = read_split(data_path)
    ra, dec = data.spec.index("ra"), data.spec.index("dec")  # the features playing them (a clear error if none)
    stars = data_rows(data, n_samples, seed, complete=False)  # ra and dec are never missing
    on_sky = np.abs(samples[:, dec]) <= 90
    wrapped = np.column_stack([np.mod(samples[on_sky, ra], 360.0), samples[on_sky, dec]])  # ra is periodic
    points = {"data": stars[:, [ra, dec]], "model": wrapped}
    if frame == "galactic":
        points = {name: np.column_stack(to_galactic(p[:, 0], p[:, 1])) for name, p in points.items()}
    nside = resolution(points["data"][:, 0], points["data"][:, 1])
    maps = {
        "data": density_map(points["data"][:, 0], points["data"][:, 1], nside),
        "model": density_map(points["model"][:, 0], points["model"][:, 1], nside, scale=len(stars) / len(samples)),
    }
    positive = np.concatenate([m[m > 0] for m in maps.values()])
    vmin, vmax = positive.min(), positive.max()
    plt = pyplot()
    fig = plt.figure(figsize=(PAGE, 0.46 * PAGE))
    axis = "l, b (Galactic)" if frame == "galactic" else "ra, dec (ICRS)"
    name = fit_name(model.method, metrics_path)
    titles = {
        "data": f"data: {len(stars):,} stars",
        "model": f"model: {len(samples):,} samples of the K = {model.n_components} {name}\n"
        f"fit, scaled to the data ({100 * (1 - on_sky.mean()):.1f}% off the sky, not shown)",
    }
    seam = "The model's density has a seam at ra = 0°/360°" + (", a curve in l, b" if frame == "galactic" else "")
    seam += ": a Gaussian mixture in ra cannot wrap around."
    cmap = plt.get_cmap("magma").with_extremes(bad=EMPTY, under=EMPTY)
    for i, name in enumerate(("data", "model")):
        shown = np.where(maps[name] > 0, maps[name], hp.UNSEEN)
        hp.mollview(
            shown,
            fig=fig.number,
            sub=(1, 2, i + 1),
            title=titles[name],
            norm="log",
            min=vmin,
            max=vmax,
            cmap=cmap,
            flip="astro",
            cbar=False,
            badcolor=EMPTY,
            hold=False,
            margins=(0.01, 0.2, 0.01, 0.1),
        )
        hp.graticule(dpar=30, dmer=60, alpha=0.3)
        _label_graticule(hp, plt.gca(), "l" if frame == "galactic" else "ra")
    for ax in fig.axes:
        ax.title.set_fontsize(8)
    norm = LogNorm(vmin=vmin, vmax=vmax)
    bar = fig.colorbar(
        ScalarMappable(norm=norm, cmap=cmap), cax=fig.add_axes((0.3, 0.2, 0.4, 0.035)), orientation="horizontal"
    )
    bar.set_label("stars per square degree (grey: none)")
    fig.text(0.5, 0.01, seam, ha="center", va="bottom", fontsize=6, color="0.3")
    fig.suptitle(
        f"Equal-area Mollweide projection in {axis}; HEALPix nside {nside} "
        f"({hp.nside2pixarea(nside, degrees=True):.0f} sq. deg pixels)",
        fontsize=8,
        y=0.97,
    )
    save(fig, outputs)
    return {"maps": maps, "nside": nside, "norm": norm, "on_sky": float(on_sky.mean()), "titles": titles}
