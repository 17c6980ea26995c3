"""The paper's grid over seeds, as its Table 1 and Figure 1 report it, from one CSV row per fit.

A run of the grid (``workflow/scripts/long_run.py`` on a shared CPU, or any run of the workflow) keeps its
fits as CSV files that one code path reads whatever machine made them: ``FIT_COLUMNS``, one row per
(method, K, seed), ``CURVE_COLUMNS``, one row per fit and epoch, and ``DIVERGED_COLUMNS``, one row per fit
that diverged. From them: the table of mean ± sd over
the seeds beside the paper's Table 1 (Ritchie & Murray 2019), a paired comparison over the seeds for each
ordering the paper reports, and both panels of Figure 1.

Time is each fit's training CPU seconds (process time over all threads, evaluation excluded): a fit on a
shared machine waits longer but computes about as much, so this moves far less than the wall clock with
what else runs (``docs/reproducing.md`` states by how much).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...files import atomic_path
from .metrics import FitMetrics, metrics_frame
from .style import COLUMN, PAGE, colour, in_paper_order, method_name, pyplot, save

KEY = ["method", "K", "seed"]
FIT_COLUMNS = [
    *KEY,
    "n_train",
    "n_iter",
    "val",
    "test",
    "val_observed",
    "test_observed",
    "true_test",
    "train",
    "train_seconds",
    "train_cpu_seconds",
    "wall_seconds",
    "cpu_seconds",
    "machine_load",
    "threads",
    "dead_components",
    "device",
]
CURVE_COLUMNS = [*KEY, "epoch", "seconds", "cpu_seconds", "train_loglik", "val_loglik"]
# A fit that diverged (``FitDivergedError``) is an outcome of its method and seed, kept beside the fits.
DIVERGED_COLUMNS = [*KEY, "epoch", "message"]

# Ritchie & Murray (2019), Table 1: validation log-likelihood, mean and sd over ten runs on the Gaia DR2
# subset, and the test log-likelihood at K = 512 (each method's best K by validation).
PAPER_TABLE = {
    ("em", 64): (-26.10, 0.03),
    ("em", 128): (-25.96, 0.04),
    ("em", 256): (-25.76, 0.02),
    ("em", 512): (-25.67, 0.01),
    ("minibatch_em", 64): (-26.05, 0.01),
    ("minibatch_em", 128): (-25.91, 0.01),
    ("minibatch_em", 256): (-25.83, 0.00),
    ("minibatch_em", 512): (-25.80, 0.00),
    ("sgd", 64): (-25.89, 0.02),
    ("sgd", 128): (-25.77, 0.02),
    ("sgd", 256): (-25.67, 0.02),
    ("sgd", 512): (-25.59, 0.02),
}
PAPER_TEST = {"em": (-25.66, 0.01), "minibatch_em": (-25.79, 0.00), "sgd": (-25.57, 0.02)}


def fit_rows(metrics_paths) -> pd.DataFrame:
    """``FIT_COLUMNS`` of each fit's metrics file."""
    return metrics_frame(metrics_paths)[FIT_COLUMNS]


def curve_rows(metrics_paths) -> pd.DataFrame:
    """``CURVE_COLUMNS``: each fit's history, epoch by epoch."""
    rows = []
    for path in metrics_paths:
        m = FitMetrics.read(path)
        for entry in m.history:
            rows.append(
                {
                    "method": m.method,
                    "K": m.n_components,
                    "seed": m.seed,
                    **{key: entry.get(key) for key in CURVE_COLUMNS[3:]},
                }
            )
    return pd.DataFrame(rows, columns=CURVE_COLUMNS)


def read_rows(path, columns: list[str]) -> pd.DataFrame:
    """A grid CSV, or an empty frame where there is none yet; a file without ``columns`` is refused by name."""
    try:
        frame = pd.read_csv(path)
    except FileNotFoundError:
        return pd.DataFrame(columns=columns)
    missing = [c for c in columns if c not in frame]
    if missing:
        raise ValueError(f"{path} is not a grid CSV of this version: it has no column {missing}")
    return frame[columns]


