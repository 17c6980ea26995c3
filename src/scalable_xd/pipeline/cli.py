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

Each subcommand is a row of one table (``commands``, gathered from ``pipeline.commands``): its options, and
the ``steps`` function it runs, which gets every option by name. The options of ``fit``, ``reference`` and
``kmeans`` come from ``settings`` (their help, defaults and choices); ``scalable-xd <step> --help`` lists
them. Every bad input ends in one error line and status 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .commands.data import bulk_and_feature_commands, catalogue_commands
from .commands.fitting import fit_commands
from .commands.options import Command, add_settings, runner
from .commands.report import denoising_commands, figure_commands, table_commands
from .gpu_slots import job_device

log = logging.getLogger("scalable_xd")


def commands() -> list[Command]:
    """Every subcommand, in the order ``--help`` lists them."""
    groups = (
        catalogue_commands,
        bulk_and_feature_commands,
        fit_commands,
        table_commands,
        denoising_commands,
        figure_commands,
    )
    return [command for group in groups for command in group()]


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
            add_settings(p, cls, **keywords)
        p.set_defaults(run=runner(command))
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
