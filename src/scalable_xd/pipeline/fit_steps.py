"""The fit steps of the experiment DAG: a grid cell's fits (one model a seed, the data read once, the fits
of a minibatch method in lockstep), and the reference fits that a mock's truth metrics are measured against
(see ``truth``). Each fit checkpoints each epoch, resumes from its checkpoint and removes it once the model
and metrics are saved."""

from __future__ import annotations

import functools
import logging
import platform
import time
from pathlib import Path

import numpy as np

from ..files import read_json, write_json
from ..settings import FitSettings
from .step_inputs import check_writable, read_init, set_threads

log = logging.getLogger("scalable_xd")

# What a reference fit (see ``truth``) runs: batch EM in float64 accelerated by SQUAREM, to convergence.
REFERENCE = FitSettings(method="em", epochs=2000, tol=1e-5, dtype="float64", verbose=1, acceleration="squarem")


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
    method's name. The first seed is fitted alone, timed as one fit. The others are fitted by the library's
    ``fit_together``: where their method steps in lockstep (``scalable_xd.steps_together``: the minibatch
    methods on the CPU and CUDA) each step is one pass and one update call for all, each the fit it would be
    alone, to the bit, and their metrics are timed at the first seed's pace (``_write_seed``); otherwise one
    after another, each timed alone. Each seed's checkpoint is removed only once every seed is written, so a
    stopped job resumes each seed where it was, the seeds done read back from their checkpoints.
    ``stream_window`` > 0 streams the splits from disk a window of that many rows at a time (``stream``)
    instead of loading them; the test split is then loaded only where it holds true values (a mock), for the
    truth metrics."""
    from ..fit.run.parallel import Group, fail_together
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
    set_threads(threads)
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
    # each seed: its estimator, its record, its outputs (the k-means seconds of its init among them)
    seeded = []
    for seed, seed_init, *paths in zip(seeds, init, output_model, output_metrics):
        model, kmeans_seconds = _model(settings, n_components, seed, seed_init, train_data[0][0].obs_dim)
        seeded.append((model, {**record, "seed": seed}, (*paths, references, kmeans_seconds)))
    warm_up = _warm_up(settings, n_components, train_data[2])
    fit_args = dict(**_fit_args(settings, splits), checkpoint_every=checkpoint_every)
    _fit_seeds(seeded, fit_args, checkpoints, warm_up, splits)
    if Group.current().writes:
        for path in filter(None, checkpoints):
            Path(path).unlink(missing_ok=True)


def _fit_seeds(seeded: list, fit_args: dict, checkpoints: list, warm_up: float, splits: tuple) -> None:
    """Each seed's (estimator, record, outputs) of ``seeded`` fitted with ``fit_args`` and its checkpoint,
    and written (``_write_seed``): the first alone, timed as one fit, then the others (``fit``)."""
    from ..together import fit_together, steps_together

    (first, first_record, first_outputs), others = seeded[0], seeded[1:]
    timing = _timed(lambda: first.fit(**fit_args, checkpoint=checkpoints[0]))
    pace = _write_seed(first, first_record, first_outputs, {**timing, "warm_up_seconds": warm_up}, splits)
    models = [model for model, _, _ in others]
    if models and steps_together(models):
        group = _timed(lambda: fit_together(models, **fit_args, checkpoints=checkpoints[1:]))
        paced = {**group, "wall_seconds": None, "cpu_seconds": None, "warm_up_seconds": warm_up}
        for model, seed_record, seed_outputs in others:
            _write_seed(model, seed_record, seed_outputs, paced, splits, timed_by=(first.random_state, pace))
        return
    for (model, seed_record, seed_outputs), path in zip(others, checkpoints[1:]):
        timing = _timed(functools.partial(model.fit, **fit_args, checkpoint=path))
        _write_seed(model, seed_record, seed_outputs, {**timing, "warm_up_seconds": warm_up}, splits)


def _model(settings: FitSettings, n_components: int, seed: int, init, n_features: int):
    """A seed's estimator, started from its k-means ``init`` file, and the seconds that k-means took."""
    from ..estimator import XDGMM

    start = read_init(init, n_components, n_features)
    model = XDGMM(
        n_components, **settings.as_dict(), random_state=seed, weights_init=start["weights"], means_init=start["means"]
    )
    return model, float(start["seconds"])


