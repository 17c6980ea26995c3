"""The subcommands of the report: Table 1 and the claims, each star's posterior true values and their
calibration, the parameters' errors, and the figures."""

from __future__ import annotations

from .options import (
    DATA,
    DENOISED,
    FIT_METRICS,
    IMAGES,
    METRICS,
    MODEL,
    POSITIVE,
    Command,
    count,
    option,
    seed_option,
)


def table_commands() -> list[Command]:
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


def denoising_commands() -> list[Command]:
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
                option("--n-folds", type=count(2), default=10, help="groups left out in turn (default: 10)"),
                option("--max-iter", type=POSITIVE, default=200, help="batch-EM iterations a refit (default: 200)"),
                option(
                    "--tol",
                    type=float,
                    default=1e-8,
                    help="a refit converges once an iteration gains less (default: 1e-08)",
                ),
                seed_option("the seed that splits the groups"),
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


def figure_commands() -> list[Command]:
    """The subcommands of the figures of models over data."""
    from ..report.style import SAMPLES

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
                seed_option("the sampling seed"),
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
                seed_option("the sampling seed"),
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
                seed_option("the sampling seed"),
                IMAGES,
            ),
            step="plot_selection",
        ),
    ]
