"""The subcommands that make the data: a mock catalogue or the archive's subset, DR2's bulk files as HATS,
and the features files a fit reads."""

from __future__ import annotations

from .options import NON_NEGATIVE, POSITIVE, Command, option, seed_option


def catalogue_commands() -> list[Command]:
    """The subcommands of the catalogue: a mock, or the archive's subset."""
    from ..gaia.schema import QUERY_DEFAULTS as query

    return [
        Command(
            "mock",
            "write a Gaia-DR2-like mock catalogue (Parquet)",
            (
                option("--n-rows", type=POSITIVE, required=True, help="rows (stars with random_index < n-rows)"),
                seed_option("the mock's random seed"),
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


def bulk_and_feature_commands() -> list[Command]:
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
