"""Table 1 of the paper: log-likelihoods per method and K, averaged over seeds.

Validation log-likelihoods for every (method, K), mean +- standard deviation over seeds; test
log-likelihood for the K each method's validation score picks. Each is given as the paper defines it
(mean log p(x) per star, missing entries included with their variance 1e12) and for the observed entries
alone (the -log(2 pi 1e12)/2 of each missing entry removed), which is comparable across data sets with
different numbers of missing values.

On a mock, three more columns compare each fit with the truth (see ``truth``): the mean log-density of the
test stars' noise-free values under the fitted mixture, the fraction of the gap from ignoring the noise to
fitting the truth itself that the fit closes, and its share of what XD run to convergence from the same
start achieves; then the training seconds and those it took to first reach 90% and 95% of the achievable
(means over seeds; "never" where a seed did not within its budget). On real data the truth columns read
"n/a" (no truth exists).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...files import atomic_path, write_text
from .metrics import metrics_frame
from .style import in_paper_order


def loglik_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean and standard deviation over seeds per (method, K); test scores at each method's best K."""
    stats = [
        "val",
        "val_observed",
        "test",
        "test_observed",
        "true_test",
        "gap_closed",
        "share_of_achievable",
        "train_seconds",
        "seconds_to_90",
        "seconds_to_95",
    ]
    grouped = frame.groupby(["method", "K"])
    table = grouped[stats].agg(["mean", "std"])
    table.columns = [f"{name}_{agg}" for name, agg in table.columns]
    table["label"] = grouped["label"].first()
    table["n_seeds"] = grouped.size()
    table["n_converged"] = grouped["converged"].sum()
    table = table.reset_index()
    best = table.loc[table.groupby("method")["val_mean"].idxmax(), ["method", "K"]]
    table["best_K"] = [(m, k) in set(map(tuple, best.to_numpy())) for m, k in zip(table.method, table.K)]
    for name in ("test", "test_observed"):
        for agg in ("mean", "std"):
            table.loc[~table.best_K, f"{name}_{agg}"] = np.nan
    order = {m: i for i, m in enumerate(in_paper_order(table.method))}
    return table.sort_values(
        ["method", "K"], key=lambda s: s.map(order) if s.name == "method" else s, ignore_index=True
    )


def _pm(mean: float, sd: float, digits: int = 2, missing: str = "-", scale: float = 1.0, unit: str = "") -> str:
    if np.isnan(mean):
        return missing
    return f"{scale * mean:.{digits}f}{unit} ± {0.0 if np.isnan(sd) else scale * sd:.{digits}f}{unit}"


def _cells(row) -> list[str]:
    """Validation, test, both for the observed entries alone, the test stars' true values, the gap closed and
    the share of the achievable, as "mean ± sd" ("-" where not reported, "n/a" where the data have no truth)."""
    return [
        _pm(row.val_mean, row.val_std),
        _pm(row.test_mean, row.test_std),
        _pm(row.val_observed_mean, row.val_observed_std),
        _pm(row.test_observed_mean, row.test_observed_std),
        _pm(row.true_test_mean, row.true_test_std, missing="n/a"),
        _pm(row.gap_closed_mean, row.gap_closed_std, digits=0, missing="n/a", scale=100, unit="%"),
        _pm(row.share_of_achievable_mean, row.share_of_achievable_std, digits=0, missing="n/a", scale=100, unit="%"),
    ]


def _timing(row) -> str:
    """Training seconds, then those to 90% / 95% of the achievable where followed."""
    if np.isnan(row.seconds_to_90_mean):
        return f"{row.train_seconds_mean:.1f}"
    reached = ("never" if np.isinf(t) else f"{t:.1f}" for t in (row.seconds_to_90_mean, row.seconds_to_95_mean))
    return f"{row.train_seconds_mean:.1f} ({' / '.join(reached)})"


CAPTION = (
    "Mean log-likelihood per star in nats (log p(x) with missing entries at their variance 1e12, as the paper "
    "defines it, and of the observed entries alone), mean ± sd over seeds; test scores at each method's best K; "
    "on a mock, the log-density of the test stars' true values, the gap closed from ignoring the noise to "
    "fitting the truth, the share of what converged XD achieves (below 0: worse on the true values than a fit "
    "that ignores the noise), and the training seconds (to 90% / 95% of it). "
    "Seeds (converged): the fits averaged, and in brackets those whose last epoch raised the mean training "
    "log-likelihood by less than tol; the others ended at their epoch budget, still improving. A fit under a "
    "selection (a cut) is validated on the stars its cut keeps and tested on all of them: its two scores are "
    "of different stars."
)


def to_markdown(table: pd.DataFrame) -> str:
    lines = [
        CAPTION,
        "",
        "| Method | K | Validation | Test | Validation (observed entries) | Test (observed entries) "
        "| Test, true values | Gap closed | Share of the achievable | Seconds (to 90% / 95%) | Seeds (converged) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    previous = None
    for row in table.itertuples():
        name = row.label if row.method != previous else ""
        previous = row.method
        seeds = f"{row.n_seeds} ({row.n_converged})"
        lines.append(f"| {name} | {row.K} | " + " | ".join(_cells(row)) + f" | {_timing(row)} | {seeds} |")
    return "\n".join(lines) + "\n"


def to_latex(table: pd.DataFrame) -> str:
    lines = [
        r"\begin{tabular}{llrrrrrrr}",
        r"\toprule",
        r"Method & $K$ & Validation & Test & Validation (obs.) & Test (obs.) & Test, true values & Gap closed"
        r" & Achieved \\",
        r"\midrule",
    ]
    previous = None
    for row in table.itertuples():
        if previous is not None and row.method != previous:
            lines.append(r"\midrule")
        name = row.label if row.method != previous else ""
        previous = row.method
        cells = [_latex_cell(c) for c in _cells(row)]
        lines.append(f"{name} & {row.K} & " + " & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def _latex_cell(cell: str) -> str:
    if cell == "-":
        return "--"
    return cell.replace("±", r"$\pm$").replace("%", r"\%").replace("-", "$-$", 1)


def write_loglik_table(metrics_paths, prefix) -> pd.DataFrame:
    """Write ``<prefix>.csv``, ``.md`` and ``.tex``; returns the table."""
    table = loglik_table(metrics_frame(metrics_paths))
    with atomic_path(f"{prefix}.csv") as tmp:
        table.to_csv(tmp, index=False, float_format="%.6f")
    write_text(f"{prefix}.md", to_markdown(table))
    write_text(f"{prefix}.tex", to_latex(table))
    return table
