"""The paper's figures: training time against K, training curves, the sky density, and corner plots.

Every function writes each of its ``outputs`` (e.g. a .png and a .pdf) atomically, at a fixed size so that
the images are comparable run to run: ``FIGSIZE`` inches at ``DPI``.
"""

from __future__ import annotations


import numpy as np

from ..io import atomic_path
from .metrics import FitMetrics, metrics_frame
from .tables import METHOD_NAMES, METHOD_ORDER

DPI = 100
FIGSIZE = {"timing": (7.0, 4.5), "curves": (7.0, 4.5), "sky": (12.0, 4.5)}
COLOURS = {"em": "tab:blue", "minibatch_em": "tab:orange", "sgd": "tab:green"}
FEATURE_LABELS = ["ra [deg]", "dec [deg]", "parallax [mas]", "pmra [mas/yr]", "pmdec [mas/yr]", "BP-RP [mag]", "G [mag]"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, outputs) -> None:
    for path in outputs:
        suffix = "." + str(path).rsplit(".", 1)[-1]
        with atomic_path(path, suffix=suffix) as tmp:
            fig.savefig(tmp, dpi=DPI, format=suffix[1:])
    _pyplot().close(fig)


def _in_paper_order(methods) -> list[str]:
    """The given method names in the paper's order (EM, minibatch EM, SGD)."""
    present = set(methods)
    return [m for m in METHOD_ORDER if m in present]


def plot_timing_vs_k(metrics_paths, outputs) -> None:
    """Training time (s) against K per method, mean over seeds with +-2 standard deviations (Figure 1 right)."""
    plt = _pyplot()
    frame = metrics_frame(metrics_paths)
    fig, ax = plt.subplots(figsize=FIGSIZE["timing"])
    for method in _in_paper_order(frame.method):
        stats = frame[frame.method == method].groupby("K")["train_seconds"].agg(["mean", "std"]).fillna(0.0)
        ax.errorbar(stats.index, stats["mean"], yerr=2 * stats["std"], marker="o", capsize=4,
                    color=COLOURS.get(method), label=METHOD_NAMES.get(method, method))  # fmt: skip
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ks = sorted(frame.K.unique())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())  # plain seconds, not powers of ten
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("mixture components K")
    ax.set_ylabel("training time [s]")
    ax.set_title("Training time against K (error bars: ±2 sd over seeds)")
    ax.legend()
    fig.tight_layout()
    _save(fig, outputs)


def plot_training_curves(metrics_paths, outputs, n_components: int) -> None:
    """Mean training log-likelihood against epoch rescaled by the mean training time (Figure 1 left)."""
    plt = _pyplot()
    curves = {}
    for path in metrics_paths:
        m = FitMetrics.read(path)
        if m.n_components == n_components:
            curves.setdefault(m.method, []).append(m.history)
    if not curves:
        raise ValueError(f"no metrics for K = {n_components}")
    fig, ax = plt.subplots(figsize=FIGSIZE["curves"])
    for method in _in_paper_order(curves):
        runs = curves[method]
        length = min(len(h) for h in runs)  # batch EM may stop early at its tolerance
        loglik = np.array([[e["train_loglik"] for e in h[:length]] for h in runs])
        seconds = np.array([[e["seconds"] for e in h[:length]] for h in runs]).mean(axis=0)
        mean, sd = loglik.mean(axis=0), loglik.std(axis=0)
        ax.plot(seconds, mean, marker=".", color=COLOURS.get(method), label=f"{METHOD_NAMES.get(method, method)} ({len(runs)} seeds)")
        ax.fill_between(seconds, mean - sd, mean + sd, color=COLOURS.get(method), alpha=0.25)
    ax.set_xlabel("training time [s] (epochs rescaled by the mean time per epoch)")
    ax.set_ylabel("mean training log-likelihood per star")
    ax.set_title(f"Training curves, K = {n_components} (band: ±1 sd over seeds)")
    ax.legend()
    fig.tight_layout()
    _save(fig, outputs)


def _model_samples(model_path, n_samples: int, seed: int):
    from ..estimator import XDGMM

    model = XDGMM.load(model_path, device="cpu")
    return model, model.sample(n_samples, random_state=seed)


def _subsample(X, n_rows: int, seed: int):
    if len(X) > n_rows:
        X = X[np.random.default_rng(seed).choice(len(X), n_rows, replace=False)]
    return X


def _read_split(data_path):
    from ..gaia.storage import read_features

    return read_features(data_path)


