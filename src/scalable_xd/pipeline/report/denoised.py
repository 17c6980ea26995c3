"""What the denoised catalogue buys: the colour-magnitude diagram of the test stars measured, denoised and
(on a mock) true, on the same axes; the pulls of every feature against a unit Gaussian; and each feature's
posterior RMSE over its measurement's against the magnitude (``pipeline.denoise``). The diagram's features
are those playing the colour, magnitude and parallax roles in the data's spec."""

from __future__ import annotations

import numpy as np

from ...data.missing import MISSING_VARIANCE
from .style import PAGE, pyplot, save


def absolute_magnitude(magnitude, parallax_mas):
    """M = m + 5 log10(parallax / 100 mas), NaN where the parallax is not positive."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(parallax_mas > 0, magnitude + 5.0 * np.log10(parallax_mas / 100.0), np.nan)


def plot_denoised(denoised_path, calibration: dict, outputs) -> None:
    """The figure described above; without true values (Gaia data) the CMD measured and denoised only."""
    import pandas as pd
    from scipy.stats import norm

    from ..denoise import denoised_spec

    spec = denoised_spec(denoised_path)
    if spec is None or not spec.has("colour", "magnitude", "parallax"):
        raise ValueError(
            f"{denoised_path}: the colour-magnitude diagram needs features playing the colour, magnitude and "
            "parallax roles, which its spec does not give (written before roles were recorded? run `scalable-xd "
            "denoise` again)"
        )
    roles = {role: spec.feature(role) for role in ("colour", "magnitude", "parallax")}
    colour_label, magnitude_label = (spec.feature_labels[spec.index(role)] for role in ("colour", "magnitude"))
    table = pd.read_parquet(denoised_path)
    truth = calibration["available"]
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(PAGE, 0.72 * PAGE), layout="constrained")
    # each panel holds the stars it can place, which differ: its title says which
    versions = [
        ("measured", "x", "colour measured, parallax > 0"),
        ("denoised (posterior mean)", "mean", "parallax > 0"),
    ] + ([("true", "true", "parallax > 0")] if truth else [])
    cmd = {(label, why): _cmd(table, prefix, roles) for label, prefix, why in versions}
    finite = np.concatenate([np.column_stack(xy)[np.isfinite(np.column_stack(xy)).all(1)] for xy in cmd.values()])
    x_range, y_range = np.percentile(finite, [0.5, 99.5], axis=0).T  # colour's, then magnitude's
    for ax, ((label, why), (colour, mag)) in zip(axes[0], cmd.items()):
        ok = np.isfinite(colour) & np.isfinite(mag)
        ax.hist2d(colour[ok], mag[ok], bins=80, range=[x_range, y_range], cmap="Greys", norm="log")
        title = f"{label}: {ok.sum():,} of {len(table):,} stars\n(those with {why})"
        ax.set(xlim=x_range, ylim=y_range[::-1], xlabel=colour_label, title=title)
    axes[0, 0].set_ylabel(f"absolute {magnitude_label}")  # the titles say which stars have a parallax
    if not truth:
        for ax in axes[0, len(versions) :].tolist() + axes[1].tolist():
            ax.set_axis_off()
        axes[1, 0].text(0, 0.5, "no true values: pulls and gains need a mock", transform=axes[1, 0].transAxes)
        save(fig, outputs)
        return
    names = list(calibration["features"])
    shown = dict(zip(spec.names, spec.feature_labels))  # each feature as the survey labels it
    colours = dict(zip(names, plt.get_cmap("tab10").colors))  # one colour a feature in both panels
    grid = np.linspace(-5, 5, 201)
    for name in names:
        pulls = (table[f"true_{name}"] - table[f"mean_{name}"]) / table[f"sd_{name}"]
        axes[1, 0].hist(
            pulls.clip(-5, 5),
            bins=50,
            range=(-5, 5),
            density=True,
            histtype="step",
            color=colours[name],
            label=shown[name],
        )
    axes[1, 0].plot(grid, norm.pdf(grid), color="black", linestyle="dashed", label="N(0, 1)")
    axes[1, 0].set(xlabel="pull (true − mean) / sd", ylabel="density", title="pulls, every feature")
    for name in names:
        rows = calibration["features"][name].get("by_g", [])
        if rows and all(r["rmse_ratio"] is not None for r in rows):
            ratio = [r["rmse_ratio"] for r in rows]
            axes[1, 1].plot([_centre(r) for r in rows], ratio, marker="o", markersize=2, color=colours[name], zorder=3)
    axes[1, 1].axhline(1.0, color="0.6", linewidth=0.6, linestyle="dotted", zorder=1)  # under a feature at 1
    axes[1, 1].set(xlabel=magnitude_label, ylabel="RMSE posterior / measured", title="precision gain (below 1)")
    # one legend for both panels, below them, off the data
    fig.legend(*axes[1, 0].get_legend_handles_labels(), loc="outside lower center", ncols=len(names) + 1, fontsize=6)
    levels = (
        [calibration["features"][n]["coverage_68"] for n in names],
        [calibration["features"][n]["coverage_95"] for n in names],
    )
    positions = np.arange(len(names))
    axes[1, 2].bar(positions - 0.2, levels[0], width=0.4, label="in 68% interval")
    axes[1, 2].bar(positions + 0.2, levels[1], width=0.4, label="in 95% interval")
    for level in (0.68, 0.95):
        axes[1, 2].axhline(level, color="black", linewidth=0.6, linestyle="dashed")
    axes[1, 2].set_xticks(positions, [shown[name] for name in names], rotation=60, fontsize=5)
    axes[1, 2].set(ylim=(0, 1.25), yticks=np.linspace(0, 1, 6), title="coverage of the intervals")  # legend above
    axes[1, 2].set_ylabel("share of true values inside")
    axes[1, 2].legend(fontsize=5, loc="upper center", ncols=2, frameon=False)
    save(fig, outputs)


def _cmd(table, prefix: str, roles: dict):
    """(colour, absolute magnitude) of one version of the values, the features of ``roles`` (role: name);
    measured ones NaN where missing."""
    values = {}
    for role, name in roles.items():
        value = table[f"{prefix}_{name}"].to_numpy()
        if prefix == "x":  # a missing entry is stored as 0 with variance 1e12
            value = np.where(table[f"sigma_{name}"].to_numpy() ** 2 < MISSING_VARIANCE, value, np.nan)
        values[role] = value
    return values["colour"], absolute_magnitude(values["magnitude"], values["parallax"])


def _centre(row: dict) -> float:
    lo, hi = row["g_min"], row["g_max"]  # None: an open bin
    if lo is None:
        return hi - 1.0
    if hi is None:
        return lo + 0.5
    return 0.5 * (lo + hi)
