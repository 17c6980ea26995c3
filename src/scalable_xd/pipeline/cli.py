"""The ``scalable-xd`` command line: one subcommand per step of the experiment DAG (see ``steps``)::

    scalable-xd mock      --n-rows N --seed S --output raw.parquet
    scalable-xd query     --n-rows N --out-dir resources/gaia_dr2 [--chunk-rows R] [--tap-url URL]
    scalable-xd bulk-index / bulk-check / hats-import   (all of DR2 from ESA's bulk files, see ``gaia.bulk``)
    scalable-xd features  --input RAW --out-dir DIR [--mode corrected|paper] [--split-seed S]
    scalable-xd kmeans    --train train.parquet --n-components K --seed S --output init.npz
    scalable-xd reference --train ... --test ... --init init.npz --n-components K --kind oracle|noisy ...
    scalable-xd fit       --train ... [--val ...] [--test ...] --init init.npz --n-components K --method M ...
    scalable-xd fit-table --input TABLE --columns A B ... [--errors A_ERR B_ERR ...] --n-components K --output M
    scalable-xd denoise / calibrate / plot-denoised   (each star's posterior true values, see ``denoise``)
    scalable-xd errors    --model model.npz --train train.parquet --output-json J --output-md M
    scalable-xd table / claims / plot-timing / plot-curves / plot-sky / plot-corner / plot-selection   (see ``report``)

Each subcommand is a row of one table (``commands``): its options, and the ``steps`` function it runs,
which gets every option by name. The options of ``fit``, ``reference`` and ``kmeans`` come from
``settings`` (their help, defaults and choices); ``scalable-xd <step> --help`` lists them. Every bad input
ends in one error line and status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
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
                metavar = ("TEXT" if kind == "str" else "X") + "|none"
                p.add_argument(
                    flag, dest=f.name, type=_optional(parse), default=default, metavar=metavar, help=help_text
                )
            else:
                choices = SETTING_CHOICES.get(f.name, meta["choices"]) if cls is FitSettings else meta["choices"]
                p.add_argument(flag, dest=f.name, type=parse, default=default, choices=choices, help=help_text)


def _settings_of(args, cls, **fixed):
    """The settings ``cls`` from the parsed options, with ``fixed`` values in place of any of them."""
    return cls(**{**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}, **fixed})


# ------------------------------------------------------------------------------------------- the steps


@dataclass(frozen=True)
class Command:
    """A subcommand: what it does, its options (``(flags, add_argument keywords)`` pairs) and what runs it:
    the ``steps`` function of that name, given every option under its destination's name (or the one
    ``rename`` gives); or ``run``, given the parsed arguments, where the options make settings. ``settings``
    adds the options of the settings' fields (``_add_settings``'s keywords per settings class)."""

    name: str
    help: str
    options: tuple = ()
    step: str | None = None
    rename: dict = field(default_factory=dict)
    run: Callable | None = None
    settings: tuple = ()


def option(*flags: str, **keywords) -> tuple:
    return flags, keywords


def _destination(flags, keywords) -> str:
    return keywords.get("dest") or flags[0].lstrip("-").replace("-", "_")


def _runner(command: Command) -> Callable:
    """What runs ``command`` from the parsed arguments: its ``run``, or its step given every option by name."""
    if command.run is not None:
        return command.run
    step = getattr(steps, str(command.step))

    def run_step(args) -> None:
        given = {_destination(*o): getattr(args, _destination(*o)) for o in command.options}
        step(**{command.rename.get(name, name): value for name, value in given.items()})

    return run_step


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


def _verbosity(args) -> int:
    """A fit's ``verbose`` from the command line: its epoch lines (which ``--quiet`` silences with every
    INFO line), and a progress bar per epoch only where stderr is a terminal (a log file would keep every
    bar's first frame)."""
    return 2 if sys.stderr.isatty() and not args.quiet else 1


def _fit(args) -> None:
    from ..fit.parallel import process_group  # torch: not imported for --help

    with process_group(args.device, args.group_timeout) as device:
        steps.fit(
            train=args.train,
            val=args.val,
            test=args.test,
            init=args.init,
            n_components=args.n_components,
            seeds=args.seed,
            settings=_settings_of(args, FitSettings, verbose=_verbosity(args), device=device),
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
    given = {name: getattr(args, name) for name in REFERENCE_SETTINGS}
    steps.reference(
        train=args.train,
        test=args.test,
        init=args.init,
        n_components=args.n_components,
        seed=args.seed,
        kind=args.kind,
        settings=dataclasses.replace(steps.REFERENCE, **given),
        output_metrics=args.output_metrics,
        threads=args.threads,
    )


# The reference fit's settings that its subcommand takes (the others are ``steps.REFERENCE``'s).
REFERENCE_SETTINGS = ("epochs", "tol", "w", "w_scale", "device", "dtype", "backend", "acceleration")


# ------------------------------------------------------------------------------------------- the table


def _seed(what: str) -> tuple:
    return option("--seed", type=NON_NEGATIVE, default=0, help=f"{what} (default: 0)")


THREADS = option("--threads", type=NON_NEGATIVE, default=0, help="CPU threads for torch (default: 0, torch's own)")
METRICS = option("--metrics", nargs="+", required=True, help="metrics files of the fits")
IMAGES = option("--output", nargs="+", required=True, help="one or more image files (.png, .pdf)")
MODEL = option("--model", required=True, help="a model file (XDGMM.save)")
DENOISED = option("--denoised", required=True, help="a denoised catalogue (scalable-xd denoise)")
DATA = option("--data", required=True, help="a features file (e.g. test.parquet)")
FIT_METRICS = option(
    "--metrics",
    help="the model's metrics.json: the figure names the fit by its settings (a variant by what sets it apart)",
)


def commands() -> list[Command]:
    """Every subcommand, in the order ``--help`` lists them."""
    groups = (
        _catalogue_commands,
        _bulk_and_feature_commands,
        _fit_commands,
        _table_commands,
        _denoising_commands,
        _figure_commands,
    )
    return [command for group in groups for command in group()]


def _catalogue_commands() -> list[Command]:
    """The subcommands of the catalogue: a mock, or the archive's subset."""
    from .gaia.schema import QUERY_DEFAULTS as query

    return [
        Command(
            "mock",
            "write a Gaia-DR2-like mock catalogue (Parquet)",
            (
                option("--n-rows", type=POSITIVE, required=True, help="rows (stars with random_index < n-rows)"),
                _seed("the mock's random seed"),
                option("--output", required=True, help="the Parquet file to write"),
            ),
            step="mock",
        ),
        Command(
            "query",
            "download the Gaia DR2 subset random_index < N (resumable)",
            (
                option("--n-rows", type=POSITIVE, required=True, help="rows with random_index < n-rows"),
                option("--out-dir", required=True, help="folder of the chunk files (a rerun fetches what is missing)"),
                option(
                    "--chunk-rows",
                    type=POSITIVE,
                    default=query["chunk_rows"],
                    help=f"rows per archive job (default: {query['chunk_rows']})",
                ),
                option(
                    "--tap-url",
                    default=None,
                    help="TAP server root; user:password@ goes as HTTP Basic auth (default: the ESA Gaia archive)",
                ),
                option(
                    "--retries",
                    type=NON_NEGATIVE,
                    default=query["retries"],
                    help=f"retries per chunk (default: {query['retries']})",
                ),
                option(
                    "--request-timeout",
                    type=float,
                    default=query["request_timeout"],
                    help=f"seconds any socket operation may wait (default: {query['request_timeout']:g})",
                ),
                option(
                    "--job-timeout",
                    type=float,
                    default=query["job_timeout"],
                    help="seconds one attempt at a chunk may take, from launch to the last byte of the result "
                    f"(default: {query['job_timeout']:g})",
                ),
                option("--manifest", default=None, help="JSON listing the chunk files, written when all are done"),
            ),
            step="query",
        ),
    ]


def _bulk_and_feature_commands() -> list[Command]:
    """The subcommands of all of DR2 from ESA's bulk files, and the features of any catalogue."""
    return [
        Command(
            "bulk-index",
            "list ESA's DR2 bulk files and their MD5 sums (MD5SUM.txt)",
            (
                option("--url", required=True, help="the index's URL (.../gaia_source/csv/MD5SUM.txt)"),
                option("--n-files", type=NON_NEGATIVE, default=0, help="keep the first N files only (default: 0, all)"),
                option("--output", required=True, help="the index to write (same format)"),
            ),
            step="bulk_index",
        ),
        Command(
            "bulk-check",
            "keep a downloaded bulk file once its MD5 sum matches the index",
            (
                option("--input", required=True, help="the downloaded .csv.gz"),
                option("--index", required=True, help="the index (scalable-xd bulk-index)"),
                option(
                    "--output", required=True, help="where the checked file goes (its name is looked up in the index)"
                ),
            ),
            step="bulk_check",
            rename={"input": "downloaded"},
        ),
        Command(
            "hats-import",
            "convert checked bulk files into one HATS catalogue (hats-import)",
            (
                option("--index", required=True, help="the index listing the files (scalable-xd bulk-index)"),
                option("--csv-dir", required=True, help="the folder of the checked files"),
                option("--output", required=True, help="the catalogue's folder (must not exist)"),
                option(
                    "--pixel-threshold",
                    type=POSITIVE,
                    default=1_000_000,
                    help="most stars in one HEALPix partition (default: 1000000)",
                ),
                option("--highest-order", type=NON_NEGATIVE, default=10, help="finest HEALPix order (default: 10)"),
                option("--workers", type=POSITIVE, default=1, help="dask worker processes (default: 1)"),
            ),
            step="hats_catalogue",
        ),
        Command(
            "features",
            "features, compact noise covariances and the 80/10/10 split",
            (
                option(
                    "--input",
                    required=True,
                    help="raw catalogue: for Gaia a Parquet file, a directory of chunks, a HATS catalogue or a query "
                    "manifest (.json); for another survey what its module reads",
                ),
                option("--out-dir", required=True, help="folder for train/val/test.parquet and features.json"),
                option(
                    "--mode",
                    default="corrected",
                    help="the survey's noise mode; Gaia: corrected units and missing colours, or what the paper's "
                    "code did, paper (default: corrected)",
                ),
                option("--split-seed", type=NON_NEGATIVE, default=0, help="seed of the 80/10/10 split (default: 0)"),
                option(
                    "--survey",
                    default="gaia_dr2",
                    help="the survey's module: gaia_dr2, or an importable module with write_feature_splits "
                    "(default: gaia_dr2)",
                ),
            ),
            step="features",
            rename={"input": "raw"},
        ),
    ]


def _fit_commands() -> list[Command]:
    """The subcommands of the fits: k-means starts, the fits themselves and their references."""
    return [_kmeans_command(), _fit_command(), _fit_table_command(), _reference_command()]


def _fit_table_command() -> Command:
    """The ``fit-table`` subcommand: one's own table, one command from a fitted model (``table_fit``)."""
    return Command(
        "fit-table",
        "fit a model to columns of your own CSV or Parquet table, their errors beside them",
        (
            option("--input", required=True, help="the table: .csv (or .csv.gz) or Parquet"),
            option("--columns", nargs="+", required=True, help="the columns of the values fitted"),
            option(
                "--errors",
                nargs="+",
                default=None,
                help="each column's standard deviation, in --columns' order (default: none, the values exact)",
            ),
            option(
                "--correlation",
                nargs="*",
                default=[],
                metavar="A:B=COLUMN",
                help="the correlation of columns A and B, held in COLUMN (default: none, uncorrelated)",
            ),
            option("--n-components", type=POSITIVE, required=True, help="K"),
            _seed("seed of the k-means start and the batch order"),
            THREADS,
            option("--output", required=True, help="the model (.npz; XDGMM.load reads it)"),
        ),
        run=_fit_table,
        settings=((FitSettings, {"skip": {"verbose"}}),),
    )


def _fit_table(args) -> None:
    from .table_fit import fit_table

    steps._set_threads(args.threads)
    fit_table(
        input=args.input,
        columns=args.columns,
        errors=args.errors,
        correlation=args.correlation,
        n_components=args.n_components,
        seed=args.seed,
        settings=_settings_of(args, FitSettings, verbose=_verbosity(args)),
        output=args.output,
    )


def _kmeans_command() -> Command:
    """The ``kmeans`` subcommand."""
    return Command(
        "kmeans",
        "minibatch k-means initial weights and means",
        (
            option("--train", required=True, help="a features file (train.parquet)"),
            option("--n-components", type=POSITIVE, required=True, help="K"),
            _seed("k-means seed"),
            THREADS,
            option(
                "--max-rows",
                type=NON_NEGATIVE,
                default=0,
                help="k-means on this many training stars chosen by the seed (default: 0, all of them)",
            ),
            option("--output", required=True, help="the init file (.npz: weights, means, seconds)"),
        ),
        run=_kmeans,
        settings=(
            (KMeansSettings, {}),
            (FitSettings, {"skip": set(FitSettings.defaults()) - {"device", "dtype"}}),
        ),
    )


def _fit_command() -> Command:
    """The ``fit`` subcommand."""
    return Command(
        "fit",
        "fit one model for each seed and write its parameters and metrics (the data read once)",
        (
            option("--train", required=True, help="a features file (train.parquet)"),
            option("--val", default=None, help="a features file scored after every epoch"),
            option("--test", default=None, help="a features file scored once at the end"),
            option("--init", nargs="+", required=True, help="each seed's k-means init file (scalable-xd kmeans)"),
            option("--n-components", type=POSITIVE, required=True, help="K (checked against the init files)"),
            option(
                "--seed",
                type=NON_NEGATIVE,
                nargs="+",
                default=[0],
                help="the fits' seeds (batch order): the first alone, the others of a minibatch method on the "
                "CPU in lockstep (default: 0)",
            ),
            THREADS,
            option(
                "--checkpoint",
                nargs="+",
                default=None,
                help="each seed's checkpoint: resumed from where present; removed once every seed is saved",
            ),
            option(
                "--checkpoint-every",
                type=NON_NEGATIVE,
                default=0,
                metavar="BATCHES",
                help="also checkpoint every BATCHES batches inside an epoch (default: 0, at epochs' ends only)",
            ),
            option("--output-model", nargs="+", required=True, help="each seed's model (.npz, XDGMM.load reads it)"),
            option(
                "--output-metrics", nargs="+", required=True, help="each seed's metrics record (JSON, report.metrics)"
            ),
            option(
                "--label",
                default=None,
                help="the name the fit is reported under in tables and figures (a workflow variant; default: "
                "the method)",
            ),
            option(
                "--stream-window",
                type=NON_NEGATIVE,
                default=0,
                metavar="ROWS",
                help="stream the splits from disk, shuffling within windows of ROWS rows, instead of loading "
                "them (0: load; --train etc. may then be folders of Parquet files or HATS catalogues)",
            ),
            option(
                "--group-timeout",
                type=float,
                default=600.0,
                metavar="SECONDS",
                help="under torchrun: how long a process waits for the others in one exchange before the fit "
                "fails (default: 600)",
            ),
            option("--tag", default=None, help="free text recorded in the metrics (e.g. the config name)"),
            option("--config-hash", default=None, help="recorded in the metrics"),
            option(
                "--reference",
                nargs="*",
                default=None,
                help="reference metrics (scalable-xd reference) for the truth metrics' gap closed",
            ),
        ),
        run=_fit,
        settings=((FitSettings, {"skip": {"verbose"}}),),
    )


def _reference_command() -> Command:
    """The ``reference`` subcommand."""
    return Command(
        "reference",
        "a reference fit for the truth metrics (mock data only)",
        (
            option("--train", required=True, help="a features file with true values"),
            option("--test", required=True, help="the split scored on its true values"),
            option("--init", required=True, help="the k-means init file"),
            option("--output-metrics", required=True, help="the reference's metrics (JSON)"),
            option("--n-components", type=POSITIVE, required=True, help="K (checked against the init file)"),
            option(
                "--kind",
                choices=REFERENCES,
                required=True,
                help="fit the true values, the noisy ones with the noise ignored, or XD itself to convergence",
            ),
            _seed("the reference's seed"),
            THREADS,
        ),
        run=_reference,
        settings=(
            (
                FitSettings,
                {
                    "skip": set(FitSettings.defaults()) - set(REFERENCE_SETTINGS),
                    "defaults": steps.REFERENCE.as_dict(),
                },
            ),
        ),
    )


def _table_commands() -> list[Command]:
    """The subcommands of the tables, the claims and Figure 1."""
    return [
        Command(
            "table",
            "Table 1: log-likelihoods per method and K (csv, md, tex)",
            (METRICS, option("--output-prefix", required=True, help="e.g. results/demo/tables/loglik")),
            step="table",
        ),
        Command(
            "claims",
            "the paper's claims with their verdicts on this run (Markdown)",
            (
                METRICS,
                option("--output", required=True, help="the Markdown file"),
                option("--device-note", default=None, help="where the timings were taken, in words"),
                option("--calibration", default=None, help="the denoised test stars' calibration (claims 9 and 10)"),
            ),
            step="claims",
        ),
        Command("plot-timing", "Figure 1 right: training time against K", (METRICS, IMAGES), step="plot_timing"),
        Command(
            "plot-curves",
            "Figure 1 left: training log-likelihood against rescaled epoch",
            (
                METRICS,
                option("--n-components", type=POSITIVE, required=True, help="the K whose curves are drawn"),
                IMAGES,
            ),
            step="plot_curves",
        ),
    ]


def _denoising_commands() -> list[Command]:
    """The subcommands of each star's posterior true values, their calibration and the parameters' errors."""
    return [
        Command(
            "denoise",
            "each star's posterior true values under a model (Parquet)",
            (
                MODEL,
                DATA,
                option("--output", required=True, help="the denoised catalogue (.parquet)"),
                option(
                    "--batch-rows",
                    type=POSITIVE,
                    default=65_536,
                    help="stars read and written at a time (default: 65,536)",
                ),
            ),
            step="denoise",
        ),
        Command(
            "errors",
            "a model's parameter errors by the jackknife over its training data",
            (
                MODEL,
                option("--train", required=True, help="the features file it was fitted to (train.parquet)"),
                option("--n-folds", type=_count(2), default=10, help="groups left out in turn (default: 10)"),
                option("--max-iter", type=POSITIVE, default=200, help="batch-EM iterations a refit (default: 200)"),
                option(
                    "--tol",
                    type=float,
                    default=1e-8,
                    help="a refit converges once an iteration gains less (default: 1e-08)",
                ),
                _seed("the seed that splits the groups"),
                option("--output-json", required=True, help="every component with its errors (.json)"),
                option("--output-md", required=True, help="the heaviest components' table (.md)"),
            ),
            step="parameter_errors",
        ),
        Command(
            "calibrate",
            "the denoised values' calibration against the truth (mock data)",
            (
                DENOISED,
                option("--output-json", required=True, help="the calibration (.json)"),
                option("--output-md", required=True, help="its table (.md)"),
            ),
            step="calibrate",
        ),
        Command(
            "plot-denoised",
            "colour-magnitude diagrams, pulls and precision gains of the denoised values",
            (
                DENOISED,
                option("--calibration", required=True, help="its calibration (scalable-xd calibrate)"),
                IMAGES,
            ),
            step="plot_denoised",
        ),
    ]


def _figure_commands() -> list[Command]:
    """The subcommands of the figures of models over data."""
    from .report.style import SAMPLES

    samples = option("--n-samples", type=POSITIVE, default=SAMPLES, help=f"model samples (default: {SAMPLES})")

    return [
        Command(
            "plot-sky",
            "Figure 2: sky density of model samples beside the data",
            (
                MODEL,
                DATA,
                FIT_METRICS,
                samples,
                _seed("the sampling seed"),
                IMAGES,
                option(
                    "--frame",
                    choices=["icrs", "galactic"],
                    default="icrs",
                    help="sky coordinates: ra, dec or Galactic l, b (default: icrs)",
                ),
            ),
            step="plot_sky",
        ),
        Command(
            "plot-corner",
            "corner plot of model samples over the data",
            (
                MODEL,
                DATA,
                FIT_METRICS,
                samples,
                _seed("the sampling seed"),
                IMAGES,
            ),
            step="plot_corner",
        ),
        Command(
            "plot-selection",
            "the population, the naive model and the selection-aware one, beyond a selection's limit",
            (
                option("--naive", required=True, help="the model fitted to the cut stars as they are"),
                option("--aware", required=True, help="the model fitted aware of the selection"),
                DATA,
                option("--selection", required=True, help="the limits the training stars were cut by"),
                samples,
                _seed("the sampling seed"),
                IMAGES,
            ),
            step="plot_selection",
        ),
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scalable-xd", description=_PLAIN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in commands():
        p = sub.add_parser(command.name, help=command.help)
        for flags, keywords in command.options:
            p.add_argument(*flags, **keywords)
        for cls, keywords in command.settings:
            _add_settings(p, cls, **keywords)
        p.set_defaults(run=_runner(command))
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