def merge_rows(path, new: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """``new`` rows written into the CSV at ``path`` atomically, replacing its rows of the same fits; sorted
    by method, K, seed (and epoch), so that the file's diff shows only what changed."""
    old = read_rows(path, columns)
    fits = set(map(tuple, new[KEY].to_numpy().tolist()))
    kept = old[[key not in fits for key in map(tuple, old[KEY].to_numpy().tolist())]]
    merged = pd.concat([frame for frame in (kept, new[columns]) if len(frame)], ignore_index=True)
    merged = merged.sort_values([c for c in (*KEY, "epoch") if c in columns], ignore_index=True)
    with atomic_path(path) as tmp:
        merged.to_csv(tmp, index=False, float_format="%.10g")
    return merged


def cell_table(fits: pd.DataFrame, diverged: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per (method, K): mean and sd over the seeds of each score, the training CPU seconds and the dead
    components, the number of seeds that finished (``seeds``) and of those that diverged (``diverged``)."""
    stats = ["val", "test", "true_test", "train_cpu_seconds", "train_seconds", "dead_components", "machine_load"]
    grouped = fits.groupby(["method", "K"])
    table = grouped[stats].agg(["mean", "std"])
    table.columns = [f"{name}_{agg}" for name, agg in table.columns]
    table["seeds"] = grouped.size()
    lost = (diverged if diverged is not None else pd.DataFrame(columns=KEY)).groupby(["method", "K"]).size()
    table = table.reindex(table.index.union(lost.index))
    table["seeds"] = table["seeds"].fillna(0).astype(int)
    table["diverged"] = lost.reindex(table.index).fillna(0).astype(int)
    table = table.reset_index()
    order = {m: i for i, m in enumerate(in_paper_order(table.method))}
    return table.sort_values(
        ["method", "K"], key=lambda s: s.map(order) if s.name == "method" else s, ignore_index=True
    )


def _pm(mean: float, sd: float, digits: int, sign: str = "") -> str:
    """``mean ± sd`` (``sign`` "+": the mean signed), the mean alone where one seed leaves no spread."""
    if np.isnan(mean):
        return "-"
    if np.isnan(sd):
        return f"{mean:{sign}.{digits}f}"
    return f"{mean:{sign}.{digits}f} ± {sd:.{digits}f}"


def markdown_table(fits: pd.DataFrame, diverged: pd.DataFrame | None = None) -> str:
    """Table 1 as the paper's (mean ± sd over the seeds that finished) beside its values, with the test
    stars' true-value log-likelihood, the training CPU seconds, the dead components and the seeds that
    finished and diverged of each cell."""
    lines = [
        "| Method | K | Paper: validation (Gaia DR2) | Validation | Test | Paper: test | Test, true values | "
        "Training CPU seconds | Components below 1/N | Seeds | Diverged |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    shown = None
    for row in cell_table(fits, diverged).itertuples():
        paper = PAPER_TABLE.get((row.method, row.K))
        paper_test = PAPER_TEST.get(row.method) if row.K == 512 else None
        lines.append(
            "| "
            + " | ".join(
                [
                    method_name(row.method) if row.method != shown else "",
                    str(row.K),
                    "-" if paper is None else _pm(*paper, 2),
                    _pm(row.val_mean, row.val_std, 3),
                    _pm(row.test_mean, row.test_std, 3),
                    "-" if paper_test is None else _pm(*paper_test, 2),
                    _pm(row.true_test_mean, row.true_test_std, 3),
                    _pm(row.train_cpu_seconds_mean, row.train_cpu_seconds_std, 0),
                    "-" if np.isnan(row.dead_components_mean) else f"{row.dead_components_mean:.1f}",
                    str(row.seeds),
                    str(row.diverged),
                ]
            )
            + " |"
        )
        shown = row.method
    return "\n".join(lines)


def paired(fits: pd.DataFrame, better: str, worse: str, K: int, score: str = "val") -> dict:
    """``better``'s ``score`` less ``worse``'s, seed by seed (the same seed is the same k-means start, so the
    pair shares its luck): the mean and sd of the differences over the seeds both ran, the seeds where
    ``better`` is ahead, and whether the mean exceeds twice its standard error (sd / sqrt(seeds))."""
    cell = fits[fits.K == K].pivot_table(index="seed", columns="method", values=score)
    if better not in cell or worse not in cell:
        return {"seeds": 0}
    diff = (cell[better] - cell[worse]).dropna().to_numpy()
    n = len(diff)
    sd = float(diff.std(ddof=1)) if n > 1 else np.nan
    mean = float(diff.mean()) if n else np.nan
    return {
        "seeds": n,
        "mean": mean,
        "sd": sd,
        "ahead": int((diff > 0).sum()),
        "beyond_spread": bool(n > 1 and abs(mean) > 2 * sd / np.sqrt(n)),
    }


def orderings(fits: pd.DataFrame) -> str:
    """The paper's orderings as paired comparisons over the seeds, as a Markdown table: SGD above each other
    method at every K, and batch EM against minibatch EM at every K (the paper: below it at K = 64 and 128,
    above it at 256 and 512)."""
    cases = [("sgd", other, K) for other in ("em", "minibatch_em") for K in sorted(fits.K.unique())]
    cases += [("em", "minibatch_em", K) for K in sorted(fits.K.unique())]
    lines = [
        "| Comparison | K | The paper | Difference (validation, nats a star) | Seeds ahead | Beyond the spread |",
        "|---|---:|---|---:|---:|---|",
    ]
    for better, worse, K in cases:
        result = paired(fits, better, worse, K)
        if not result["seeds"]:
            continue
        paper = np.subtract(PAPER_TABLE[(better, K)][0], PAPER_TABLE[(worse, K)][0])
        verdict = "yes" if result["beyond_spread"] else "no"
        lines.append(
            f"| {method_name(better)} − {method_name(worse)} | {K} | {paper:+.2f} | "
            f"{_pm(result['mean'], result['sd'], 3, sign='+')} | "
            f"{result['ahead']} of {result['seeds']} | {verdict} |"
        )
    return "\n".join(lines)


def figure_1(fits: pd.DataFrame, curves: pd.DataFrame, n_components: int, outputs) -> dict:
    """Figure 1 as the paper's: left, the training log-likelihood at ``n_components`` against training CPU
    time (each epoch at the seeds' mean CPU seconds), every seed a thin line and their mean a thick one;
    right, training CPU seconds against K, the mean over the seeds with ±2 sd error bars. Returns what it
    drew."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(PAGE, COLUMN), layout="constrained")
    methods = in_paper_order(fits.method.unique())
    drawn: dict = {"curves": {}, "timing": {}}
    at_k = curves[curves.K == n_components]
    for method in in_paper_order(at_k.method.unique()):
        runs = at_k[at_k.method == method].pivot_table(
            index="epoch", columns="seed", values=["train_loglik", "cpu_seconds"]
        )
        loglik, seconds = runs["train_loglik"].dropna(), runs["cpu_seconds"].loc[runs["train_loglik"].dropna().index]
        x = seconds.mean(axis=1).to_numpy()
        line = colour(method, methods)
        for seed in loglik:
            left.plot(x, loglik[seed], color=line, alpha=0.35, linewidth=0.6)
        left.plot(x, loglik.mean(axis=1), color=line, linewidth=1.6, label=method_name(method))
        drawn["curves"][method] = {"seeds": loglik.shape[1], "final_mean": float(loglik.iloc[-1].mean())}
    last = at_k.sort_values("epoch").groupby(KEY).tail(10).train_loglik
    if len(last):
        pad = 0.05 * (last.max() - last.min() or 1.0)
        left.set_ylim(last.min() - pad, last.max() + pad)
    left.set_xlabel("training CPU time [s], epochs at the seeds' mean")
    left.set_ylabel("training log-likelihood [nats per star]")
    left.set_title(f"K = {n_components}: every seed (thin) and their mean", fontsize=8)
    for method in methods:
        rows = fits[fits.method == method].groupby("K").train_cpu_seconds.agg(["mean", "std", "size"])
        sd = rows["std"].fillna(0.0).to_numpy()
        right.errorbar(
            rows.index,
            rows["mean"],
            yerr=2 * sd,
            marker="o",
            markersize=3,
            capsize=3,
            color=colour(method, methods),
            label=method_name(method),
        )
        drawn["timing"][method] = {"K": list(rows.index), "mean": rows["mean"].to_numpy(), "sd": sd}
    ks = sorted(fits.K.unique())
    right.set_xscale("log", base=2)
    right.set_xticks(ks, [str(k) for k in ks])
    right.set_xlabel("mixture components K")
    right.set_ylabel("training CPU time [s]")
    seeds = "/".join(map(str, sorted(set(fits.groupby(["method", "K"]).size()))))
    right.set_title(f"mean over {seeds} seeds, bars ±2 sd", fontsize=8)
    handles, labels = right.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), frameon=False)
    save(fig, outputs)
    return drawn
