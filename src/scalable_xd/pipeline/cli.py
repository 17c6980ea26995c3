"""The ``scalable-xd`` command line: one subcommand per step of the experiment DAG (see ``steps``)::

    scalable-xd mock      --n-rows N --seed S --output raw.parquet
    scalable-xd query     --n-rows N --out-dir resources/gaia_dr2 [--chunk-rows R] [--tap-url URL]
    scalable-xd bulk-index / bulk-check / hats-import   (all of DR2 from ESA's bulk files, see ``gaia.bulk``)
    scalable-xd features  --input RAW --out-dir DIR [--mode corrected|paper] [--split-seed S]
    scalable-xd kmeans    --train train.parquet --n-components K --seed S --output init.npz
    scalable-xd reference --train ... --test ... --init init.npz --n-components K --kind oracle|noisy ...
    scalable-xd fit       --train ... [--val ...] [--test ...] --init init.npz --n-components K --method M ...
    scalable-xd denoise / calibrate / plot-denoised   (each star's posterior true values, see ``denoise``)
    scalable-xd errors    --model model.npz --train train.parquet --output-json J --output-md M
    scalable-xd table / claims / plot-timing / plot-curves / plot-sky / plot-corner   (see ``report``)

The options of ``fit``, ``reference`` and ``kmeans`` come from ``settings`` (their help, defaults and
choices); ``scalable-xd <step> --help`` lists them. Every bad input ends in one error line and status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from ..fit.methods import SETTING_CHOICES, setting_help
from ..settings import FitSettings, KMeansSettings
from . import steps
from .gpu_slots import job_device
from .truth import REFERENCES

log = logging.getLogger("scalable_xd")


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


def _optional(parse):
    """``parse``, with "none" or "null" read as None."""

    def parse_optional(text: str):
        return None if text.lower() in ("none", "null") else parse(text)

    return parse_optional


def _add_settings(p, cls, *, skip=(), prefix="", defaults=None) -> None:
    """An option per field of a settings dataclass: its help line, its default (``defaults`` overrides) and
    its choices (the method table's and the kernel's where they own them); integers must be at least the
    field's lower bound."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta, default = f.metadata, (defaults or {}).get(f.name, f.default)
        flag = f"--{prefix}{f.name.replace('_', '-')}"
        kind = str(f.type).split("|")[0].strip()
        # argparse formats help with %: a literal one (in "90% of") must be doubled
        text = setting_help(f.name, meta["help"]) if cls is FitSettings else meta["help"]
        help_text = f"{text} (default: {default})".replace("%", "%%")
        if kind == "bool":
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            parse = {"int": _count(meta["low"]) if meta["low"] is not None else int, "float": float, "str": str}[kind]
            if meta["nullable"]:
                p.add_argument(
                    flag, dest=f.name, type=_optional(parse), default=default, metavar="X|none", help=help_text
                )
            else:
                choices = SETTING_CHOICES.get(f.name, meta["choices"]) if cls is FitSettings else meta["choices"]
                p.add_argument(flag, dest=f.name, type=parse, default=default, choices=choices, help=help_text)


def _settings_of(args, cls, **fixed):
    """The settings ``cls`` from the parsed options, with ``fixed`` values in place of any of them."""
    return cls(**{**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}, **fixed})


# ------------------------------------------------------------------------------------------- the steps


def _mock(args) -> None:
    steps.mock(args.n_rows, args.seed, args.output)


def _query(args) -> None:
    steps.query(
        args.n_rows,
        args.out_dir,
        args.manifest,
        chunk_rows=args.chunk_rows,
        tap_url=args.tap_url,
        retries=args.retries,
        request_timeout=args.request_timeout,
        job_timeout=args.job_timeout,
    )


def _bulk_index(args) -> None:
    steps.bulk_index(args.url, args.output, args.n_files)


def _bulk_check(args) -> None:
    steps.bulk_check(args.input, args.index, args.output)


def _hats_import(args) -> None:
    steps.hats_catalogue(
        args.index,
        args.csv_dir,
        args.output,
        pixel_threshold=args.pixel_threshold,
        highest_order=args.highest_order,
        workers=args.workers,
    )


def _features(args) -> None:
    steps.features(args.input, args.out_dir, args.mode, args.split_seed)


