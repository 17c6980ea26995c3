"""The look every figure shares: sizes that read in a two-column paper, one font, one label and colour per
method (the same in every figure and table), and each figure written as PNG and PDF, atomically."""

from __future__ import annotations

import re

from ...files import atomic_path
from ...fit.methods import METHODS

DPI = 200
SAMPLES = 100_000  # model samples drawn for the sky and corner figures
COLUMN, PAGE = 3.5, 7.1  # inches: one column and the full width of a two-column paper
COLUMN_HEIGHT = 2.9
# Each method's label and colour; the order is the methods table's (``fit.methods``: the paper's three first).
LOOKS = {
    "em": ("Batch EM (Bovy et al. 2011)", "#1f77b4"),
    "minibatch_em": ("Minibatch EM", "#ff7f0e"),
    "sgd": ("SGD", "#2ca02c"),
    "stochastic_em": ("Stochastic EM", "#8c564b"),
    "stochastic_minibatch_em": ("Stochastic minibatch EM", "#e377c2"),
}
# A fit under a selection (fit.selection), naive or aware of it: the same colours in every figure
SELECTION_COLOURS = {"naive": "#d62728", "aware": "#17becf"}
# Methods without a look of their own and other workflow variants (fit.variants) take these in the order
# they are first drawn.
SPARE_COLOURS = ("#7f7f7f", "#bcbd22", "#393b79", "#637939", "#8c6d31", "#843c39")
DATA_COLOUR, TRUE_COLOUR = "black", "#9467bd"
RC = {
    "font.family": "DejaVu Sans",
    "font.size": 8,
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "legend.fontsize": 7,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "lines.linewidth": 1.2,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "savefig.dpi": DPI,
    "figure.dpi": DPI,
}


def legend_columns(labels: list[str], most: int, width: float = COLUMN) -> int:
    """The most columns, up to ``most``, in which a legend of ``labels`` fits across ``width`` inches,
    filled column by column as matplotlib fills them (7-point text, ~17 characters an inch, and a marker
    per column): a variant's long name takes a column of its own rather than running off the figure."""
    for ncols in range(min(most, len(labels)), 1, -1):
        rows = -(-len(labels) // ncols)
        columns = [labels[start : start + rows] for start in range(0, len(labels), rows)]
        if sum(max(map(len, column)) + 5 for column in columns) <= 17 * width:
            return ncols
    return 1


LEGEND_ROW = 0.14  # inches: one row of 7-point legend text


def legend_height(n_labels: int, ncols: int) -> float:
    """A one-column figure's height with room below the axes for a legend of ``n_labels`` in ``ncols``
    columns beyond two rows, so that the axes keep their height however many methods the legend names."""
    rows = -(-n_labels // ncols)
    return COLUMN_HEIGHT + LEGEND_ROW * max(0, rows - 2)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, with the shared style applied."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(RC)
    return plt


def save(fig, outputs) -> None:
    """Write ``fig`` to every path in ``outputs`` (format from the suffix), then close it."""
    for path in outputs:
        suffix = "." + str(path).rsplit(".", 1)[-1]
        with atomic_path(path, suffix=suffix) as tmp:
            fig.savefig(tmp, dpi=DPI, format=suffix[1:])
    pyplot().close(fig)


def method_name(method: str) -> str:
    """The method's label, or else its own name (a workflow variant's: ``fit_label`` names it)."""
    return LOOKS[method][0] if method in LOOKS else method


def fit_label(method: str, settings: dict) -> str:
    """A fit's name in the figures, tables and claims: its method's label, or for a workflow variant
    (``fit.variants``) its method's short label and what sets it apart, from the settings its metrics
    record, e.g. "Batch EM, cut to G < 20 (naive)" (the selection as ``readable_selection`` wrote it where
    the metrics hold that, else as configured)."""
    fitted_with = settings.get("method", method)
    if method in LOOKS or fitted_with not in LOOKS:  # a method, or a variant of a method without a look
        return method_name(method)
    parts = [LOOKS[fitted_with][0].split(" (")[0]]
    role = selection_role(settings)
    if role is not None:
        parts.append(f"cut to {settings.get('selection_label') or settings['selection']} ({role})")
    if (settings.get("averaging") or "none") != "none":
        parts.append(f"{settings['averaging']} averaging")
    if settings.get("split_merge"):
        parts.append("split-and-merge")
    return ", ".join(parts) if len(parts) > 1 else f"{parts[0]} ({method})"


def selection_role(settings: dict) -> str | None:
    """ "naive" or "aware" for a fit under a selection (its settings as its metrics record them), else None."""
    if not settings.get("selection"):
        return None
    return "aware" if settings.get("selection_aware", True) else "naive"


def readable_selection(expression: str, names, labels) -> str:
    """A selection's expression with each feature's name as its label reads, without the unit:
    "phot_g_mean_mag < 20" -> "G < 20" (``names`` and ``labels``: the data spec's)."""
    short = {name: label.split(" [")[0] for name, label in zip(names, labels)}
    return re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda word: short.get(word[0], word[0]), expression)


def in_paper_order(methods) -> list[str]:
    """The given method names in the methods table's order (the paper's three first), then any workflow
    variants by name."""
    present = set(methods)
    return [m for m in METHODS if m in present] + sorted(present - set(METHODS))


def colour(method: str, methods, role: str | None = None) -> str:
    """The method's colour: its own; for a fit under a selection (``role``: ``selection_role``) that role's;
    else for a variant the spare colour of its place among ``methods``."""
    if method in LOOKS:
        return LOOKS[method][1]
    if role is not None:
        return SELECTION_COLOURS[role]
    variants = [m for m in in_paper_order(methods) if m not in LOOKS]
    return SPARE_COLOURS[variants.index(method) % len(SPARE_COLOURS)]
