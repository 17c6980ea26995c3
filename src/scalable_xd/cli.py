"""The ``scalable-xd`` command line: each subcommand is one step of the experiment DAG.

    scalable-xd mock      --n-rows N --seed S --output raw.parquet
    scalable-xd query     --n-rows N --out-dir resources/gaia_dr2 [--chunk-rows R] [--tap-url URL]
    scalable-xd features  --input RAW --out-dir DIR [--mode corrected|paper] [--split-seed S]
    scalable-xd kmeans    --train train.parquet --n-components K --seed S --output init.npz
    scalable-xd reference --train ... --test ... --init init.npz --kind oracle|noisy --output-metrics ...   (mock only)
    scalable-xd fit       --train ... --val ... --test ... --init init.npz --method M --output-model ... --output-metrics ...
    scalable-xd table / claims / plot-timing / plot-curves / plot-sky / plot-corner   (see ``report``)

Every output is written atomically; ``fit`` checkpoints each epoch and resumes from its checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("scalable_xd")


# ------------------------------------------------------------------------------------------- data steps

def _mock(args) -> None:
    from .gaia.mock import make_mock
    from .io import atomic_path

    frame = make_mock(args.n_rows, seed=args.seed)
    with atomic_path(args.output) as tmp:
        frame.to_parquet(tmp, index=False)
    log.info("wrote %d mock rows to %s", len(frame), args.output)


def _query(args) -> None:
    from .gaia.query import query_gaia, write_manifest

    paths = query_gaia(
        args.n_rows, args.out_dir, chunk_rows=args.chunk_rows, tap_url=args.tap_url, retries=args.retries,
        request_timeout=args.request_timeout, job_timeout=args.job_timeout,
    )  # fmt: skip
    if args.manifest:
        write_manifest(args.manifest, paths, n_rows=args.n_rows, tap_url=args.tap_url)
    log.info("%d chunks complete in %s", len(paths), args.out_dir)


def _features(args) -> None:
    from .gaia.features import write_feature_splits

    summary = write_feature_splits(args.input, args.out_dir, mode=args.mode, split_seed=args.split_seed)
    log.info("features: %s rows, bad rows repaired: %s", summary["rows"], summary["bad_rows"])


# ------------------------------------------------------------------------------------------- fitting steps

def _set_threads(threads: int) -> None:
    import torch

    if threads > 0:
        torch.set_num_threads(threads)


def _read_split(path):
    from .gaia.features import read_features

    return read_features(path)


def _kmeans(args) -> None:
    import torch

    from ._torch import resolve_device, resolve_dtype
    from .io import atomic_path
    from .fit.kmeans import minibatch_kmeans, weights_from_counts

    _set_threads(args.threads)
    _check_writable(args.output)
    X = _read_split(args.train).X
    device = resolve_device(args.device)
    tick = time.perf_counter()
    centres, counts = minibatch_kmeans(
        torch.as_tensor(X).to(resolve_dtype(args.dtype)), args.n_components, epochs=args.epochs,
        batch_size=args.batch_size, seed=args.seed, device=device,
    )  # fmt: skip
    seconds = time.perf_counter() - tick
    with atomic_path(args.output, suffix=".npz") as tmp:
        np.savez(tmp, weights=weights_from_counts(counts).numpy(), means=centres.double().cpu().numpy(), seconds=seconds)
    log.info("k-means K=%d seed=%d: %.1f s on %s", args.n_components, args.seed, seconds, device)


def _read_init(path, keys=("weights", "means")) -> dict:
    """The arrays of a k-means init file (``scalable-xd kmeans``), or a ValueError naming the file."""
    import zipfile

    try:
        with np.load(path, allow_pickle=False) as init:
            missing = [key for key in keys if key not in init.files]
            if missing:
                raise ValueError(f"{path} is not an init file written by `scalable-xd kmeans`: it lacks "
                                 f"{', '.join(missing)}")  # fmt: skip
            return {key: init[key] for key in init.files}
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as err:
        if str(err).startswith(str(path)):
            raise
        raise ValueError(f"{path} is not an init file written by `scalable-xd kmeans` (unreadable as .npz: "
                         f"{err.__class__.__name__})") from None  # fmt: skip


def _check_writable(*paths) -> None:
    """Fail before a long fit, not after it, when an output cannot be written (by creating and removing a
    file beside each)."""
    import tempfile

    for path in filter(None, paths):
        parent = Path(path).parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=parent):
                pass
        except OSError as err:
            raise OSError(f"cannot write {path}: {parent} is not a writable directory ({err.strerror or err})") from None


def _loglik_summary(mean_loglik: float, features) -> dict:
    """Mean log-likelihood per star as the paper defines it, and of the observed entries alone: each missing
    entry adds the same constant, so the mean of the latter is the former less that constant times the mean
    number of missing entries."""
    from .gaia.features import MISSING_LOGLIK_CONSTANT

    missing = float(features.n_missing.mean())
    return {
        "loglik": mean_loglik,
        "loglik_observed": mean_loglik - MISSING_LOGLIK_CONSTANT * missing,
        "n": len(features),
        "mean_missing_entries": missing,
    }


def _fit(args) -> None:
    import torch

    import scalable_xd

    from .estimator import XDGMM
    from .io import write_json
    from .truth import truth_metrics

    _set_threads(args.threads)
    _check_writable(args.output_model, args.output_metrics, args.checkpoint)
    init = _read_init(args.init, ("weights", "means", "seconds"))
    weights, means, kmeans_seconds = init["weights"], init["means"], float(init["seconds"])
    train, val = _read_split(args.train), _read_split(args.val)
    model = XDGMM(
        len(weights), args.method, batch_size=args.batch_size, epochs=args.epochs, step_size=args.step_size,
        step_schedule=args.step_schedule, step_decay=args.step_decay, lr=args.lr, lr_decay=args.lr_decay,
        decay_epoch=args.decay_epoch, sgd_scaling=args.sgd_scaling, w=args.w, tol=args.tol, device=args.device, dtype=args.dtype,
        compile=args.compile, random_state=args.seed, weights_init=weights, means_init=means, verbose=1,
    )  # fmt: skip
    tick = time.perf_counter()
    model.fit(train.X, train.covariance(), X_val=val.X, Xcov_val=val.covariance(), checkpoint=args.checkpoint)
    wall = time.perf_counter() - tick
    model.save(args.output_model)

    metrics = {
        "method": args.method,
        "n_components": int(len(weights)),
        "seed": args.seed,
        "tag": args.tag,
        "config_hash": args.config_hash,
        "settings": model.describe(),
        "train_seconds": model.history_[-1]["seconds"],
        "kmeans_seconds": kmeans_seconds,
        "wall_seconds": wall,
        "n_iter": model.n_iter_,
        "converged": model.converged_,
        "history": model.history_,
        "covariance_mode": train.mode,
        "device": str(model._device) + (f" ({torch.cuda.get_device_name(model._device)})" if model._device.type == "cuda" else ""),
        "versions": {"scalable_xd": scalable_xd.__version__, "torch": torch.__version__, "numpy": np.__version__,
                     "python": platform.python_version()},
        # The last epoch's evaluation already scored the final parameters on train and val.
        "train": _loglik_summary(model.history_[-1]["train_loglik"], train),
        "val": _loglik_summary(model.history_[-1]["val_loglik"], val),
    }  # fmt: skip
    if args.test:
        test = _read_split(args.test)
        metrics["test"] = _loglik_summary(model.score(test.X, test.covariance()), test)
    references = {}
    for path in args.reference or []:
        ref = json.loads(Path(path).read_text())
        references[ref["kind"]] = ref
    metrics["true"] = truth_metrics(model, test if args.test else None, references)
    write_json(args.output_metrics, metrics)
    if args.checkpoint:
        Path(args.checkpoint).unlink(missing_ok=True)
    log.info("%s K=%d seed=%d: val %.4f in %.1f s", args.method, len(weights), args.seed, metrics["val"]["loglik"],
             metrics["train_seconds"])  # fmt: skip


def _reference(args) -> None:
    """A reference fit for the truth metrics (see ``truth``): batch EM from the shared k-means init on the
    true values (``oracle``) or on the noisy values with their noise ignored (``noisy``)."""
    from .estimator import XDGMM
    from .io import write_json
    from .truth import reference_data, require_truth, true_loglik

    _set_threads(args.threads)
    _check_writable(args.output_metrics)
    init = _read_init(args.init)
    weights, means = init["weights"], init["means"]
    train, test = _read_split(args.train), _read_split(args.test)
    test_true = require_truth(test, args.test)
    X, variances = reference_data(train, args.kind)
    model = XDGMM(
        len(weights), "em", epochs=args.epochs, tol=args.tol, w=args.w, device=args.device, dtype=args.dtype,
        compile=args.compile, random_state=args.seed, weights_init=weights, means_init=means, verbose=1,
    )  # fmt: skip
    model.fit(X, variances)
    metrics = {
        "kind": args.kind,
        "n_components": int(len(weights)),
        "seed": args.seed,
        "test_true_loglik": true_loglik(model, test_true),
        "train_loglik": model.history_[-1]["train_loglik"],
        "train_seconds": model.history_[-1]["seconds"],
        "n_iter": model.n_iter_,
        "converged": model.converged_,
        "settings": model.describe(),
    }
    write_json(args.output_metrics, metrics)
    log.info("reference %s K=%d: test true log-likelihood %.4f after %d iterations", args.kind, len(weights),
             metrics["test_true_loglik"], model.n_iter_)  # fmt: skip


# ------------------------------------------------------------------------------------------- reports

def _table(args) -> None:
    from .report.tables import write_loglik_table

    write_loglik_table(args.metrics, args.output_prefix)


def _claims(args) -> None:
    from .report.claims import write_claims

    write_claims(args.metrics, args.output, device_note=args.device_note)


def _plot_timing(args) -> None:
    from .report.figures import plot_timing_vs_k

    plot_timing_vs_k(args.metrics, args.output)


def _plot_curves(args) -> None:
    from .report.figures import plot_training_curves

    plot_training_curves(args.metrics, args.output, n_components=args.n_components)


def _plot_sky(args) -> None:
    from .report.figures import plot_sky_density

    plot_sky_density(args.model, args.data, args.output, n_samples=args.n_samples, seed=args.seed)


def _plot_corner(args) -> None:
    from .report.figures import plot_corner

    plot_corner(args.model, args.data, args.output, n_samples=args.n_samples, seed=args.seed)


# ------------------------------------------------------------------------------------------- parser

def _count(minimum: int):
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


POSITIVE, NON_NEGATIVE = _count(1), _count(0)

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scalable-xd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("mock", help="write a Gaia-DR2-like mock catalogue (Parquet)")
    p.add_argument("--n-rows", type=POSITIVE, required=True)
    p.add_argument("--seed", type=NON_NEGATIVE, default=0)
    p.add_argument("--output", required=True)
    p.set_defaults(run=_mock)

    p = sub.add_parser("query", help="download the Gaia DR2 subset random_index < N (resumable)")
    p.add_argument("--n-rows", type=POSITIVE, required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--chunk-rows", type=POSITIVE, default=200_000)
    p.add_argument("--tap-url", default=None, help="TAP server root (default: the ESA Gaia archive)")
    p.add_argument("--retries", type=NON_NEGATIVE, default=5)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per HTTP request")
    p.add_argument("--job-timeout", type=float, default=5400.0,
                   help="seconds one attempt at a chunk may take, from launch to the last byte of the result")  # fmt: skip
    p.add_argument("--manifest", default=None, help="JSON listing the chunk files, written when all are done")
    p.set_defaults(run=_query)

    p = sub.add_parser("features", help="features, compact noise covariances and the 80/10/10 split")
    p.add_argument("--input", required=True,
                   help="raw catalogue: a Parquet file, a directory of chunks, or a query manifest (.json)")  # fmt: skip
    p.add_argument("--out-dir", required=True)
    p.add_argument("--mode", choices=["corrected", "paper"], default="corrected")
    p.add_argument("--split-seed", type=NON_NEGATIVE, default=0)
    p.set_defaults(run=_features)

    p = sub.add_parser("kmeans", help="minibatch k-means initial weights and means")
    p.add_argument("--train", required=True)
    p.add_argument("--n-components", type=POSITIVE, required=True)
    p.add_argument("--seed", type=NON_NEGATIVE, default=0)
    p.add_argument("--epochs", type=POSITIVE, default=10)
    p.add_argument("--batch-size", type=POSITIVE, default=500)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=NON_NEGATIVE, default=0, help="CPU threads for torch (0: torch's default)")
    p.add_argument("--output", required=True)
    p.set_defaults(run=_kmeans)

    p = sub.add_parser("fit", help="fit one model and write its parameters and metrics")
    for name in ("train", "val", "init", "output-model", "output-metrics"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--test", default=None)
    p.add_argument("--method", choices=["em", "minibatch_em", "sgd"], required=True)
    p.add_argument("--seed", type=NON_NEGATIVE, default=0)
    p.add_argument("--epochs", type=POSITIVE, default=20)
    p.add_argument("--batch-size", type=POSITIVE, default=500)
    p.add_argument("--step-size", type=float, default=0.1, help="minibatch EM's first step (the paper: 0.01)")
    p.add_argument("--step-schedule", choices=["step", "cappe_moulines"], default="cappe_moulines",
                   help="minibatch EM: (t0 + t)^-kappa from --step-size, or the paper's --step-size halved once")  # fmt: skip
    p.add_argument("--step-decay", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--lr-decay", type=float, default=0.1)
    p.add_argument("--sgd-scaling", choices=["spread", "none"], default="none",
                   help="SGD parameters in the features' own units (the paper) or in units of each feature's spread")  # fmt: skip
    p.add_argument("--decay-epoch", type=NON_NEGATIVE, default=10)
    p.add_argument("--w", type=float, default=1e-3)
    p.add_argument("--tol", type=float, default=None, help="batch-EM tolerance (default: run all epochs)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compile", action="store_true", help="fuse the statistics pass with torch.compile")
    p.add_argument("--threads", type=NON_NEGATIVE, default=0, help="CPU threads for torch (0: torch's default)")
    p.add_argument("--checkpoint", default=None, help="resume from this file if present; removed once the fit is saved")
    p.add_argument("--tag", default=None, help="free text recorded in the metrics (e.g. the config name)")
    p.add_argument("--config-hash", default=None)
    p.add_argument("--reference", nargs="*", default=None,
                   help="reference metrics (scalable-xd reference) for the truth metrics' gap closed")  # fmt: skip
    p.set_defaults(run=_fit)

    p = sub.add_parser("reference", help="a reference fit for the truth metrics (mock data only)")
    for name in ("train", "test", "init", "output-metrics"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--kind", choices=["oracle", "noisy"], required=True)
    p.add_argument("--seed", type=NON_NEGATIVE, default=0)
    p.add_argument("--epochs", type=POSITIVE, default=100, help="batch-EM iterations at most")
    p.add_argument("--tol", type=float, default=1e-5, help="stop once an iteration gains less (per star)")
    p.add_argument("--w", type=float, default=1e-3)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float64", help="float64: with no noise, float32 sums can miss a nearly "
                   "singular scatter by more than the regularisation")  # fmt: skip
    p.add_argument("--compile", action="store_true")
    p.add_argument("--threads", type=NON_NEGATIVE, default=0)
    p.set_defaults(run=_reference)

    p = sub.add_parser("table", help="Table 1: log-likelihoods per method and K (csv, md, tex)")
    p.add_argument("--metrics", nargs="+", required=True)
    p.add_argument("--output-prefix", required=True, help="e.g. results/demo/tables/loglik")
    p.set_defaults(run=_table)

    p = sub.add_parser("claims", help="the paper's claims with their verdicts on this run (Markdown)")
    p.add_argument("--metrics", nargs="+", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--device-note", default=None, help="where the timings were taken, in words")
    p.set_defaults(run=_claims)

    p = sub.add_parser("plot-timing", help="Figure 1 right: training time against K")
    p.add_argument("--metrics", nargs="+", required=True)
    p.add_argument("--output", nargs="+", required=True, help="one or more image files (.png, .pdf)")
    p.set_defaults(run=_plot_timing)

    p = sub.add_parser("plot-curves", help="Figure 1 left: training log-likelihood against rescaled epoch")
    p.add_argument("--metrics", nargs="+", required=True)
    p.add_argument("--n-components", type=POSITIVE, required=True)
    p.add_argument("--output", nargs="+", required=True)
    p.set_defaults(run=_plot_curves)

    for name, run, what in (("plot-sky", _plot_sky, "Figure 2: sky density of model samples beside the data"),
                            ("plot-corner", _plot_corner, "corner plot of model samples over the data")):  # fmt: skip
        p = sub.add_parser(name, help=what)
        p.add_argument("--model", required=True)
        p.add_argument("--data", required=True, help="a features file (e.g. test.parquet)")
        p.add_argument("--n-samples", type=POSITIVE, default=100_000)
        p.add_argument("--seed", type=NON_NEGATIVE, default=0)
        p.add_argument("--output", nargs="+", required=True)
        p.set_defaults(run=run)
    return parser


def _version() -> str:
    from . import __version__

    return __version__


# Arguments that name files a subcommand reads; each must exist before any work starts.
INPUT_ARGUMENTS = ("input", "train", "val", "test", "init", "metrics", "model", "data", "reference")


def _missing_inputs(args) -> list[str]:
    missing = []
    for name in INPUT_ARGUMENTS:
        value = getattr(args, name, None)
        for path in [value] if isinstance(value, str) else value or []:
            if not Path(path).exists():
                missing.append(f"{path} (--{name})")
    return missing


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    missing = _missing_inputs(args)
    if missing:
        log.error("input file%s missing: %s", "s" if len(missing) > 1 else "", ", ".join(missing))
        return 1
    try:
        args.run(args)
    except (ValueError, RuntimeError, OSError) as err:
        log.error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
