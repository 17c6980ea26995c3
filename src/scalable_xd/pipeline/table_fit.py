"""A fit of one's own table (``scalable-xd fit-table``): values and their errors read from columns of a CSV
or Parquet file, one command from a fitted model, without a survey module or the workflow's files.

Each star's noise is the variances of its error columns (standard deviations), with the correlations of
any pairs given (``--correlation A:B=COLUMN``); the model is an ``XDGMM`` fitted at the settings given,
saved where ``XDGMM.load`` reads it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..settings import FitSettings

log = logging.getLogger("scalable_xd")


def fit_table(
    *,
    input,
    columns: list[str],
    errors: list[str] | None,
    correlation: list[str],
    n_components: int,
    seed: int,
    settings: FitSettings,
    output,
) -> None:
    """Fit ``n_components`` components to ``columns`` of the table at ``input`` (``errors``: each column's
    standard deviation, None for noiseless values; ``correlation``: "A:B=COLUMN" entries, the correlation
    of columns A and B) and save the model to ``output``; a ValueError naming the file, column or entry
    where the table cannot be read so."""
    from ..data.noise import CompactCovariance
    from ..estimator import XDGMM

    if errors is not None and len(errors) != len(columns):
        raise ValueError(f"{len(errors)} --errors for {len(columns)} --columns: give one error column per column")
    pairs, corr_columns = _pairs(correlation, columns)
    if corr_columns and errors is None:
        raise ValueError("--correlation needs --errors: a correlation scales the two columns' errors")
    frame = read_table(input, [*columns, *(errors or []), *corr_columns])
    _check_noise(input, frame, columns, errors, dict(zip(corr_columns, pairs)), settings.missing == "marginalise")
    X = frame[columns]  # a DataFrame: the model keeps the columns' names (feature_names_in_)
    noise = None
    if errors is not None:
        # checked: what is not a number now belongs to a missing value, which is marginalised, its noise unread
        sigma = np.nan_to_num(frame[errors].to_numpy(np.float64))
        corr = np.nan_to_num(frame[corr_columns].to_numpy(np.float64))
        noise = CompactCovariance(sigma, corr, pairs) if pairs else sigma**2
    model = XDGMM(n_components, **settings.as_dict(), random_state=seed).fit(X, Xcov=noise)
    model.save(output)
    log.info(
        "fitted %d components to %d rows of %s: mean log-likelihood %.4f, %s after %d epochs; saved %s",
        n_components,
        len(frame),
        input,
        model.history_[-1]["train_loglik"],
        "converged" if model.converged_ else "not converged",
        model.n_iter_,
        output,
    )


def read_table(path, needed: list[str]):
    """The columns ``needed`` of a CSV (``.csv``, ``.csv.gz``) or Parquet file, as numbers; a ValueError
    naming the file, or the columns it lacks or that hold text."""
    import pandas as pd

    path = Path(path)
    csv = path.name.endswith((".csv", ".csv.gz", ".txt"))
    try:
        frame = pd.read_csv(path) if csv else pd.read_parquet(path)
    except (OSError, ValueError) as err:  # pyarrow's and pandas' errors for a file of another format
        kind = "CSV" if csv else "Parquet (or name it .csv)"
        raise ValueError(f"{path} is not a readable {kind} file ({str(err).splitlines()[0][:160]})") from None
    missing = [name for name in dict.fromkeys(needed) if name not in frame.columns]
    if missing:
        raise ValueError(f"{path} lacks the columns {', '.join(missing)}; it has {', '.join(map(str, frame.columns))}")
    if frame.empty:
        raise ValueError(f"{path} has no rows: only its header")
    text = [name for name in dict.fromkeys(needed) if not pd.api.types.is_numeric_dtype(frame[name])]
    if text:
        raise ValueError(f"{path}: the columns {', '.join(text)} hold text, not numbers")
    return frame


def _check_noise(path, frame, columns: list[str], errors: list[str] | None, correlations: dict, missing: bool) -> None:
    """A ValueError naming the file, column and row (counted from 0 after the header) of a value that is
    infinite (or missing, unless ``missing``: marginalised), an error that is negative or missing where its
    value is measured, or a correlation outside [-1, 1] (or missing) where both its values are measured
    (``correlations``: column -> its pair (i, j) of ``columns``): the library would square a negative error
    silently, and would name a column by its index."""
    values = {name: frame[name].to_numpy(np.float64) for name in [*columns, *(errors or []), *correlations]}
    measured = {name: ~np.isnan(values[name]) for name in columns}
    checks = []  # (column, its rows that are wrong, what they hold)
    for name in columns:
        checks.append((name, np.isinf(values[name]) | ~(measured[name] | missing), "an infinite or missing value"))
    for name, error in zip(columns, errors or []):
        checks.append((error, measured[name] & ~(values[error] >= 0), f"a negative or missing error of {name}"))
    for name, (i, j) in correlations.items():
        both = measured[columns[i]] & measured[columns[j]]
        checks.append((name, both & ~(np.abs(values[name]) <= 1), "a correlation outside [-1, 1]"))
    for name, bad, what in checks:
        rows = np.flatnonzero(bad)
        if rows.size:
            value = float(values[name][rows[0]])
            cure = (
                "" if missing or not np.isnan(value) else " (give --missing marginalise to fit rows that miss values)"
            )
            raise ValueError(f"{path}: column {name} holds {what} in row {rows[0]}: {value}{cure}")


def _pairs(entries: list[str], columns: list[str]) -> tuple[list[tuple[int, int]], list[str]]:
    """The (i, j) column pairs and the correlation columns of ``--correlation A:B=COLUMN`` entries."""
    pairs, names = [], []
    for entry in entries:
        first, _, rest = entry.partition(":")
        second, _, column = rest.partition("=")
        if not (first and second and column) or first not in columns or second not in columns or first == second:
            raise ValueError(
                f"--correlation {entry!r}: give A:B=COLUMN, A and B two of --columns ({', '.join(columns)}) "
                "and COLUMN the column holding their correlation"
            )
        i, j = sorted((columns.index(first), columns.index(second)))
        pairs.append((i, j))
        names.append(column)
    return pairs, names
