"""The denoised catalogue: every star's posterior true values under a fitted model, and on a mock their
calibration against the truth.

A deconvolved density is a prior for each star (Anderson et al. 2018 sharpened Gaia's parallaxes with one):
combined with a star's measurement and noise it gives the posterior of the star's true values, a mixture
over the components (``scalable_xd.posterior``). ``denoise`` writes, per star, its posterior mean and
standard deviation, the 2.5th, 16th, 50th, 84th and 97.5th percentiles of each feature's marginal posterior
and the posterior covariance (lower triangle, row-major), a batch of rows at a time. ``calibration``
checks them against the true values where the catalogue knows them: the spread of the pulls
(true - mean) / sd (1 if the uncertainties are right), the share of true values inside the 68% and 95%
intervals, and the precision gain RMSE(mean - true) / RMSE(measured - true), per feature and per bin of
the magnitude (Gaia's G bins, on the feature that plays the magnitude role in the file's spec).
"""

from __future__ import annotations

import json

import numpy as np

from ..data.missing import MISSING_VARIANCE

QUANTILES = (0.025, 0.16, 0.5, 0.84, 0.975)
QUANTILE_NAMES = ("q025", "q16", "q50", "q84", "q975")
G_EDGES = (-np.inf, 14.0, 16.0, 18.0, 19.5, 20.5, np.inf)  # the bins of Lindegren et al. (2018)'s errors
BATCH_ROWS = 65_536
DENOISED_KEY = b"scalable_xd.denoised"  # the denoised file's metadata: the model, the data and their spec


