"""One function per step of the experiment DAG, taking paths and typed settings; ``cli`` only parses.

    mock -> features -> kmeans -> (reference, on a mock) -> fit -> report.*   (or query instead of mock)

Every output is written atomically; ``fit`` checkpoints each epoch, resumes from its checkpoint and removes
it once the model and metrics are saved. Outputs are probed before long work starts, so an unwritable
path fails in a second, not after the fit.
"""

from __future__ import annotations

import json
import logging
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from .io import atomic_path, read_npz, write_json
from .settings import FitSettings, KMeansSettings

log = logging.getLogger("scalable_xd")

# What a reference fit (see ``truth``) runs: batch EM in float64, longer and tighter than the fits.
REFERENCE = FitSettings(method="em", epochs=100, tol=1e-5, dtype="float64", verbose=1)


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
            raise OSError(f"cannot write {path}: {parent} is not a writable directory ({err.strerror or err})") from None


def read_init(path, n_components: int) -> dict:
    """The arrays of a k-means init file (``kmeans``), checked to hold ``n_components`` components; a
    ValueError names the file otherwise."""
    init = read_npz(path, ("weights", "means", "seconds"), f"{path} is not an init file written by `scalable-xd kmeans`")
    if len(init["weights"]) != n_components:
        raise ValueError(f"{path} holds an init of K = {len(init['weights'])} components, not {n_components}")
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


def features(raw, out_dir, mode: str, split_seed: int) -> None:
    from .gaia.storage import write_feature_splits

    summary = write_feature_splits(raw, out_dir, mode=mode, split_seed=split_seed)
    log.info("features: %s rows, bad rows repaired: %s", summary["rows"], summary["bad_rows"])


# ------------------------------------------------------------------------------------------- fitting


def kmeans(train, n_components: int, seed: int, settings: KMeansSettings, device: str, dtype: str, output,
           threads: int = 0) -> None:  # fmt: skip
    """The shared initial weights and means of every method's fit at (K, seed)."""
    import torch

    from ._torch import resolve_device, resolve_dtype
    from .fit.init import kmeans_init
    from .gaia.storage import read_features

    _set_threads(threads)
    check_writable(output)
    X = torch.as_tensor(read_features(train).X)
    tick = time.perf_counter()
    weights, means = kmeans_init(X, n_components, settings, seed, resolve_device(device), resolve_dtype(dtype))
    seconds = time.perf_counter() - tick
    with atomic_path(output, suffix=".npz") as tmp:
        np.savez(tmp, weights=weights.numpy(), means=means.numpy(), seconds=seconds)
    log.info("k-means K=%d seed=%d: %.1f s", n_components, seed, seconds)


def fit(*, train, val, test, init, n_components: int, seed: int, settings: FitSettings, output_model,
        output_metrics, checkpoint=None, references=(), tag=None, config_hash=None, threads: int = 0,
        label: str | None = None) -> None:  # fmt: skip
    """One fit from a k-means init: the model, and its metrics record (``report.metrics``), reported under
    ``label`` (a workflow variant's name) or the method's name."""
    import torch

    import scalable_xd

    from .estimator import XDGMM
    from .fit.parallel import Group
    from .gaia.features import loglik_summary
    from .gaia.storage import read_features
    from .report.metrics import FitMetrics
    from .truth import truth_metrics

    _set_threads(threads)
    check_writable(output_model, output_metrics, checkpoint)
    start = read_init(init, n_components)
    train_split = read_features(train)
    val_split = None if val is None else read_features(val)
    model = XDGMM(n_components, **settings.as_dict(), random_state=seed, weights_init=start["weights"],
                  means_init=start["means"])  # fmt: skip
    tick, cpu_tick = time.perf_counter(), time.process_time()
    model.fit(train_split.X, train_split.covariance(), X_val=None if val_split is None else val_split.X,
              Xcov_val=None if val_split is None else val_split.covariance(), checkpoint=checkpoint)  # fmt: skip
    wall, cpu = time.perf_counter() - tick, time.process_time() - cpu_tick
    group = Group.current()  # under torchrun every process fits; rank 0 alone writes
    if group.writes:
        model.save(output_model)
    test_split = None if test is None else read_features(test)
    last = model.history_[-1]  # the last epoch's evaluation already scored the final parameters
    device = model._device
    metrics = FitMetrics(
        method=label or settings.method, n_components=n_components, seed=seed, tag=tag, config_hash=config_hash,
        settings=model.describe(), train_seconds=last["seconds"], kmeans_seconds=float(start["seconds"]),
        wall_seconds=wall, cpu_seconds=cpu, threads=torch.get_num_threads(), n_iter=model.n_iter_, converged=model.converged_, history=model.history_,
        covariance_mode=train_split.mode,
        device=str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        versions={"scalable_xd": scalable_xd.__version__, "torch": torch.__version__, "numpy": np.__version__,
                  "python": platform.python_version()},
        train=loglik_summary(last["train_loglik"], train_split),
        val=None if val_split is None else loglik_summary(last["val_loglik"], val_split),
        test=None if test_split is None else loglik_summary(model.score(test_split.X, test_split.covariance()),
                                                            test_split),
        true=truth_metrics(model, test_split, {ref["kind"]: ref for ref in map(_read_json, references)}),
    )  # fmt: skip
    if group.writes:
        metrics.write(output_metrics)
        if checkpoint:
            Path(checkpoint).unlink(missing_ok=True)
    log.info("%s K=%d seed=%d: train %.4f in %.1f s", settings.method, n_components, seed, last["train_loglik"],
             metrics.train_seconds)  # fmt: skip


def _read_json(path) -> dict:
    return json.loads(Path(path).read_text())


def reference(*, train, test, init, n_components: int, seed: int, kind: str, settings: FitSettings, output_metrics,
              threads: int = 0) -> None:  # fmt: skip
    """A reference fit for the truth metrics (see ``truth``): batch EM from the shared k-means init on the
    true values (``oracle``) or on the noisy values with their noise ignored (``noisy``)."""
    from .estimator import XDGMM
    from .gaia.storage import read_features
    from .truth import reference_data, require_truth, true_loglik

    _set_threads(threads)
    check_writable(output_metrics)
    start = read_init(init, n_components)
    train_split, test_split = read_features(train), read_features(test)
    test_true = require_truth(test_split, test)
    X, variances = reference_data(train_split, kind)
    model = XDGMM(n_components, **settings.as_dict(), random_state=seed, weights_init=start["weights"],
                  means_init=start["means"]).fit(X, variances)  # fmt: skip
    write_json(output_metrics, {
        "kind": kind, "n_components": n_components, "seed": seed, "test_true_loglik": true_loglik(model, test_true),
        "train_loglik": model.history_[-1]["train_loglik"], "train_seconds": model.history_[-1]["seconds"],
        "n_iter": model.n_iter_, "converged": model.converged_, "settings": model.describe(),
    })  # fmt: skip
    log.info("reference %s K=%d: after %d iterations", kind, n_components, model.n_iter_)
