"""Fits scored against the truth a mock catalogue knows: the deconvolved density at the noise-free values.

XD claims to recover the density of the true values. On a mock, whose every star keeps its noise-free
values, that claim is a number: the mean log-density of the true values of test stars under the fitted
mixture, ``mean log p(v)`` with no noise. Three references with the same K, fitted to the same training
stars by batch EM from the same k-means start, put it on a scale:

* ``oracle``: a plain Gaussian mixture of the true values (zero noise): the best a K-component mixture
  does with the same fitting procedure;
* ``noisy``: a plain Gaussian mixture of the noisy values, that is, what ignoring the noise gives. A missing
  entry is still marginalised out (variance 1e12), as XD does: filling it with the placeholder 0 would
  measure the placeholder, not the effect of ignoring the noise;
* ``achievable``: XD itself, the noise modelled, run to convergence (SQUAREM-accelerated batch EM, stopped
  by ``tol``): the best a fit from this start can do, which no method should be blamed for missing.

The references are fitted in float64: with no noise on the observed entries a component's scatter can be
nearly singular, and float32 sums miss it by more than the regularisation (a K = 128 noisy reference on
the 500,000-row mock diverged at its seventh iteration in float32).

``gap_closed`` = (method - noisy) / (oracle - noisy): 1 when the method does as well as fitting the truth
itself, 0 when it does no better than ignoring the noise, negative when it does worse. Even the XD optimum
leaves part of that gap (the noise destroys information), so ``share_of_achievable`` = (method - noisy) /
(achievable - noisy) says how much of what XD can recover from this start the fit did recover.

A fit on a mock also follows the test stars' true values epoch by epoch (``XDGMM.fit``'s ``eval_sets``,
``true_loglik`` in each history entry), which gives the training seconds it took to first reach each of
``SHARE_MARKS`` of the achievable: how fast a method gets there, not only where it ends.
"""

from __future__ import annotations

import math

import numpy as np

REFERENCES = ("oracle", "noisy", "achievable")
SHARE_MARKS = (0.9, 0.95)
MONITORED = "true"  # the eval_sets name of the test stars' true values: history entries' "true_loglik"
NO_TRUTH = "the data have no noise-free values (real catalogue): nothing to compare with"


def require_truth(features, what: str) -> np.ndarray:
    """The (N, D) true values of a features split, or a ValueError that says which split lacks them."""
    if features.true is None:
        raise ValueError(f"{what} has no true_<feature> columns: {NO_TRUTH}")
    return features.true


def reference_data(features, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(X, per-entry noise variances (N, D)) that a reference of ``kind`` is fitted to (module docstring)."""
    if kind == "oracle":
        true = require_truth(features, "the training split")
        return true, np.zeros_like(true)
    if kind == "noisy":
        from .gaia.features import MISSING_SIGMA

        missing = features.sigma >= MISSING_SIGMA
        return features.X, np.where(missing, features.sigma**2, 0.0)
    if kind == "achievable":
        return features.X, features.covariance()
    raise ValueError(f"unknown reference kind {kind!r}: choose one of {', '.join(REFERENCES)}")


def true_loglik(model, true_values: np.ndarray) -> float:
    """Mean over stars of log p(v_i) under the deconvolved mixture, with no noise."""
    return float(np.mean(model.score_samples(true_values, Xcov=np.zeros_like(true_values))))


def gap_closed(loglik: float, noisy: float, oracle: float) -> float:
    """The fraction of the gap from the noisy-data reference to the oracle that ``loglik`` closes."""
    if not oracle > noisy:
        return math.nan  # no gap to close: the noise does not matter at this K
    return (loglik - noisy) / (oracle - noisy)


def monitored_truth(features) -> dict:
    """The ``eval_sets`` that follow a fit's recovery of ``features``' true values (none without truth)."""
    if features is None or features.true is None:
        return {}
    return {MONITORED: (features.true, np.zeros_like(features.true))}


def seconds_to_share(history: list[dict], noisy: float, achievable: float) -> dict[str, float | None]:
    """Training seconds until the monitored true-value log-likelihood first reaches each of ``SHARE_MARKS``
    of the achievable (keys "0.9", "0.95"; None where the fit never did)."""
    key = f"{MONITORED}_loglik"
    out = {}
    for mark in SHARE_MARKS:
        reached = [e["seconds"] for e in history if gap_closed(e[key], noisy, achievable) >= mark]
        out[str(mark)] = float(reached[0]) if reached else None
    return out


def truth_metrics(model, test, references: dict[str, dict] | None) -> dict:
    """The ``true`` entry of a fit's metrics: its test stars' true-value log-likelihood, the references'
    and the gap closed; on data without truth, says so instead of vanishing."""
    if test is None or test.true is None:
        return {"available": False, "reason": NO_TRUTH}
    out: dict = {"available": True, "test_true_loglik": true_loglik(model, test.true), "n_test": len(test)}
    if references:
        for kind, ref in references.items():
            out[f"{kind}_test_true_loglik"] = ref["test_true_loglik"]
        if {"oracle", "noisy"} <= set(references):
            out["true_gap_closed"] = gap_closed(
                out["test_true_loglik"], out["noisy_test_true_loglik"], out["oracle_test_true_loglik"]
            )
        if {"achievable", "noisy"} <= set(references):
            out["true_share_of_achievable"] = gap_closed(
                out["test_true_loglik"], out["noisy_test_true_loglik"], out["achievable_test_true_loglik"]
            )
            if f"{MONITORED}_loglik" in model.history_[0]:
                out["seconds_to_share"] = seconds_to_share(
                    model.history_, out["noisy_test_true_loglik"], out["achievable_test_true_loglik"]
                )
    return out
