"""One function per step of the experiment DAG, taking paths and typed settings; ``cli`` only parses (its
table of subcommands names the function each runs). The fit steps are ``fit_steps``'s.

    mock -> features -> kmeans -> (reference, on a mock) -> fit -> table, claims, plot_*   (or query instead
    of mock; denoise -> calibrate -> plot_denoised and parameter_errors beside them)

Every output is written atomically. Outputs are probed before long work starts (``step_inputs``), so an
unwritable path fails in a second, not after the work.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from ..files import atomic_path, write_json
from ..settings import KMeansSettings
from .step_inputs import check_writable, set_threads

log = logging.getLogger("scalable_xd")

# ------------------------------------------------------------------------------------------- data


def mock(n_rows: int, seed: int, output) -> None:
    from .gaia.mock import make_mock

    frame = make_mock(n_rows, seed=seed)
    with atomic_path(output) as tmp:
        frame.to_parquet(tmp, index=False)
    log.info("wrote %d mock rows to %s", len(frame), output)


def query(n_rows: int, out_dir, manifest=None, **options) -> None:
    from .gaia.query import query_gaia, write_manifest

    paths = query_gaia(n_rows, out_dir, **options)
    if manifest:
        write_manifest(manifest, paths, n_rows=n_rows, tap_url=options.get("tap_url"))
    log.info("%d chunks complete in %s", len(paths), out_dir)


def bulk_index(url: str, output, n_files: int = 0) -> None:
    from .gaia.bulk import fetch_index

    entries = fetch_index(url, output, n_files)
    log.info("%d bulk files listed in %s", len(entries), output)


def bulk_check(downloaded, index, output) -> None:
    from .gaia.bulk import checked_copy

    checked_copy(downloaded, index, output)


def hats_catalogue(index, csv_dir, output, *, pixel_threshold: int, highest_order: int, workers: int) -> None:
    """The checked bulk files that ``index`` lists (in ``csv_dir``) as one HATS catalogue."""
    from .gaia.bulk import import_hats, parse_index

    files = [Path(csv_dir) / name for name, _ in parse_index(Path(index).read_text(), str(index))]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} bulk files listed in {index} are not in {csv_dir}, e.g. {missing[0]}")
    import_hats(files, output, pixel_threshold=pixel_threshold, highest_order=highest_order, workers=workers)
    log.info("HATS catalogue of %d bulk files written to %s", len(files), output)


def features(raw, out_dir, mode: str, split_seed: int, survey: str = "gaia_dr2") -> None:
    """The features file of ``survey``'s raw catalogue (``surveys``), split 80/10/10, and the survey's
    summary of it beside the splits (``features.json``), with the figures its features' roles allow
    (``report.figures_for``), which the workflow's default target then draws."""
    from .features_file import read_features_spec
    from .report import figures_for
    from .surveys import survey_module

    summary = survey_module(survey).write_feature_splits(raw, out_dir, mode=mode, split_seed=split_seed)
    figures = figures_for(read_features_spec(Path(out_dir) / "train.parquet"))
    write_json(Path(out_dir) / "features.json", {"survey": survey, **summary, "figures": figures})
    log.info("features of %s: %s", survey, summary)


# ------------------------------------------------------------------------------------------- fitting


def kmeans(
    train,
    n_components: int,
    seed: int,
    settings: KMeansSettings,
    device: str,
    dtype: str,
    output,
    threads: int = 0,
    max_rows: int = 0,
) -> None:
    """The shared initial weights and means of every method's fit at (K, seed), from all the training stars
    or, where there are more than ``max_rows`` (> 0), from that many chosen by the seed (read a row group
    at a time: the full catalogue's training split does not fit in memory)."""
    import torch

    from .._torch import resolve_device, resolve_dtype
    from ..fit.starts.mixture import kmeans_init, kmeans_sample
    from .features_file import features_source, read_features

    set_threads(threads)
    check_writable(output)
    if max_rows:
        source = features_source(train, validate=False)
        X = kmeans_sample(source, max_rows, seed).X
    else:
        X = torch.as_tensor(read_features(train).X)
    tick = time.perf_counter()
    weights, means = kmeans_init(X, n_components, settings, seed, resolve_device(device), resolve_dtype(dtype))
    seconds = time.perf_counter() - tick
    with atomic_path(output, suffix=".npz") as tmp:
        np.savez(tmp, weights=weights.numpy(), means=means.numpy(), seconds=seconds)
    log.info("k-means K=%d seed=%d: %.1f s", n_components, seed, seconds)


# ------------------------------------------------------------------------------------------- report


def table(metrics, output_prefix) -> None:
    """Table 1 from the fits' metrics files, as csv, md and tex beside ``output_prefix``."""
    from .report.tables import write_loglik_table

    write_loglik_table(metrics, output_prefix)


def claims(metrics, output, device_note: str | None = None, calibration=None) -> None:
    """The paper's claims with their verdicts on the fits' metrics (and the denoised calibration)."""
    from .denoise import read_calibration
    from .report.claims import write_claims

    calibrated = None if calibration is None else read_calibration(calibration)
    write_claims(metrics, output, device_note=device_note, calibration=calibrated)


def plot_timing(metrics, output) -> None:
    from .report.figures import plot_timing_vs_k

    plot_timing_vs_k(metrics, output)


def plot_curves(metrics, n_components: int, output) -> None:
    from .report.figures import plot_training_curves

    plot_training_curves(metrics, output, n_components=n_components)


def plot_sky(model, data, n_samples: int, seed: int, output, frame: str, metrics=None) -> None:
    from .report.sky import plot_sky_density

    plot_sky_density(model, data, output, n_samples=n_samples, seed=seed, frame=frame, metrics_path=metrics)


def plot_corner(model, data, n_samples: int, seed: int, output, metrics=None) -> None:
    from .report.figures import plot_corner as draw

    draw(model, data, output, n_samples=n_samples, seed=seed, metrics_path=metrics)


def plot_selection(naive, aware, data, selection: str, n_samples: int, seed: int, output) -> None:
    from .report.selection import plot_selection as draw

    draw(naive, aware, data, selection, output, n_samples=n_samples, seed=seed)


def denoise(model, data, output, batch_rows: int) -> None:
    """Each star of ``data``'s posterior true values under ``model`` (Parquet)."""
    from .denoise import denoise as write_denoised

    write_denoised(model, data, output, batch_rows=batch_rows)


def calibrate(denoised, output_json, output_md) -> None:
    """The denoised values' calibration against the mock's truth, as JSON and a Markdown table."""
    from ..files import write_text
    from .denoise import calibration, calibration_markdown

    result = calibration(denoised)
    write_json(output_json, result)
    write_text(output_md, calibration_markdown(result))


def parameter_errors(model, train, n_folds: int, max_iter: int, tol: float, seed: int, output_json, output_md) -> None:
    """``model``'s parameter errors by the jackknife over ``train``, as JSON and a Markdown table."""
    from ..files import write_text
    from .parameter_errors import parameter_errors as jackknife
    from .parameter_errors import parameter_errors_markdown

    result = jackknife(model, train, n_folds, seed, max_iter, tol)
    write_json(output_json, result)
    write_text(output_md, parameter_errors_markdown(result))


def plot_denoised(denoised, calibration, output) -> None:
    from .denoise import read_calibration
    from .report.denoised import plot_denoised as draw

    draw(denoised, read_calibration(calibration), output)
