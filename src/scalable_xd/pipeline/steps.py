"""One function per step of the experiment DAG, taking paths and typed settings; ``cli`` only parses (its
table of subcommands names the function each runs).

    mock -> features -> kmeans -> (reference, on a mock) -> fit -> table, claims, plot_*   (or query instead
    of mock; denoise -> calibrate -> plot_denoised and parameter_errors beside them)

Every output is written atomically; ``fit`` checkpoints each epoch, resumes from its checkpoint and removes
it once the model and metrics are saved. Outputs are probed before long work starts, so an unwritable
path fails in a second, not after the fit.
"""

from __future__ import annotations

import functools
import logging
import platform
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..files import atomic_path, read_json, read_npz, write_json
from ..settings import FitSettings, KMeansSettings

if TYPE_CHECKING:
    from ..fit.lockstep import Member

log = logging.getLogger("scalable_xd")

# What a reference fit (see ``truth``) runs: batch EM in float64 accelerated by SQUAREM, to convergence.
REFERENCE = FitSettings(method="em", epochs=2000, tol=1e-5, dtype="float64", verbose=1, acceleration="squarem")


def check_writable(*paths) -> None:
    """Fail before the work, not after it, when an output cannot be written (by creating and removing a
    file beside each)."""
    for path in filter(None, paths):
        parent = Path(path).parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=parent):
                pass
        except OSError as err:
            raise OSError(
                f"cannot write {path}: {parent} is not a writable directory ({err.strerror or err})"
            ) from None


def read_init(path, n_components: int, n_features: int | None = None) -> dict:
    """The arrays of a k-means init file (``kmeans``), checked to hold ``n_components`` components (of
    ``n_features`` features, where given); a ValueError names the file otherwise."""
    init = read_npz(
        path, ("weights", "means", "seconds"), f"{path} is not an init file written by `scalable-xd kmeans`"
    )
    if len(init["weights"]) != n_components:
        raise ValueError(f"{path} holds an init of K = {len(init['weights'])} components, not {n_components}")
    means = init["means"]
    if n_features is not None and (means.ndim != 2 or means.shape[1] != n_features):
        raise ValueError(
            f"{path} holds means of shape {means.shape}, not ({n_components}, {n_features}) for these data"
        )
    return init


def _set_threads(threads: int) -> None:
    import torch

    if threads > 0:
        torch.set_num_threads(threads)


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
    from ..fit.init import kmeans_init, kmeans_sample
    from .features_file import features_source, read_features

    _set_threads(threads)
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


def _split(path, name: str, *, settings: FitSettings, stream_window: int):
    """A split as a fit's arguments (X, Xcov): a source streamed from disk, or the split loaded and checked
    once (a ``Dataset``, which every seed's fit and scoring then take as it is); its facts for the report,
    and the split itself where it was loaded (None when streamed). The training and validation splits are
    cut by the fit's selection, where it has one (``selected``)."""
    from ..data.dataset import Dataset
    from .features_file import features_source, read_features, split_facts

    if stream_window:
        if settings.selection is not None:
            raise ValueError(
                f"selection {settings.selection!r}: the workflow cuts its splits in memory; set fit.stream_window 0"
            )
        source = features_source(path, stream_window, name, missing=settings.missing)
        return (source, None), split_facts(path), None
    split = read_features(path)
    if settings.selection is not None and name != "X_test":
        split = split.subset(selected(split, settings))
    facts = {
        "n": len(split),
        "missing_entries": int(split.n_missing.sum()),
        "mode": split.mode,
        "true_values": split.true is not None,
    }
    return (Dataset(split.X, split.covariance(), name=name, missing=settings.missing), None), facts, split


def _selection(settings: FitSettings, train_split):
    """The selection setting's limits on the training split's features by name (the estimator knows only
    x0, x1, ...), where the fit is aware of one; else None."""
    from ..fit.selection import from_limits

    if settings.selection is None or not settings.selection_aware:
        return None
    assert train_split is not None  # a selection is refused on streamed splits (``_split``)
    return from_limits(settings.selection, list(train_split.spec.names), settings.selection_on)


