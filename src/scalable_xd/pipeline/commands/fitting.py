"""The subcommands that fit: k-means starts, the fits of the experiment's grid, the reference fits and a
fit of one's own table; their options made from the settings (``settings``)."""

from __future__ import annotations

import dataclasses
import sys

from ...settings import FitSettings, KMeansSettings
from .. import fit_steps, steps
from ..step_inputs import set_threads
from ..truth import REFERENCES
from .options import (
    NON_NEGATIVE,
    POSITIVE,
    THREADS,
    Command,
    option,
    seed_option,
    settings_of,
)


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
    from ...fit.run.parallel import process_group  # torch: not imported for --help

    with process_group(args.device, args.group_timeout) as device:
        fit_steps.fit(
            train=args.train,
            val=args.val,
            test=args.test,
            init=args.init,
            n_components=args.n_components,
            seeds=args.seed,
            settings=settings_of(args, FitSettings, verbose=_verbosity(args), device=device),
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
    fit_steps.reference(
        train=args.train,
        test=args.test,
        init=args.init,
        n_components=args.n_components,
        seed=args.seed,
        kind=args.kind,
        settings=dataclasses.replace(fit_steps.REFERENCE, **given),
        output_metrics=args.output_metrics,
        threads=args.threads,
    )


# The reference fit's settings that its subcommand takes (the others are ``fit_steps.REFERENCE``'s).
REFERENCE_SETTINGS = ("epochs", "tol", "w", "w_scale", "device", "dtype", "backend", "acceleration")


def fit_commands() -> list[Command]:
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
            seed_option("seed of the k-means start and the batch order"),
            THREADS,
            option("--output", required=True, help="the model (.npz; XDGMM.load reads it)"),
        ),
        run=_fit_table,
        settings=((FitSettings, {"skip": {"verbose"}}),),
    )


def _fit_table(args) -> None:
    from ..table_fit import fit_table

    set_threads(args.threads)
    fit_table(
        input=args.input,
        columns=args.columns,
        errors=args.errors,
        correlation=args.correlation,
        n_components=args.n_components,
        seed=args.seed,
        settings=settings_of(args, FitSettings, verbose=_verbosity(args)),
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
            seed_option("k-means seed"),
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
            seed_option("the reference's seed"),
            THREADS,
        ),
        run=_reference,
        settings=(
            (
                FitSettings,
                {
                    "skip": set(FitSettings.defaults()) - set(REFERENCE_SETTINGS),
                    "defaults": fit_steps.REFERENCE.as_dict(),
                },
            ),
        ),
    )