def _kmeans(args) -> None:
    settings = KMeansSettings(epochs=args.epochs, batch_size=args.batch_size)
    steps.kmeans(
        args.train,
        args.n_components,
        args.seed,
        settings,
        args.device,
        args.dtype,
        args.output,
        threads=args.threads,
        max_rows=args.max_rows,
    )


def _fit(args) -> None:
    from ..fit.parallel import process_group  # torch: not imported for --help

    with process_group(args.device, args.group_timeout) as device:
        steps.fit(
            train=args.train,
            val=args.val,
            test=args.test,
            init=args.init,
            n_components=args.n_components,
            seed=args.seed,
            settings=_settings_of(args, FitSettings, verbose=2, device=device),
            output_model=args.output_model,
            output_metrics=args.output_metrics,
            checkpoint=args.checkpoint,
            references=args.reference or (),
            tag=args.tag,
            config_hash=args.config_hash,
            threads=args.threads,
            label=args.label,
            stream_window=args.stream_window,
            checkpoint_every=args.checkpoint_every,
        )


def _reference(args) -> None:
    settings = dataclasses.replace(
        steps.REFERENCE,
        epochs=args.epochs,
        tol=args.tol,
        w=args.w,
        w_scale=args.w_scale,
        device=args.device,
        dtype=args.dtype,
        backend=args.backend,
        acceleration=args.acceleration,
    )
    steps.reference(
        train=args.train,
        test=args.test,
        init=args.init,
        n_components=args.n_components,
        seed=args.seed,
        kind=args.kind,
        settings=settings,
        output_metrics=args.output_metrics,
        threads=args.threads,
    )


def _table(args) -> None:
    from .report.tables import write_loglik_table

    write_loglik_table(args.metrics, args.output_prefix)


def _claims(args) -> None:
    from .denoise import read_calibration
    from .report.claims import write_claims

    calibration = None if args.calibration is None else read_calibration(args.calibration)
    write_claims(args.metrics, args.output, device_note=args.device_note, calibration=calibration)


def _plot_timing(args) -> None:
    from .report.figures import plot_timing_vs_k

    plot_timing_vs_k(args.metrics, args.output)


def _plot_curves(args) -> None:
    from .report.figures import plot_training_curves

    plot_training_curves(args.metrics, args.output, n_components=args.n_components)


def _plot_sky(args) -> None:
    from .report.sky import plot_sky_density

    plot_sky_density(args.model, args.data, args.output, n_samples=args.n_samples, seed=args.seed, frame=args.frame)


def _plot_corner(args) -> None:
    from .report.figures import plot_corner

    plot_corner(args.model, args.data, args.output, n_samples=args.n_samples, seed=args.seed)


def _denoise(args) -> None:
    from .denoise import denoise

    denoise(args.model, args.data, args.output, batch_rows=args.batch_rows)


def _calibrate(args) -> None:
    from ..io import write_json, write_text
    from .denoise import calibration, calibration_markdown

    result = calibration(args.denoised)
    write_json(args.output_json, result)
    write_text(args.output_md, calibration_markdown(result))


def _errors(args) -> None:
    from ..io import write_json, write_text
    from .parameter_errors import parameter_errors, parameter_errors_markdown

    result = parameter_errors(args.model, args.train, args.n_folds, args.seed, args.max_iter, args.tol)
    write_json(args.output_json, result)
    write_text(args.output_md, parameter_errors_markdown(result))


def _plot_denoised(args) -> None:
    from .denoise import read_calibration
    from .report.denoised import plot_denoised

    plot_denoised(args.denoised, read_calibration(args.calibration), args.output)


# ------------------------------------------------------------------------------------------- parser


def _threads(p) -> None:
    p.add_argument("--threads", type=NON_NEGATIVE, default=0, help="CPU threads for torch (default: 0, torch's own)")


def _seed(p, what: str) -> None:
    p.add_argument("--seed", type=NON_NEGATIVE, default=0, help=f"{what} (default: 0)")