def _data_rows(data, n_rows: int, seed: int, complete: bool):
    """Up to ``n_rows`` feature rows of a split; ``complete`` keeps only stars with every feature measured."""
    return _subsample(data.X[data.n_missing == 0] if complete else data.X, n_rows, seed)


def _true_rows(data, n_rows: int, seed: int):
    """Up to ``n_rows`` noise-free rows of a split (all its stars), or None for data without truth."""
    return None if data.true is None else _subsample(data.true, n_rows, seed)


def plot_sky_density(model_path, data_path, outputs, n_samples: int = 100_000, seed: int = 0) -> None:
    """Density of model samples on the sky (ra, dec) beside the same plot for the data (Figure 2).

    Both panels show the fraction of their points per 2 x 2 degree pixel on one colour scale. Samples that
    fall off the sky (the Gaussians do not know that |dec| <= 90 or that ra is periodic) are left out, and
    their fraction is stated.
    """
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    model, samples = _model_samples(model_path, n_samples, seed)
    on_sky = (samples[:, 0] >= 0) & (samples[:, 0] < 360) & (np.abs(samples[:, 1]) <= 90)
    stars = _data_rows(_read_split(data_path), n_samples, seed, complete=False)  # ra and dec are never missing
    ra_bins, dec_bins = np.linspace(0, 360, 181), np.linspace(-90, 90, 91)
    densities = [np.histogram2d(points[:, 0], points[:, 1], [ra_bins, dec_bins])[0].T / len(points)
                 for points in (samples[on_sky], stars)]  # fmt: skip
    positive = np.concatenate([d[d > 0] for d in densities])
    norm = LogNorm(vmin=positive.min(), vmax=positive.max())
    name = METHOD_NAMES.get(model.method, model.method)
    titles = [f"{len(samples):,} samples of the K = {model.n_components} {name} model "
              f"({100 * (1 - on_sky.mean()):.1f}% off the sky, not shown)",
              f"{len(stars):,} stars of the data"]  # fmt: skip
    fig, axes = plt.subplots(1, 2, figsize=FIGSIZE["sky"], sharey=True, layout="constrained")
    for ax, density, title in zip(axes, densities, titles):
        mesh = ax.pcolormesh(ra_bins, dec_bins, np.where(density > 0, density, np.nan), norm=norm, cmap="magma")
        ax.set_xlim(360, 0)  # east to the left, as on the sky
        ax.set_xlabel("ra [deg]")
        ax.set_title(title, fontsize=10)
    axes[0].set_ylabel("dec [deg]")
    fig.colorbar(mesh, ax=axes, label="fraction of points per 2 x 2 deg pixel")
    _save(fig, outputs)


TRUE_COLOUR = "tab:purple"


def plot_corner(model_path, data_path, outputs, n_samples: int = 100_000, seed: int = 0) -> None:
    """Corner plot of deconvolved model samples (colour) over the noisy data (black), all seven features,
    and, where the data know them (a mock), the true values (purple, dashed): the model should follow the
    true values, narrower than the data wherever the noise matters."""
    import corner

    model, samples = _model_samples(model_path, n_samples, seed)
    data = _read_split(data_path)
    observed = _data_rows(data, n_samples, seed, complete=True)  # x = 0 stands for "missing": leave out
    true = _true_rows(data, n_samples, seed)
    ranges = [tuple(np.percentile(observed[:, k], [0.5, 99.5])) for k in range(observed.shape[1])]
    style = dict(range=ranges, bins=40, plot_datapoints=False, plot_density=False, levels=(0.39, 0.86))
    fig = corner.corner(observed, labels=FEATURE_LABELS, color="black", hist_kwargs={"density": True}, **style)
    corner.corner(samples, fig=fig, color=COLOURS.get(model.method, "tab:red"), hist_kwargs={"density": True}, **style)
    layers = "model samples (colour) over the data (black)"
    if true is not None:
        corner.corner(true, fig=fig, color=TRUE_COLOUR, contour_kwargs={"linestyles": "dashed"},
                      hist_kwargs={"density": True, "linestyle": "dashed"}, **style)  # fmt: skip
        layers += " and the true values (purple, dashed)"
    fig.set_size_inches(12, 12)
    fig.suptitle(f"{METHOD_NAMES.get(model.method, model.method)}, K = {model.n_components}: {layers}, "
                 "1 and 2 sigma contours", fontsize=12)  # fmt: skip
    _save(fig, outputs)
