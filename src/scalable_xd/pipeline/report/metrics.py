"""The metrics record of one fit: written by the fit step, read by the tables, figures, claims and tests.

``FitMetrics`` defines the file (``fits/<method>/K<K>_seed<seed>/metrics.json``); ``metrics_frame`` turns a
set of them into the one-row-per-fit table that the tables and claims summarise.

Each split's score (``train``, ``val``, ``test``) is the mean log-likelihood per star as the paper defines
it (``loglik``, missing entries included with their variance 1e12) and for the observed entries alone
(``loglik_observed``); ``true`` holds the truth metrics on a mock (see ``truth``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import numpy as np
import pandas as pd

from ...data.missing import MISSING_LOGLIK_CONSTANT
from ...files import read_json, write_json
from ..truth import SHARE_MARKS
from .style import fit_label, method_name, selection_role

# The training log-likelihood counts as converged within this many nats per star of its final value.
CONVERGED_NATS = 0.05


@dataclass
class FitMetrics:
    method: str
    n_components: int
    seed: int
    train_seconds: float  # cumulative training time of the last epoch (evaluation excluded)
    kmeans_seconds: float
    history: list[dict]  # entry e: the parameters after epoch e (see ``fit.loop``)
    val: dict | None
    train: dict | None = None
    test: dict | None = None  # None when the fit ran without test data
    true: dict = field(default_factory=lambda: {"available": False})
    covariance_mode: str | None = None
    device: str = "unknown"
    backend: str | None = None  # the statistics pass the fit ran (``kernel.dispatch``)
    wall_seconds: float | None = None
    cpu_seconds: float | None = None  # process CPU time of the fit: beside wall time, shows a shared machine
    # Process CPU time of the training (all threads; evaluation excluded, as train_seconds): what one fit
    # costs, which another program on a shared machine moves less than wall time (None in lockstep)
    train_cpu_seconds: float | None = None
    # Cores the rest of the machine kept busy while the fit ran, on average (its busy CPU time less the
    # fit's own, over the fit's wall time): how shared the machine was
    machine_load: float | None = None
    threads: int | None = None
    n_iter: int | None = None
    converged: bool | None = None
    settings: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    tag: str | None = None
    config_hash: str | None = None
    # The seed fitted alone whose pace times this fit's history, where it was fitted in lockstep with other
    # seeds (``fit.run.lockstep``: its own clock counted their work too; wall and CPU seconds then None); None
    # where its own clock timed it.
    timed_by: int | None = None
    dead_components: int | None = None  # components that ended with less than one star's worth of weight
    # Seconds the job spent compiling its kernels before its first timed fit (``fit_steps._warm_up``), shared
    # by its seeds and in none of their times
    warm_up_seconds: float | None = None

    def write(self, path) -> None:
        write_json(path, asdict(self))

    @classmethod
    def read(cls, path) -> FitMetrics:
        """A metrics file, or a ValueError naming it when it is not one."""
        try:
            data = read_json(path)
            known = {f.name for f in fields(cls)}
            return cls(**{key: value for key, value in data.items() if key in known})
        except (ValueError, TypeError, AttributeError) as err:  # not UTF-8, not JSON, keys missing
            raise ValueError(
                f"{path} is not a metrics file written by `scalable-xd fit` ({err.__class__.__name__}: {err})"
            ) from None


def epoch_seconds(history: list[dict]) -> float:
    """The fit's median epoch, in training seconds: its pace, which a burst of load on a shared machine moves
    little (the wall clock of the whole fit takes the burst in full)."""
    durations = np.diff([entry["seconds"] for entry in history])
    return float(np.median(durations)) if len(durations) else 0.0


def steady_seconds(history: list[dict]) -> float:
    """Training seconds of the whole fit at its median epoch's pace (``epoch_seconds``)."""
    return epoch_seconds(history) * (len(history) - 1)


def time_to_converge(history: list[dict], within: float = CONVERGED_NATS) -> float:
    """Training seconds, at the median epoch's pace, until the training log-likelihood first comes within
    ``within`` of its final value."""
    final = history[-1]["train_loglik"]
    reached = next(e for e, entry in enumerate(history) if entry["train_loglik"] >= final - within)
    return epoch_seconds(history) * reached