def _fit_args(settings: FitSettings, splits: tuple) -> dict:
    """The arguments of every seed's ``fit``: the training split, the validation split, a mock's true
    values followed epoch by epoch (``truth.monitored_truth``) and the selection the fit is aware of."""
    from .truth import monitored_truth

    ((X, Xcov), _, train_split), val_data, _, test_split = splits
    (X_val, Xcov_val), _ = val_data if val_data is not None else ((None, None), None)
    return dict(
        X=X,
        Xcov=Xcov,
        X_val=X_val,
        Xcov_val=Xcov_val,
        eval_sets=monitored_truth(test_split),  # a mock's recovery of the truth, epoch by epoch
        selection=_selection(settings, train_split),
    )


def _timed(fit) -> dict:
    """Run ``fit()``: its wall and CPU seconds, and the cores the rest of the machine kept busy meanwhile."""
    tick, cpu_tick, busy_tick = time.perf_counter(), time.process_time(), _machine_busy_seconds()
    fit()
    wall, cpu = time.perf_counter() - tick, time.process_time() - cpu_tick
    others = (_machine_busy_seconds() - busy_tick - cpu) / wall
    return dict(wall_seconds=wall, cpu_seconds=cpu, machine_load=max(0.0, others))


def _warm_up(settings: FitSettings, n_components: int, train_split) -> float:
    """Seconds spent compiling (or loading from numba's cache) the kernels the seeds' fits run, by a fit of
    one epoch on a slice of the training split and its scoring on a few rows and on the slice, untimed: so
    that no seed's fit times a compile. The first fit of each kind absorbed it in its first epoch (38 s
    against 0.3 s for the other seeds), and the timing figure with it. 0 where the split is streamed."""
    import warnings
    from dataclasses import replace

    from ..estimator import XDGMM
    from ..fit.methods import default_batch
    from ..fit.run.scoring import EVAL_BATCH

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


def _write_seed(
    model, record: dict, outputs: tuple, timing: dict, splits: tuple, timed_by: tuple[int, float] | None = None
) -> float:
    """A seed's fitted model and metrics record written to ``outputs`` (model file, metrics file, the
    reference files, the seconds its k-means init took) by the process that writes; returns its pace
    (``report.metrics.epoch_seconds``). A fit in lockstep with others (``timed_by``: a seed fitted alone
    and its pace) keeps its own history in its model file, but its metrics' history is timed at that pace
    (its own clock counted the other fits' work too), and its record names the seed that timed it."""
    from ..fit.run.parallel import Group
    from .report.metrics import epoch_seconds

    (_, train_facts, train_split), val_data, test_data, test_split = splits
    output_model, output_metrics, references, kmeans_seconds = outputs
    group = Group.current()  # under torchrun every process fits; rank 0 alone writes
    if group.writes:
        model.save(output_model)
    timing = {**timing, "kmeans_seconds": kmeans_seconds, "timed_by": None}
    pace = epoch_seconds(model.history_)
    if timed_by is not None:  # the metrics' clock: the seed fitted alone's (the model file keeps its own)
        timing["timed_by"] = timed_by[0]
        model.history_ = [
            {**entry, "seconds": entry["epoch"] * timed_by[1], "cpu_seconds": None} for entry in model.history_
        ]
    val_facts = None if val_data is None else val_data[1]
    facts = (train_facts, val_facts, test_data, test_split, references)
    metrics = _fit_metrics(model, record, timing, facts, None if train_split is None else train_split.spec)
    if group.writes:
        metrics.write(output_metrics)
    log.info(
        "%s K=%d seed=%d: train %.4f in %.1f s",
        model.method,
        record["n_components"],
        record["seed"],
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

    set_threads(threads)
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