def denoise(model_path, data_path, output, batch_rows: int = BATCH_ROWS) -> None:
    """Write ``output`` (Parquet): ``source_id``, per feature f ``mean_f``, ``sd_f`` and the percentiles
    ``q025_f`` ... ``q975_f``, ``posterior_covariance`` (the lower triangle, row-major) and, on a mock,
    ``true_f``; the data are read and written ``batch_rows`` at a time, the file moved into place at the end."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..estimator import XDGMM
    from ..files import atomic_path
    from .features_file import iter_features

    model = XDGMM.load(model_path)
    writer = None
    with atomic_path(output) as tmp:
        try:
            for batch in iter_features(data_path, batch_rows):
                table = pa.table(_posterior_columns(model, batch))
                if writer is None:
                    about = {"model": str(model_path), "data": str(data_path), "spec": batch.spec.as_dict()}
                    meta = {DENOISED_KEY: json.dumps(about)}
                    writer = pq.ParquetWriter(tmp, table.schema.with_metadata(meta))
                writer.write_table(table)
        finally:
            if writer is not None:
                writer.close()
        if writer is None:
            raise ValueError(f"{data_path} holds no stars to denoise")


def _posterior_columns(model, features) -> dict:
    import pyarrow as pa

    mean, cov, quantiles = model.posterior(features.X, Xcov=features.covariance(), q=QUANTILES)
    rows, cols = np.tril_indices(mean.shape[1])
    columns = {"source_id": features.source_id}
    for d, name in enumerate(features.spec.names):
        columns[f"mean_{name}"] = mean[:, d]
        columns[f"sd_{name}"] = np.sqrt(np.maximum(cov[:, d, d], 0.0))
        for q, label in enumerate(QUANTILE_NAMES):
            columns[f"{label}_{name}"] = quantiles[:, d, q]
        columns[f"x_{name}"] = features.X[:, d]
        columns[f"sigma_{name}"] = features.sigma[:, d]
        if features.true is not None:
            columns[f"true_{name}"] = features.true[:, d]
    packed = cov[:, rows, cols]
    columns["posterior_covariance"] = pa.FixedSizeListArray.from_arrays(pa.array(packed.ravel()), packed.shape[1])
    return columns


def calibration(denoised_path) -> dict:
    """Per feature, overall and per bin of measured G where the survey has it: the stars, the pulls'
    standard deviation, the coverage of the 68% and 95% central intervals and the precision gain (over
    measured entries); ``available`` False, with the reason, where the catalogue has no true values."""
    import pandas as pd

    table = pd.read_parquet(denoised_path)
    names = [c.removeprefix("mean_") for c in table.columns if c.startswith("mean_")]
    if not names:
        raise ValueError(
            f"{denoised_path} is not a denoised catalogue (no mean_<feature> columns): run `scalable-xd denoise` "
            "on a features file and calibrate what it writes"
        )
    if f"true_{names[0]}" not in table.columns:
        return {"available": False, "reason": "the data carry no true values (not a mock)"}
    spec = denoised_spec(denoised_path)
    magnitude = spec.feature("magnitude") if spec is not None and spec.has("magnitude") else None
    g = None if magnitude is None else table[f"x_{magnitude}"].to_numpy()
    out: dict = {"available": True, "n_stars": len(table), "features": {}}
    for name in names:
        overall = _feature_calibration(table, name, slice(None))
        if g is not None:
            overall["by_g"] = []
            for lo, hi in zip(G_EDGES[:-1], G_EDGES[1:]):
                rows = (g >= lo) & (g < hi)
                if rows.sum() >= 10:
                    bounds = {"g_min": _finite(lo), "g_max": _finite(hi)}  # None: an open bin
                    overall["by_g"].append({**bounds, **_feature_calibration(table, name, rows)})
        out["features"][name] = overall
    return out


def denoised_spec(path):
    """The ``FeatureSpec`` of the features a denoised file was written from, or None for a file written
    before it was recorded."""
    import pyarrow.parquet as pq

    from .features_file import FeatureSpec

    raw = (pq.read_schema(path).metadata or {}).get(DENOISED_KEY)
    about = {} if raw is None else json.loads(raw)
    return FeatureSpec.from_dict(about["spec"]) if "spec" in about else None


def read_calibration(path) -> dict:
    """A calibration file (``calibration`` as JSON), checked: a ValueError naming the file where it is not one."""
    from ..files import read_json

    result = read_json(path)
    not_ours = f"{path} is not a calibration written by `scalable-xd calibrate`"
    if not isinstance(result, dict) or not isinstance(result.get("available"), bool):
        raise ValueError(f"{not_ours} (no 'available' flag)")
    features = result.get("features")
    if result["available"] and not (
        isinstance(features, dict)
        and features
        and all(isinstance(row, dict) and {"coverage_68", "coverage_95"} <= set(row) for row in features.values())
    ):
        raise ValueError(f"{not_ours} (its features lack their coverage)")
    return result


def _finite(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def _feature_calibration(table, name: str, rows) -> dict:
    true = table[f"true_{name}"].to_numpy()[rows]
    mean, sd = table[f"mean_{name}"].to_numpy()[rows], table[f"sd_{name}"].to_numpy()[rows]
    resolved = sd > 0  # a posterior sd of 0: a noiseless measurement, nothing to calibrate
    pulls = (true[resolved] - mean[resolved]) / sd[resolved]
    inside = {
        level: float(
            np.mean((true >= table[f"{lo}_{name}"].to_numpy()[rows]) & (true <= table[f"{hi}_{name}"].to_numpy()[rows]))
        )
        for level, lo, hi in (("68", "q16", "q84"), ("95", "q025", "q975"))
    }
    sigma = table[f"sigma_{name}"].to_numpy()[rows]
    measured = sigma**2 < MISSING_VARIANCE
    x = table[f"x_{name}"].to_numpy()[rows]
    rmse = lambda d: float(np.sqrt(np.mean(d**2)))  # noqa: E731
    gain = None
    if measured.sum() > 0:
        gain = rmse(mean[measured] - true[measured]) / rmse(x[measured] - true[measured])
    return {
        "n": int(len(true)),
        "pull_sd": float(np.std(pulls)) if len(pulls) else None,
        "coverage_68": inside["68"],
        "coverage_95": inside["95"],
        "rmse_ratio": gain,  # posterior mean's error over the measurement's: below 1 is a gain
        "n_missing": int((~measured).sum()),
    }


def calibration_markdown(result: dict) -> str:
    """The calibration as a Markdown table, one row per feature (all G), with a caption line."""
    if not result["available"]:
        return f"Denoised values not calibrated: {result['reason']}.\n"
    lines = [
        f"Posterior calibration on {result['n_stars']:,} test stars against their true values: the pulls' "
        "standard deviation (1 when the posterior uncertainties are right), the share of true values inside "
        "the 68% and 95% central intervals, and the posterior mean's RMSE over the measurement's (measured "
        "entries; below 1 is a gain).",
        "",
        "| feature | pull sd | in 68% | in 95% | RMSE ratio | missing |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in result["features"].items():
        ratio = "–" if row["rmse_ratio"] is None else f"{row['rmse_ratio']:.3f}"
        pull = "–" if row["pull_sd"] is None else f"{row['pull_sd']:.3f}"
        lines.append(
            f"| {name} | {pull} | {row['coverage_68']:.1%} | {row['coverage_95']:.1%} | {ratio} | "
            f"{row['n_missing']:,} |"
        )
    return "\n".join(lines) + "\n"
