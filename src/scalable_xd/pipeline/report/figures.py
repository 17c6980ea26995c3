"""Figure 1 (training time against K, training curves) and the corner plots; Figure 2 is ``sky``.

Each function writes its ``outputs`` (PNG and PDF) in the shared style (``style``) and returns what it drew
(axis ranges, error bars), so that tests check a figure's content rather than its pixels.
"""

from __future__ import annotations

import numpy as np

from .metrics import FitMetrics, fit_name, metrics_frame
from .style import (
    COLUMN,
    DATA_COLOUR,
    LOOKS,
    PAGE,
    SAMPLES,
    SELECTION_COLOURS,
    TRUE_COLOUR,
    colour,
    fit_label,
    in_paper_order,
    legend_columns,
    legend_height,
    pyplot,
    save,
    selection_role,
)

CONTOUR_LEVELS = (0.39, 0.86)  # the mass inside 1 and 2 sigma of a 2-D Gaussian
LAST_EPOCHS = 10  # the training curves' y axis spans these last epochs of every method


def _plain_ticks(axis) -> None:
    """Tick labels as plain numbers ("200", "1.5"), not "200.0" or powers of ten."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def _log_subs(limits) -> tuple[float, ...]:
    """Where a log axis over ``limits`` gets labelled ticks in each decade: densely over a narrow range,
    so that at least three values can be read (1 to 5 s is labelled 1, 1.5, 2, 3, 5, not 1 and 2)."""
    decades = np.log10(limits[1] / limits[0])
    if decades < 1.5:
        return (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
    return (1.0, 2.0, 5.0) if decades < 3 else (1.0,)


def _run_note(frame) -> str:
    """Where the timings were taken: the devices and thread counts recorded in the metrics."""
    devices = ", ".join(sorted(frame.device.astype(str).unique()))
    threads = sorted({int(t) for t in frame.threads.dropna()}) if "threads" in frame else []
    return f"{devices}, {'/'.join(map(str, threads))} threads" if threads else f"{devices}, threads not recorded"


def plot_timing_vs_k(metrics_paths, outputs) -> dict:
    """Training time against K per method (Figure 1 right), each fit at its median epoch's pace
    (``metrics.steady_seconds``, robust to bursts of load): the geometric mean over the seeds timed alone,
    with error bars of one geometric standard deviation (the spread of log time), which stay positive on
    the log axis. Seeds fitted in lockstep with others (``timed_by``) carry another seed's pace, not a time
    of their own, and are left out: each point is what one fit costs, whatever shared the machine."""
    plt = pyplot()
    frame = metrics_frame(metrics_paths)
    timed = frame[frame.timed_alone] if "timed_alone" in frame else frame
    names, roles = dict(zip(frame.method, frame.label)), dict(zip(frame.method, frame.selection_role))
    for method in set(timed.method):  # where seeds ran in lockstep, the bars cover fewer seeds: say how many
        counts = [timed[timed.method == method].groupby("K").size().min(), frame[frame.method == method].seed.nunique()]
        if counts[0] < counts[1]:
            names[method] += f" (timed: {counts[0]} of {counts[1]} seeds)"
    labels = [names[method] for method in in_paper_order(timed.method)]
    ncols = legend_columns(labels, 2)
    fig, ax = plt.subplots(figsize=(COLUMN, legend_height(len(labels), ncols)), layout="constrained")
    drawn = {}
    for method in in_paper_order(timed.method):
        rows = timed[timed.method == method]
        log_t = np.log(rows.steady_seconds).groupby(rows.K).agg(["mean", "std"]).fillna(0.0)
        centre, spread = np.exp(log_t["mean"].to_numpy()), np.exp(log_t["std"].to_numpy())
        low, high = centre / spread, centre * spread
        line, _, _ = ax.errorbar(
            log_t.index,
            centre,
            yerr=[centre - low, high - centre],
            marker="o",
            markersize=3,
            capsize=3,
            color=colour(method, frame.method, roles[method]),
            label=names[method],
        )
        drawn[method] = {
            "K": list(log_t.index),
            "centre": centre,
            "low": low,
            "high": high,
            "colour": line.get_color(),
            "label": names[method],
        }
    ks = sorted(frame.K.unique())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ks, [str(k) for k in ks])
    from matplotlib.ticker import LogLocator

    ax.yaxis.set_major_locator(LogLocator(subs=_log_subs(ax.get_ylim())))
    _plain_ticks(ax.yaxis)
    ax.set_xlabel("mixture components K")
    ax.set_ylabel("training time [s], median epoch x epochs")
    ax.set_title(f"Training time ({_run_note(frame)})\nbars: geometric sd over the seeds timed alone")
    fig.legend(loc="outside lower center", ncols=ncols, frameon=False)
    save(fig, outputs)
    return drawn


def plot_training_curves(metrics_paths, outputs, n_components: int) -> dict:
    """Mean training log-likelihood against epoch rescaled by the mean training time (Figure 1 left), with a
    band of one standard deviation over seeds. The y axis spans the last ``LAST_EPOCHS`` epochs of every
    method (earlier epochs and the k-means start, far below, run off the bottom and are stated), so that the
    end-state differences between methods, the point of the figure, and the bands are visible. Fits under a
    selection (a workflow's cut variants) score other stars, on another scale: they are drawn only where
    every fit has one."""
    plt = pyplot()
    curves: dict = {}
    cut: dict = {}
    names: dict = {}
    roles: dict = {}
    for path in metrics_paths:
        m = FitMetrics.read(path)
        if m.n_components == n_components:
            (cut if m.settings.get("selection") else curves).setdefault(m.method, []).append(m.history)
            names[m.method], roles[m.method] = fit_label(m.method, m.settings), selection_role(m.settings)
    curves = curves or cut
    if not curves:
        raise ValueError(f"no metrics for K = {n_components}")
    labels = [names[method] for method in in_paper_order(curves)]
    ncols = legend_columns(labels, 3)
    fig, ax = plt.subplots(figsize=(COLUMN, legend_height(len(labels), ncols)), layout="constrained")
    shown, start = [], []
    for method in in_paper_order(curves):
        runs = curves[method]
        length = min(len(h) for h in runs)  # batch EM may stop early at its tolerance
        loglik = np.array([[e["train_loglik"] for e in h[:length]] for h in runs])
        seconds = np.array([[e["seconds"] for e in h[:length]] for h in runs]).mean(axis=0)
        mean, sd = loglik.mean(axis=0), loglik.std(axis=0)
        tint = colour(method, curves, roles[method])
        ax.plot(seconds, mean, marker=".", markersize=3, color=tint, label=names[method])
        ax.fill_between(seconds, mean - sd, mean + sd, color=tint, alpha=0.3, linewidth=0)
        last = slice(max(1, length - LAST_EPOCHS), length) if length > 1 else slice(0, 1)
        shown.append(np.concatenate([(mean - sd)[last], (mean + sd)[last]]))
        start.append(mean[0])
    low, high = min(v.min() for v in shown), max(v.max() for v in shown)
    pad = 0.05 * (high - low or 1.0)
    ax.set_ylim(low - pad, high + pad)
    ax.set_xlabel("training time [s] (epochs rescaled)")
    ax.set_ylabel("training log-likelihood [nats per star]")
    seeds = sorted({len(runs) for runs in curves.values()})
    ax.set_title(
        f"Training curves, K = {n_components}: mean ± 1 sd over {'/'.join(map(str, seeds))} seeds\n"
        f"y axis: the last {LAST_EPOCHS} epochs (k-means start: {np.mean(start):.1f})"
    )
    fig.legend(loc="outside lower center", ncols=ncols, frameon=False)  # below the axes
    save(fig, outputs)
    return {"ylim": ax.get_ylim(), "methods": list(curves), "labels": labels}


def model_samples(model_path, n_samples: int, seed: int):
    from ...estimator import XDGMM

    model = XDGMM.load(model_path, device="cpu")
    return model, model.sample(n_samples, random_state=seed)[0]


def _subsample(X, n_rows: int, seed: int):
    if len(X) > n_rows:
        X = X[np.random.default_rng(seed).choice(len(X), n_rows, replace=False)]
    return X


def read_split(data_path):
    from ..features_file import read_features

    return read_features(data_path)


def data_rows(data, n_rows: int, seed: int, complete: bool):
    """Up to ``n_rows`` feature rows of a split; ``complete`` keeps only stars with every feature measured."""
    return _subsample(data.X[data.n_missing == 0] if complete else data.X, n_rows, seed)


def _fit_histograms(fig, n_features: int) -> None:
    """Each 1-D panel's y axis up to its tallest histogram: corner sets it from the first set drawn, which
    clips a taller model or true-value histogram drawn over it."""
    for i in range(n_features):
        ax = fig.axes[i * n_features + i]
        tops = [patch.get_path().vertices[:, 1].max() for patch in ax.patches]
        if tops:
            ax.set_ylim(0, 1.1 * max(tops))


def _beyond_note(spec, outside: dict) -> str:
    """The share of model samples beyond the panels: in the magnitude (past the survey's limits), where a
    feature plays that role, and at most in any feature."""
    most = f"{100 * max(outside.values()):.1f}% at most in any feature"
    if not spec.has("magnitude"):
        return most
    label = spec.feature_labels[spec.index("magnitude")]
    return f"{100 * outside[label]:.1f}% in {label.split(' [')[0]} (past the survey's limits), {most}"


def plot_corner(model_path, data_path, outputs, n_samples: int = SAMPLES, seed: int = 0, metrics_path=None) -> dict:
    """Corner plot of the deconvolved model's samples over the noisy data and, where the data know them (a
    mock), the true values: every feature, 1-D histograms normalised to unit area, contours holding 39% and
    86% of each set (1 and 2 sigma of a 2-D Gaussian). Each panel spans the 0.5-99.5 percentiles of the data;
    the share of model samples beyond them is stated (for the magnitude, where a feature plays that role,
    beyond the survey's faint limit). Each feature is labelled as the data's spec labels it. The title names
    the fit as its metrics (``metrics_path``) do where given (a workflow variant by what sets it apart),
    else by the model's method."""
    import corner
    from matplotlib.lines import Line2D

    model, samples = model_samples(model_path, n_samples, seed)
    data = read_split(data_path)
    observed = data_rows(data, n_samples, seed, complete=True)  # x = 0 stands for "missing": leave out
    true = None if data.true is None else _subsample(data.true, n_samples, seed)
    ranges = [tuple(np.percentile(observed[:, k], [0.5, 99.5])) for k in range(observed.shape[1])]
    style = dict(
        range=ranges,
        bins=40,
        plot_datapoints=False,
        plot_density=False,
        levels=CONTOUR_LEVELS,
        label_kwargs={"fontsize": 8},
        max_n_ticks=3,  # five ticks a panel crowd each other at print size
    )
    role = None if metrics_path is None else selection_role(FitMetrics.read(metrics_path).settings)
    colour = SELECTION_COLOURS[role] if role else LOOKS[model.method][1] if model.method in LOOKS else "tab:red"
    plt = pyplot()
    fig = plt.figure(figsize=(PAGE, PAGE))
    labels = data.spec.feature_labels
    corner.corner(observed, fig=fig, labels=labels, color=DATA_COLOUR, hist_kwargs={"density": True}, **style)
    corner.corner(samples, fig=fig, color=colour, hist_kwargs={"density": True}, **style)
    handles = [
        Line2D([], [], color=DATA_COLOUR, label=f"data: {len(observed):,} stars with every feature measured"),
        Line2D([], [], color=colour, label=f"model: {len(samples):,} samples"),
    ]
    if true is not None:
        corner.corner(
            true,
            fig=fig,
            color=TRUE_COLOUR,
            contour_kwargs={"linestyles": "dashed"},
            hist_kwargs={"density": True, "linestyle": "dashed"},
            **style,
        )
        handles.append(Line2D([], [], color=TRUE_COLOUR, linestyle="dashed", label=f"true values: {len(true):,} stars"))
    outside = {
        label: float(np.mean((samples[:, k] < lo) | (samples[:, k] > hi)))
        for k, (label, (lo, hi)) in enumerate(zip(labels, ranges, strict=True))
    }
    _fit_histograms(fig, observed.shape[1])
    for ax in fig.axes:
        ax.tick_params(labelsize=6)
    fig.subplots_adjust(top=0.98, left=0.08, bottom=0.07, right=0.98)
    # the legend and notes sit in the empty upper-right triangle, clear of every panel
    title = f"{fit_name(model.method, metrics_path)}, K = {model.n_components}"
    fig.text(0.97, 0.975, title, ha="right", va="top", fontsize=10)
    fig.legend(handles=handles, loc="upper right", bbox_to_anchor=(0.97, 0.945), frameon=False, fontsize=7)
    fig.text(
        0.97,
        0.83,
        "1-D histograms: normalised to unit area\n"
        "contours: 39% and 86% of each set (1 and 2 sigma in 2-D)\n"
        "panels: the data's 0.5-99.5 percentiles; model samples beyond them:\n" + _beyond_note(data.spec, outside),
        ha="right",
        va="top",
        fontsize=7,
        linespacing=1.4,
    )
    save(fig, outputs)
    return {"legend": [h.get_label() for h in handles], "outside": outside, "title": title, "colour": colour}