def build_parser() -> argparse.ArgumentParser:
    from .gaia.schema import QUERY_DEFAULTS as query
    from .report.style import SAMPLES

    parser = argparse.ArgumentParser(
        prog="scalable-xd", description=_PLAIN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("mock", help="write a Gaia-DR2-like mock catalogue (Parquet)")
    p.add_argument("--n-rows", type=POSITIVE, required=True, help="rows (stars with random_index < n-rows)")
    _seed(p, "the mock's random seed")
    p.add_argument("--output", required=True, help="the Parquet file to write")
    p.set_defaults(run=_mock)

    p = sub.add_parser("query", help="download the Gaia DR2 subset random_index < N (resumable)")
    p.add_argument("--n-rows", type=POSITIVE, required=True, help="rows with random_index < n-rows")
    p.add_argument("--out-dir", required=True, help="folder of the chunk files (a rerun fetches what is missing)")
    p.add_argument(
        "--chunk-rows",
        type=POSITIVE,
        default=query["chunk_rows"],
        help=f"rows per archive job (default: {query['chunk_rows']})",
    )
    p.add_argument(
        "--tap-url",
        default=None,
        help="TAP server root; user:password@ goes as HTTP Basic auth (default: the ESA Gaia archive)",
    )
    p.add_argument(
        "--retries",
        type=NON_NEGATIVE,
        default=query["retries"],
        help=f"retries per chunk (default: {query['retries']})",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=query["request_timeout"],
        help=f"seconds any socket operation may wait (default: {query['request_timeout']:g})",
    )
    p.add_argument(
        "--job-timeout",
        type=float,
        default=query["job_timeout"],
        help="seconds one attempt at a chunk may take, from launch to the last byte of the result "
        f"(default: {query['job_timeout']:g})",
    )
    p.add_argument("--manifest", default=None, help="JSON listing the chunk files, written when all are done")
    p.set_defaults(run=_query)

    p = sub.add_parser("bulk-index", help="list ESA's DR2 bulk files and their MD5 sums (MD5SUM.txt)")
    p.add_argument("--url", required=True, help="the index's URL (.../gaia_source/csv/MD5SUM.txt)")
    p.add_argument("--n-files", type=NON_NEGATIVE, default=0, help="keep the first N files only (default: 0, all)")
    p.add_argument("--output", required=True, help="the index to write (same format)")
    p.set_defaults(run=_bulk_index)

    p = sub.add_parser("bulk-check", help="keep a downloaded bulk file once its MD5 sum matches the index")
    p.add_argument("--input", required=True, help="the downloaded .csv.gz")
    p.add_argument("--index", required=True, help="the index (scalable-xd bulk-index)")
    p.add_argument("--output", required=True, help="where the checked file goes (its name is looked up in the index)")
    p.set_defaults(run=_bulk_check)

    p = sub.add_parser("hats-import", help="convert checked bulk files into one HATS catalogue (hats-import)")
    p.add_argument("--index", required=True, help="the index listing the files (scalable-xd bulk-index)")
    p.add_argument("--csv-dir", required=True, help="the folder of the checked files")
    p.add_argument("--output", required=True, help="the catalogue's folder (must not exist)")
    p.add_argument(
        "--pixel-threshold",
        type=POSITIVE,
        default=1_000_000,
        help="most stars in one HEALPix partition (default: 1000000)",
    )
    p.add_argument("--highest-order", type=NON_NEGATIVE, default=10, help="finest HEALPix order (default: 10)")
    p.add_argument("--workers", type=POSITIVE, default=1, help="dask worker processes (default: 1)")
    p.set_defaults(run=_hats_import)

    p = sub.add_parser("features", help="features, compact noise covariances and the 80/10/10 split")
    p.add_argument(
        "--input",
        required=True,
        help="raw catalogue: a Parquet file, a directory of chunks, a HATS catalogue or a query manifest (.json)",
    )
    p.add_argument("--out-dir", required=True, help="folder for train/val/test.parquet and features.json")
    p.add_argument(
        "--mode",
        choices=["corrected", "paper"],
        default="corrected",
        help="corrected units and missing colours, or what the paper's code did (default: corrected)",
    )
    p.add_argument("--split-seed", type=NON_NEGATIVE, default=0, help="seed of the 80/10/10 split (default: 0)")
    p.set_defaults(run=_features)

    p = sub.add_parser("kmeans", help="minibatch k-means initial weights and means")
    p.add_argument("--train", required=True, help="a features file (train.parquet)")
    p.add_argument("--n-components", type=POSITIVE, required=True, help="K")
    _seed(p, "k-means seed")
    _add_settings(p, KMeansSettings)
    _add_settings(p, FitSettings, skip=set(FitSettings.defaults()) - {"device", "dtype"})
    _threads(p)
    p.add_argument(
        "--max-rows",
        type=NON_NEGATIVE,
        default=0,
        help="k-means on this many training stars chosen by the seed (default: 0, all of them)",
    )
    p.add_argument("--output", required=True, help="the init file (.npz: weights, means, seconds)")
    p.set_defaults(run=_kmeans)

    p = sub.add_parser("fit", help="fit one model and write its parameters and metrics")
    p.add_argument("--train", required=True, help="a features file (train.parquet)")
    p.add_argument("--val", default=None, help="a features file scored after every epoch")
    p.add_argument("--test", default=None, help="a features file scored once at the end")
    p.add_argument("--init", required=True, help="the k-means init file (scalable-xd kmeans)")
    p.add_argument("--n-components", type=POSITIVE, required=True, help="K (checked against the init file)")
    _seed(p, "the fit's seed (batch order)")
    _add_settings(p, FitSettings, skip={"verbose"})
    _threads(p)
    p.add_argument("--checkpoint", default=None, help="resume from this file if present; removed once the fit is saved")
    p.add_argument(
        "--checkpoint-every",
        type=NON_NEGATIVE,
        default=0,
        metavar="BATCHES",
        help="also checkpoint every BATCHES batches inside an epoch (default: 0, at epochs' ends only)",
    )
    p.add_argument("--output-model", required=True, help="the model (.npz, XDGMM.load reads it)")
    p.add_argument("--output-metrics", required=True, help="the metrics record (JSON, see report.metrics)")
    p.add_argument(
        "--label",
        default=None,
        help="the name the fit is reported under in tables and figures (a workflow variant; default: the method)",
    )
    p.add_argument(
        "--stream-window",
        type=NON_NEGATIVE,
        default=0,
        metavar="ROWS",
        help="stream the splits from disk, shuffling within windows of ROWS rows, instead of loading them "
        "(0: load; --train etc. may then be folders of Parquet files or HATS catalogues)",
    )
    p.add_argument(
        "--group-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="under torchrun: how long a process waits for the others in one exchange before the fit fails "
        "(default: 600)",
    )
    p.add_argument("--tag", default=None, help="free text recorded in the metrics (e.g. the config name)")
    p.add_argument("--config-hash", default=None, help="recorded in the metrics")
    p.add_argument(
        "--reference",
        nargs="*",
        default=None,
        help="reference metrics (scalable-xd reference) for the truth metrics' gap closed",
    )
    p.set_defaults(run=_fit)

    p = sub.add_parser("reference", help="a reference fit for the truth metrics (mock data only)")
    for name, what in (
        ("train", "a features file with true values"),
        ("test", "the split scored on its true values"),
        ("init", "the k-means init file"),
        ("output-metrics", "the reference's metrics (JSON)"),
    ):
        p.add_argument(f"--{name}", required=True, help=what)
    p.add_argument("--n-components", type=POSITIVE, required=True, help="K (checked against the init file)")
    p.add_argument(
        "--kind",
        choices=REFERENCES,
        required=True,
        help="fit the true values, the noisy ones with the noise ignored, or XD itself to convergence",
    )
    _seed(p, "the reference's seed")
    reference = steps.REFERENCE.as_dict()
    _add_settings(
        p,
        FitSettings,
        skip=set(FitSettings.defaults())
        - {"epochs", "tol", "w", "w_scale", "device", "dtype", "backend", "acceleration"},
        defaults=reference,
    )
    _threads(p)
    p.set_defaults(run=_reference)

    p = sub.add_parser("table", help="Table 1: log-likelihoods per method and K (csv, md, tex)")
    p.add_argument("--metrics", nargs="+", required=True, help="metrics files of the fits")
    p.add_argument("--output-prefix", required=True, help="e.g. results/demo/tables/loglik")
    p.set_defaults(run=_table)

    p = sub.add_parser("claims", help="the paper's claims with their verdicts on this run (Markdown)")
    p.add_argument("--metrics", nargs="+", required=True, help="metrics files of the fits")
    p.add_argument("--output", required=True, help="the Markdown file")
    p.add_argument("--device-note", default=None, help="where the timings were taken, in words")
    p.add_argument("--calibration", default=None, help="the denoised test stars' calibration (claims 9 and 10)")
    p.set_defaults(run=_claims)

    p = sub.add_parser("plot-timing", help="Figure 1 right: training time against K")
    p.add_argument("--metrics", nargs="+", required=True, help="metrics files of the fits")
    p.add_argument("--output", nargs="+", required=True, help="one or more image files (.png, .pdf)")
    p.set_defaults(run=_plot_timing)

    p = sub.add_parser("plot-curves", help="Figure 1 left: training log-likelihood against rescaled epoch")
    p.add_argument("--metrics", nargs="+", required=True, help="metrics files of the fits")
    p.add_argument("--n-components", type=POSITIVE, required=True, help="the K whose curves are drawn")
    p.add_argument("--output", nargs="+", required=True, help="one or more image files (.png, .pdf)")
    p.set_defaults(run=_plot_curves)

    p = sub.add_parser("denoise", help="each star's posterior true values under a model (Parquet)")
    p.add_argument("--model", required=True, help="a model file (XDGMM.save)")
    p.add_argument("--data", required=True, help="a features file (e.g. test.parquet)")
    p.add_argument("--output", required=True, help="the denoised catalogue (.parquet)")
    p.add_argument(
        "--batch-rows", type=POSITIVE, default=65_536, help="stars read and written at a time (default: 65,536)"
    )
    p.set_defaults(run=_denoise)

    p = sub.add_parser("errors", help="a model's parameter errors by the jackknife over its training data")
    p.add_argument("--model", required=True, help="a model file (XDGMM.save)")
    p.add_argument("--train", required=True, help="the features file it was fitted to (train.parquet)")
    p.add_argument("--n-folds", type=_count(2), default=10, help="groups left out in turn (default: 10)")
    p.add_argument("--max-iter", type=POSITIVE, default=200, help="batch-EM iterations a refit (default: 200)")
    p.add_argument(
        "--tol", type=float, default=1e-8, help="a refit converges once an iteration gains less (default: 1e-08)"
    )
    _seed(p, "the seed that splits the groups")
    p.add_argument("--output-json", required=True, help="every component with its errors (.json)")
    p.add_argument("--output-md", required=True, help="the heaviest components' table (.md)")
    p.set_defaults(run=_errors)

    p = sub.add_parser("calibrate", help="the denoised values' calibration against the truth (mock data)")
    p.add_argument("--denoised", required=True, help="a denoised catalogue (scalable-xd denoise)")
    p.add_argument("--output-json", required=True, help="the calibration (.json)")
    p.add_argument("--output-md", required=True, help="its table (.md)")
    p.set_defaults(run=_calibrate)

    p = sub.add_parser(
        "plot-denoised", help="colour-magnitude diagrams, pulls and precision gains of the denoised values"
    )
    p.add_argument("--denoised", required=True, help="a denoised catalogue (scalable-xd denoise)")
    p.add_argument("--calibration", required=True, help="its calibration (scalable-xd calibrate)")
    p.add_argument("--output", nargs="+", required=True, help="one or more image files (.png, .pdf)")
    p.set_defaults(run=_plot_denoised)

    for name, run, what in (
        ("plot-sky", _plot_sky, "Figure 2: sky density of model samples beside the data"),
        ("plot-corner", _plot_corner, "corner plot of model samples over the data"),
    ):
        p = sub.add_parser(name, help=what)
        p.add_argument("--model", required=True, help="a model file (XDGMM.save)")
        p.add_argument("--data", required=True, help="a features file (e.g. test.parquet)")
        p.add_argument("--n-samples", type=POSITIVE, default=SAMPLES, help=f"model samples (default: {SAMPLES})")
        _seed(p, "the sampling seed")
        p.add_argument("--output", nargs="+", required=True, help="one or more image files (.png, .pdf)")
        p.set_defaults(run=run)
        if name == "plot-sky":
            p.add_argument(
                "--frame",
                choices=["icrs", "galactic"],
                default="icrs",
                help="sky coordinates: ra, dec or Galactic l, b (default: icrs)",
            )
    return parser


# The module's docstring is reStructuredText (the docs' CLI page renders it); a terminal gets it unmarked.
_PLAIN_DOC = __doc__.replace("::\n", ":\n").replace("``", "")


def _version() -> str:
    from .. import __version__

    return __version__


# Arguments that name files a subcommand reads; each must exist before any work starts.
INPUT_ARGUMENTS = (
    "input",
    "train",
    "val",
    "test",
    "init",
    "metrics",
    "model",
    "data",
    "reference",
    "index",
    "csv_dir",
    "denoised",
    "calibration",
)


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
        if getattr(args, "device", None) is not None:
            args.device = job_device(args.device)  # a GPU of its own among several: see gpu_slots
        args.run(args)
    except (ValueError, RuntimeError, OSError) as err:
        log.error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
