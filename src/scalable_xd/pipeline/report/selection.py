"""The selection experiment at a glance: the whole population, the naive model and the selection-aware one.

The training stars were cut by a limit on one feature (``fit.selection``, e.g. G < 20); the test split was
not. Left: that feature's distribution, for the test stars' true values (the population; their measured
values where the data have no truth) and for samples of each model, with the limit marked. Right: the
colour-magnitude plane beyond the limit, where only the aware model should put stars: the population's
density, and each model's 39% and 86% contours there.
"""

from __future__ import annotations

import numpy as np

from ...fit.selection import from_limits, limits
from .figures import model_samples, read_split
from .style import COLUMN, COLUMN_HEIGHT, DATA_COLOUR, SELECTION_COLOURS, pyplot, save

NAIVE_COLOUR, AWARE_COLOUR = SELECTION_COLOURS["naive"], SELECTION_COLOURS["aware"]  # as in every figure
LEVELS = (0.39, 0.86)


def plot_selection(naive_path, aware_path, data_path, spec: str, outputs, n_samples: int, seed: int) -> dict:
    """The figure of the module; returns the share of each set beyond the limit (the removed part)."""
    split = read_split(data_path)
    names, labels = list(split.spec.names), split.spec.feature_labels
    feature, operator, limit = limits(spec, names)[0]  # the figure's feature: the first clause's
    colour = split.spec.index("colour") if split.spec.has("colour") else (feature + 1) % len(names)
    population = split.true if split.true is not None else split.X[split.n_missing == 0]
    naive_samples = model_samples(naive_path, n_samples, seed)[1]
    aware, aware_samples = model_samples(aware_path, n_samples, seed)
    sets = {"population": population, "naive": naive_samples, "aware": aware_samples}
    selection = from_limits(spec, names)
    faint = {name: values[selection.kept(values) == 0] for name, values in sets.items()}  # beyond the limits
    beyond = {name: len(faint[name]) / len(values) for name, values in sets.items()}
    lo, hi = np.percentile(population[:, feature], [0.5, 99.5])
    bins = np.linspace(lo, hi, 60)
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(2 * COLUMN, 1.2 * COLUMN_HEIGHT))
    truth_label = "test stars' true values" if split.true is not None else "test stars (measured)"
    left.hist(population[:, feature], bins=bins, density=True, color=DATA_COLOUR, alpha=0.5, label=truth_label)
    for name, tint in (("naive", NAIVE_COLOUR), ("aware", AWARE_COLOUR)):
        label = f"{name} model: {100 * beyond[name]:.0f}% beyond the limit"
        left.hist(sets[name][:, feature], bins=bins, density=True, histtype="step", color=tint, lw=1.5, label=label)
    left.axvline(limit, color="k", ls="--", lw=1)
    left.set_xlabel(labels[feature])
    left.set_ylabel("density")
    left.set_title(f"{100 * (1 - beyond['population']):.0f}% of the population is within the limit", fontsize=8)
    left.set_ylim(top=1.35 * left.get_ylim()[1])  # room for the legend above the histograms
    left.legend(fontsize=7, frameon=False, loc="upper left")
    x_range = np.percentile(population[:, colour], [1, 99])
    y_range = (limit, hi) if operator.startswith("<") else (lo, limit)
    right.hist2d(
        faint["population"][:, colour], faint["population"][:, feature], bins=30, range=[x_range, y_range], cmap="Greys"
    )
    for name, tint in (("naive", NAIVE_COLOUR), ("aware", AWARE_COLOUR)):
        if len(faint[name]) > 50:
            _contours(right, faint[name][:, colour], faint[name][:, feature], x_range, y_range, tint)
    right.set_xlabel(labels[colour])
    right.set_ylabel(labels[feature])
    right.set_title("beyond it: population, model contours (39%, 86%)", fontsize=8)
    if split.spec.has("magnitude") and feature == split.spec.index("magnitude"):
        right.invert_yaxis()  # brighter up, as magnitudes are drawn
    k = aware.n_components
    fig.suptitle(f"Training stars cut to {spec}: the naive and the selection-aware fit, K = {k}", fontsize=9)
    fig.tight_layout()
    save(fig, outputs)
    return beyond


def _contours(ax, x, y, x_range, y_range, tint) -> None:
    """Lines holding LEVELS of the points' mass, from a smoothed 2-D histogram."""
    from scipy.ndimage import gaussian_filter

    counts, xe, ye = np.histogram2d(x, y, bins=30, range=[x_range, y_range])
    counts = gaussian_filter(counts, 1.0)  # sampling noise smoothed: contours of the density, not of the draws
    ordered = np.sort(counts.ravel())[::-1]
    cumulative = np.cumsum(ordered) / max(ordered.sum(), 1)
    heights = sorted({float(ordered[np.searchsorted(cumulative, level)]) for level in LEVELS})
    centres = (xe[:-1] + xe[1:]) / 2, (ye[:-1] + ye[1:]) / 2
    if len(heights) and max(heights) > 0:
        ax.contour(*centres, counts.T, levels=[h for h in heights if h > 0], colors=tint, linewidths=1.2)