def _seconds_to(true: dict, mark: float) -> float:
    """Seconds to ``mark`` of the achievable: NaN where not followed, inf where the fit never got there."""
    reached = true.get("seconds_to_share", {})
    if str(mark) not in reached:
        return np.nan
    return np.inf if reached[str(mark)] is None else reached[str(mark)]


def _score(split: dict | None, key: str) -> float:
    return np.nan if split is None else split.get(key, np.nan)


def fit_name(method: str, metrics_path=None) -> str:
    """The name a figure gives a model of ``method``: its fit's as its metrics file (``metrics_path``)
    records it where given (a workflow variant by what sets it apart, ``style.fit_label``), else its
    method's."""
    if metrics_path is None:
        return method_name(method)
    fit = FitMetrics.read(metrics_path)
    return fit_label(fit.method, fit.settings)


def metrics_frame(paths) -> pd.DataFrame:
    """One row per fit: method, K, seed, covariance mode, device, the splits' scores (NaN where not
    measured), the truth metrics and the timings."""
    rows = []
    for path in paths:
        m = FitMetrics.read(path)
        row = {
            "method": m.method,
            "label": fit_label(m.method, m.settings),  # the figures', tables' and claims' name for it
            "selection_role": selection_role(m.settings),  # naive or aware of a selection, else None
            "K": m.n_components,
            "seed": m.seed,
            "mode": m.covariance_mode,
            "device": m.device,
            "threads": m.threads,
            "cpu_seconds": m.cpu_seconds,
            "wall_seconds": m.wall_seconds,
            "train_cpu_seconds": np.nan if m.train_cpu_seconds is None else m.train_cpu_seconds,
            "machine_load": np.nan if m.machine_load is None else m.machine_load,
            "n_train": (m.train or {}).get("n"),
            "n_iter": m.n_iter,
            "dead_components": m.dead_components,
            "timed_alone": m.timed_by is None,  # False: fitted in lockstep, timed at another seed's pace
            "train_seconds": m.train_seconds,
            "kmeans_seconds": m.kmeans_seconds,
            "steady_seconds": steady_seconds(m.history),
            "converge_seconds": time_to_converge(m.history),
            "true_test": m.true.get("test_true_loglik", np.nan),
            "gap_closed": m.true.get("true_gap_closed", np.nan),
            "share_of_achievable": m.true.get("true_share_of_achievable", np.nan),
            **{f"seconds_to_{round(100 * mark)}": _seconds_to(m.true, mark) for mark in SHARE_MARKS},
            "has_truth": bool(m.true.get("available", False)),
            "fitted_with": m.settings.get("method", m.method),
            "split_merge": bool(m.settings.get("split_merge")),
            "averaging": m.settings.get("averaging") or "none",
            "selection": m.settings.get("selection"),  # the limits its training stars were cut by, or None
            "selection_aware": bool(m.settings.get("selection_aware", True)),
            "moves_accepted": m.history[-1].get("moves_accepted", 0) if m.history else 0,
            "converged": bool(m.converged),
        }
        for name, split in (("train", m.train), ("val", m.val), ("test", m.test)):
            row[name], row[f"{name}_observed"] = _score(split, "loglik"), _score(split, "loglik_observed")
        rows.append(row)
    frame = pd.DataFrame(rows)
    if frame.empty:
        raise ValueError("no metrics files given")
    duplicated = frame.duplicated(["method", "K", "seed", "mode"])
    if duplicated.any():
        raise ValueError(
            f"more than one metrics file for {frame[duplicated].iloc[0][['method', 'K', 'seed']].to_dict()}"
        )
    return frame


def loglik_summary(mean_loglik: float, n: int, missing_entries: int) -> dict:
    """A split's score as the paper defines it (mean log p(x) per star, missing entries included) and of the
    observed entries alone: each missing entry adds ``MISSING_LOGLIK_CONSTANT``, so the latter is the former
    less that constant times the mean number of missing entries (``missing_entries`` over the n stars)."""
    missing = missing_entries / n
    return {
        "loglik": mean_loglik,
        "loglik_observed": mean_loglik - MISSING_LOGLIK_CONSTANT * missing,
        "n": n,
        "mean_missing_entries": missing,
    }