def _fit_metrics(model, record: dict, timing: dict, facts: tuple, spec=None):
    """A fitted model's metrics record (``report.metrics.FitMetrics``): ``record`` names the fit (method,
    K, seed, tag, config hash), ``timing`` its k-means, wall and CPU seconds, ``facts`` (the training and
    validation splits' facts, the test split's ((X, Xcov), facts) to score it on, or None, the test split
    itself, the reference files); ``spec``, the training data's, names the features in a selection's label."""
    import torch

    import scalable_xd

    from .report.metrics import FitMetrics, loglik_summary
    from .report.style import readable_selection
    from .truth import truth_metrics

    train_facts, val_facts, test_data, test_split, references = facts
    test_summary = None
    if test_data is not None:
        (X_test, Xcov_test), test_facts = test_data
        test_summary = loglik_summary(
            model.score(X_test, Xcov=Xcov_test), test_facts["n"], test_facts["missing_entries"]
        )
    last = model.history_[-1]  # the last epoch's evaluation already scored the final parameters
    device = model._device
    settings = model.describe()
    if settings.get("selection") and spec is not None:  # as the figures name the cut: "G < 20"
        settings["selection_label"] = readable_selection(settings["selection"], spec.names, spec.feature_labels)
    return FitMetrics(
        **record,
        settings=settings,
        train_seconds=last["seconds"],
        train_cpu_seconds=last.get("cpu_seconds"),
        **timing,
        threads=torch.get_num_threads(),
        n_iter=model.n_iter_,
        converged=model.converged_,
        dead_components=int((model.weights_ * train_facts["n"] < 1).sum()),
        history=model.history_,
        covariance_mode=train_facts["mode"],
        device=str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        backend=model.backend_,
        versions={
            "scalable_xd": scalable_xd.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        train=loglik_summary(last["train_loglik"], train_facts["n"], train_facts["missing_entries"]),
        val=None
        if val_facts is None
        else loglik_summary(last["val_loglik"], val_facts["n"], val_facts["missing_entries"]),
        test=test_summary,
        true=truth_metrics(model, test_split, {ref["kind"]: ref for ref in map(read_json, references)}),
    )


def fit(
    *,
    train,
    val,
    test,
    init: list,
    n_components: int,
    seeds: list[int],
    settings: FitSettings,
    output_model: list,
    output_metrics: list,
    checkpoint: list | None = None,
    references=(),
    tag=None,
    config_hash=None,
    threads: int = 0,
    label: str | None = None,
    stream_window: int = 0,
    checkpoint_every: int = 0,
) -> None:
    """Fits of one method and K, one for each of ``seeds`` from its k-means init (``init``, in the seeds'
    order, as the outputs and checkpoints are), on the splits read and checked once: each seed's model and
    metrics record (``report.metrics``), reported under ``label`` (a workflow variant's name) or the
    method's name. The first seed is fitted alone, timed as one fit. The others, where the method steps in
    lockstep (``fit.restarts.in_lockstep``: the minibatch methods on the CPU and CUDA), are fitted together, each
    step one pass and one update call for all (``fit.lockstep``), each the fit it would be alone, to the
    bit, its metrics timed at the first seed's pace (``_fit_seed``); otherwise one after another, each timed
    alone. Each seed's checkpoint is removed only once every seed is written, so a stopped job resumes each
    seed where it was, the seeds done read back from their checkpoints. ``stream_window`` > 0 streams the
    splits from disk a window of that many rows at a time (``stream``) instead of loading them; the test
    split is then loaded only where it holds true values (a mock), for the truth metrics."""
    from ..fit.parallel import Group, fail_together
    from .features_file import read_features

    checkpoints = checkpoint or [None] * len(seeds)
    given = {
        "--init": init,
        "--output-model": output_model,
        "--output-metrics": output_metrics,
        "--checkpoint": checkpoints,
    }
    if any(len(paths) != len(seeds) for paths in given.values()):
        counts = ", ".join(f"{len(paths)} {name}" for name, paths in given.items())
        raise ValueError(f"{len(seeds)} seeds but {counts}: give one of each per seed, in the seeds' order")
    _set_threads(threads)
    check_writable(*output_model, *output_metrics, *checkpoints)
    data = functools.partial(_split, settings=settings, stream_window=stream_window)
    with fail_together(Group.current(), "reading the features files"):  # a file one rank cannot read fails all
        train_data = data(train, "X")
        val_data = None if val is None else data(val, "X_val")[:2]
        test_data, test_split = None, None
        if test is not None:
            *test_data, test_split = data(test, "X_test")
            if test_split is None and test_data[1]["true_values"]:  # streamed: loaded for the truth metrics
                test_split = read_features(test)
    splits = (train_data, val_data, test_data, test_split)
    record = dict(method=label or settings.method, n_components=n_components, tag=tag, config_hash=config_hash)
    warm_up = _warm_up(settings, n_components, train_data[2])
    fits = [
        functools.partial(
            _fit_seed,
            settings,
            {**record, "seed": seed},
            seed_init,
            splits,
            (*paths, checkpoint_every),
            references,
            warm_up_seconds=warm_up,
        )
        for seed, seed_init, *paths in zip(seeds, init, output_model, output_metrics, checkpoints)
    ]
    pace = fits[0]()  # the first seed alone: its clock times one fit
    _fit_the_others(fits[1:], (seeds[0], pace), settings)
    if Group.current().writes:
        for path in filter(None, checkpoints):
            Path(path).unlink(missing_ok=True)


def _fit_the_others(fits: list, timed_by: tuple[int, float], settings: FitSettings) -> None:
    """The seeds after the first: in lockstep where the method steps so (``fit.restarts.in_lockstep``),
    timed by the first (``timed_by``: its seed and pace); otherwise one after another, each timed alone."""
    from ..fit.lockstep import Lockstep, raise_failure
    from ..fit.restarts import in_lockstep

    if len(fits) < 2 or not in_lockstep(settings):
        for fit_seed in fits:
            fit_seed()
        return
    raise_failure(Lockstep().run([functools.partial(_joined, fit_seed, timed_by) for fit_seed in fits]))


def _warm_up(settings: FitSettings, n_components: int, train_split) -> float:
    """Seconds spent compiling (or loading from numba's cache) the kernels the seeds' fits run, by a fit of
    one epoch on a slice of the training split and its scoring on a few rows and on the slice, untimed: so
    that no seed's fit times a compile. The first fit of each kind absorbed it in its first epoch (38 s
    against 0.3 s for the other seeds), and the timing figure with it. 0 where the split is streamed."""
    import warnings
    from dataclasses import replace

    from ..estimator import XDGMM
    from ..fit.methods import default_batch
    from ..fit.scoring import EVAL_BATCH

    if train_split is None:
        return 0.0
    batch = default_batch(len(train_split)) if settings.batch_size is None else settings.batch_size
    part = train_split.subset(selected(train_split, settings)[: max(2 * batch, EVAL_BATCH)])  # rows the fits see
    X, Xcov = part.X, part.covariance()
    tick = time.perf_counter()
    # the kernels of the seeds' fits, a selection's too (its imputed points carry dense noise: a kernel of its
    # own, which the first selection-aware fit compiled in its first epoch, 42 s); the selection by its
    # limits on the features' names, which the estimator's setting cannot resolve
    trial = replace(settings, batch_size=batch, epochs=1, n_init=1, split_merge=False, verbose=0, selection=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one epoch: not converged, and said to no one
        model = XDGMM(min(n_components, len(part)), **trial.as_dict(), random_state=0)
        model.fit(X, Xcov=Xcov, selection=_selection(settings, part))
        for rows in (min(8, len(part)), len(part)):  # scoring a chunk on one thread, and on several
            scored = part.subset(np.arange(rows))
            model.score(scored.X, Xcov=scored.covariance())
    return time.perf_counter() - tick


def _joined(fit_seed, timed_by: tuple[int, float], member: Member) -> float:
    """``fit_seed`` as a member of a lockstep (``fit.lockstep``), timed by ``timed_by``."""
    with member.joined():
        return fit_seed(timed_by=timed_by)


def _fit_seed(
    settings: FitSettings,
    record: dict,
    init,
    splits: tuple,
    outputs: tuple,
    references,
    timed_by: tuple[int, float] | None = None,
    warm_up_seconds: float = 0.0,
) -> float:
    """One seed's fit (``fit``) from its k-means ``init``: its model and metrics record written to
    ``outputs`` (model, metrics, checkpoint, checkpoint_every) by the process that writes; returns its pace
    (``report.metrics.epoch_seconds``). A fit in lockstep with others (``timed_by``: a seed fitted alone
    and its pace) keeps its own history in its model file, but its metrics' history is timed at that pace
    (its own clock counted the other fits' work too), and its record names the seed that timed it."""
    from ..estimator import XDGMM
    from ..fit.parallel import Group
    from .report.metrics import epoch_seconds
    from .truth import monitored_truth

    ((X, Xcov), train_facts, train_split), val_data, test_data, test_split = splits
    (X_val, Xcov_val), val_facts = val_data if val_data is not None else ((None, None), None)
    output_model, output_metrics, checkpoint, checkpoint_every = outputs
    n_components, seed = record["n_components"], record["seed"]
    start = read_init(init, n_components, X.obs_dim)
    model = XDGMM(
        n_components, **settings.as_dict(), random_state=seed, weights_init=start["weights"], means_init=start["means"]
    )
    tick, cpu_tick, busy_tick = time.perf_counter(), time.process_time(), _machine_busy_seconds()
    model.fit(
        X,
        Xcov=Xcov,
        X_val=X_val,
        Xcov_val=Xcov_val,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        eval_sets=monitored_truth(test_split),  # a mock's recovery of the truth, epoch by epoch
        selection=_selection(settings, train_split),
    )
    wall, cpu = time.perf_counter() - tick, time.process_time() - cpu_tick
    others = (_machine_busy_seconds() - busy_tick - cpu) / wall  # cores the rest of the machine kept busy
    group = Group.current()  # under torchrun every process fits; rank 0 alone writes
    if group.writes:
        model.save(output_model)
    timing = dict(kmeans_seconds=float(start["seconds"]), wall_seconds=wall, cpu_seconds=cpu, timed_by=None)
    timing.update(warm_up_seconds=warm_up_seconds, machine_load=max(0.0, others))
    pace = epoch_seconds(model.history_)
    if timed_by is not None:  # the metrics' clock: the seed fitted alone's (the model file keeps its own)
        timing.update(wall_seconds=None, cpu_seconds=None, timed_by=timed_by[0])
        model.history_ = [
            {**entry, "seconds": entry["epoch"] * timed_by[1], "cpu_seconds": None} for entry in model.history_
        ]
    facts = (train_facts, val_facts, test_data, test_split, references)
    metrics = _fit_metrics(model, record, timing, facts, None if train_split is None else train_split.spec)
    if group.writes:
        metrics.write(output_metrics)
    log.info(
        "%s K=%d seed=%d: train %.4f in %.1f s",
        settings.method,
        n_components,
        seed,
        model.history_[-1]["train_loglik"],
        metrics.train_seconds,
    )
    return pace


def _machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (every process, every core) since boot (psutil)."""
    import psutil

    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def selected(split, settings: FitSettings) -> np.ndarray:
    """The rows of a features split that the fit's selection keeps: by its limits on the observed values, or
    on the true values where ``selection_on`` is "true" and the split has them (a mock). A real catalogue
    the survey already cut so keeps every row; one without true values, under a selection on them, too."""
    from ..fit.selection import from_limits

    if settings.selection is None or (settings.selection_on == "true" and split.true is None):
        return np.arange(len(split))
    values = split.true if settings.selection_on == "true" else split.X
    rule = from_limits(settings.selection, list(split.spec.names))
    return np.flatnonzero(rule.kept(np.asarray(values, dtype=np.float64)) > 0)


def reference(
    *,
    train,
    test,
    init,
    n_components: int,
    seed: int,
    kind: str,
    settings: FitSettings,
    output_metrics,
    threads: int = 0,
) -> None:
    """A reference fit for the truth metrics (see ``truth``): batch EM from the shared k-means init on the
    true values (``oracle``) or on the noisy values with their noise ignored (``noisy``)."""
    from ..estimator import XDGMM
    from .features_file import read_features
    from .truth import reference_data, require_truth, true_loglik

    _set_threads(threads)
    check_writable(output_metrics)
    train_split, test_split = read_features(train), read_features(test)
    start = read_init(init, n_components, train_split.X.shape[1])
    test_true = require_truth(test_split, test)
    X, variances = reference_data(train_split, kind)
    model = XDGMM(
        n_components, **settings.as_dict(), random_state=seed, weights_init=start["weights"], means_init=start["means"]
    ).fit(X, Xcov=variances)
    write_json(
        output_metrics,
        {
            "kind": kind,
            "n_components": n_components,
            "seed": seed,
            "test_true_loglik": true_loglik(model, test_true),
            "train_loglik": model.history_[-1]["train_loglik"],
            "train_seconds": model.history_[-1]["seconds"],
            "n_iter": model.n_iter_,
            "converged": model.converged_,
            "settings": model.describe(),
        },
    )
    log.info("reference %s K=%d: after %d iterations", kind, n_components, model.n_iter_)


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
