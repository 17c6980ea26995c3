"""Download the Gaia DR2 subset (random_index < N) through astroquery's Gaia TAP client, resumably.

The rows are fetched as asynchronous TAP jobs over ``random_index`` ranges (200,000 rows by default: each
range has a known row count to check). Every chunk is validated (exactly the random_index values of its
range, the expected units), written atomically as Parquet, and skipped on a rerun once it reads back
whole, so an interrupted download resumes where it stopped. Every server-side job is deleted after use,
since anonymous users share a 10 GB quota.

Each attempt at a chunk has one deadline, ``job_timeout`` seconds from launch through the last byte of the
result, and no single socket operation waits longer than ``request_timeout``: a server that stalls,
never finishes the job or drips the result a few bytes at a time cannot hold the download past them.
Failed attempts are retried with exponential backoff, or after the server's ``Retry-After`` when it gives
one (HTTP 429, 503); a refusal (HTTP 401, 403) is not retried. When the archive cannot be reached at all,
``tap.ArchiveUnreachableError`` says so within ``connect_timeout`` seconds and how to run offline.

astroquery's client drives the protocol; its HTTP connections come from ``Connections`` here, which
bounds their timeouts, records each reply's status (astroquery raises without it), and sends the
credentials of a ``https://user:password@host/`` URL as HTTP Basic authentication. Such credentials never
appear in a log line, an error message or the manifest (``redact_url``).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from pathlib import Path

import numpy as np
import pandas as pd

from ...files import atomic_path
from .schema import GAIA_TABLE, QUERY_COLUMNS, QUERY_DEFAULTS
from .tap import DEFAULT_TAP_URL, Connections, HttpStatusError, check_reachable, make_client, redact_url, run_job

log = logging.getLogger(__name__)

_CHUNK_NAME = re.compile(r"gaia_dr2_ri_(\d{10})_(\d{10})\.parquet$")


class ChunkError(RuntimeError):
    """A chunk could not be downloaded intact after all retries (or came back wrong)."""


class ArchiveRefusedError(ChunkError):
    """The archive refused the request (HTTP 401 or 403): retrying would not help."""


def build_query(lo: int, hi: int) -> str:
    """ADQL for the rows with lo <= random_index < hi, selecting exactly ``schema.QUERY_COLUMNS``."""
    return f"SELECT {', '.join(QUERY_COLUMNS)} FROM {GAIA_TABLE} WHERE random_index >= {lo} AND random_index < {hi}"


def chunk_ranges(n_rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    if n_rows < 1 or chunk_rows < 1:
        raise ValueError(f"n_rows and chunk_rows must be positive, got {n_rows} and {chunk_rows}")
    return [(lo, min(lo + chunk_rows, n_rows)) for lo in range(0, n_rows, chunk_rows)]


def chunk_path(out_dir, lo: int, hi: int) -> Path:
    return Path(out_dir) / f"gaia_dr2_ri_{lo:010d}_{hi:010d}.parquet"


def chunk_is_complete(path: Path, lo: int, hi: int) -> bool:
    """A chunk file counts as done when it reads back whole with exactly the random_index values lo..hi-1;
    anything else (a file cut short by a crash, a corrupt or foreign file under the right name) is redone."""
    if not path.exists():
        return False
    import pyarrow.parquet as pq

    try:
        indices = pq.read_table(path, columns=["random_index"]).column("random_index").to_numpy()
    except Exception:  # an unreadable file is redone, not trusted
        return False
    return len(indices) == hi - lo and np.array_equal(np.sort(indices), np.arange(lo, hi))


def remove_partial_writes(out_dir: Path) -> list[str]:
    """Delete the temporary files of chunk writes a killed process left (see ``io.atomic_path``)."""
    leftovers = sorted(out_dir.glob(".gaia_dr2_ri_*"))
    for path in leftovers:
        path.unlink(missing_ok=True)
    return [path.name for path in leftovers]


def _parse_unit(unit):
    """An astropy unit from a column's unit, reading VOUnit strings such as the archive's 'mas.yr**-1'."""
    import astropy.units as u

    if unit is None:
        return u.dimensionless_unscaled
    if isinstance(unit, u.UnrecognizedUnit):
        for fmt in ("vounit", "cds"):
            with contextlib.suppress(ValueError):
                return u.Unit(str(unit), format=fmt)
    return u.Unit(unit)


def table_to_frame(table) -> pd.DataFrame:
    """An archive result (astropy Table) as a DataFrame with the schema's dtypes, NULLs as NaN.

    Checks every column's unit against ``schema.QUERY_COLUMNS`` so that a change of units on the server
    (degrees for mas, say) fails loudly instead of silently mis-scaling the noise covariances.
    """
    missing = [name for name in QUERY_COLUMNS if name not in table.colnames]
    if missing:
        raise ValueError(f"the archive result lacks the columns {', '.join(missing)}")
    data = {}
    for name, (dtype, unit) in QUERY_COLUMNS.items():
        column = table[name]
        got, want = _parse_unit(column.unit), _parse_unit(unit)
        if got != want:
            raise ValueError(f"column {name} arrived in {got} but the pipeline expects {want}")
        mask = np.ma.getmaskarray(column)
        if dtype.startswith("int"):
            if mask.any():
                raise ValueError(f"column {name} has NULL entries")
            data[name] = np.asarray(column, dtype=dtype)
        else:
            values = np.ma.filled(np.ma.asarray(column).astype(dtype), np.nan)
            data[name] = np.where(mask, np.nan, values).astype(dtype)
    return pd.DataFrame(data)


def _check_chunk(frame: pd.DataFrame, lo: int, hi: int) -> None:
    indices = np.sort(frame["random_index"].to_numpy())
    if len(indices) != hi - lo or not np.array_equal(indices, np.arange(lo, hi)):
        raise ChunkError(
            f"chunk [{lo}, {hi}) came back with {len(indices)} rows, not exactly random_index {lo}..{hi - 1}"
        )


def download_chunk(
    client, connections: Connections, lo: int, hi: int, *, retries: int, backoff: float, job_timeout: float, poll: float
) -> pd.DataFrame:
    """One random_index range as a validated DataFrame. Failures are retried after exponential backoff or
    the server's Retry-After; a refusal (HTTP 401/403) raises ArchiveRefusedError at once."""
    for attempt in range(retries + 1):
        try:
            frame = table_to_frame(run_job(client, connections, build_query(lo, hi), job_timeout, poll))
            _check_chunk(frame, lo, hi)
            return frame
        except KeyboardInterrupt:
            raise
        except HttpStatusError as err:
            if err.status in (401, 403):
                raise ArchiveRefusedError(
                    f"the archive refused chunk [{lo}, {hi}) ({err}): check the credentials in tap_url, "
                    "or use the public archive, which needs none"
                ) from None
            if attempt == retries:
                raise ChunkError(f"chunk [{lo}, {hi}) failed after {retries + 1} attempts: {err}") from None
            delay = err.retry_after if err.retry_after is not None else backoff * 2**attempt
            failure = _describe(err)
        except Exception as err:  # ERROR jobs, timeouts, resets, truncated, empty or wrong results
            if attempt == retries:
                raise ChunkError(
                    f"chunk [{lo}, {hi}) failed after {retries + 1} attempts: {err.__class__.__name__}: {err}"
                ) from err
            delay = backoff * 2**attempt
            failure = _describe(err)
        log.warning("chunk [%d, %d) attempt %d failed (%s); retrying in %.1f s", lo, hi, attempt + 1, failure, delay)
        time.sleep(delay)
    raise AssertionError("unreachable")


def _describe(err: BaseException) -> str:
    """One line for a log: the class and the first line of the message."""
    text = str(err).strip().splitlines()
    return f"{err.__class__.__name__}: {text[0] if text else ''}"


def write_manifest(path, chunks, *, n_rows: int, tap_url: str | None) -> None:
    """A JSON file naming the complete chunk files (relative to the manifest), for the workflow to depend on."""
    from ...files import write_json

    base = Path(path).resolve().parent
    write_json(
        path,
        {
            "table": GAIA_TABLE,
            "n_rows": n_rows,
            "tap_url": redact_url(tap_url or DEFAULT_TAP_URL),
            "chunks": [str(Path(c).resolve().relative_to(base)) for c in chunks],
        },
    )


def query_gaia(
    n_rows: int,
    out_dir,
    chunk_rows: int = int(QUERY_DEFAULTS["chunk_rows"]),
    tap_url: str | None = None,
    *,
    retries: int = int(QUERY_DEFAULTS["retries"]),
    backoff: float = 10.0,
    request_timeout: float = QUERY_DEFAULTS["request_timeout"],
    job_timeout: float = QUERY_DEFAULTS["job_timeout"],
    connect_timeout: float = 15.0,
    poll: float = 2.0,
    progress: bool = True,
) -> list[Path]:
    """Download the rows with random_index < n_rows into ``out_dir`` as Parquet chunks; returns their paths.

    Chunks already complete on disk are not requested again. ``tap_url`` defaults to the ESA archive.
    ``job_timeout`` bounds each attempt at a chunk from launch to the last byte, ``request_timeout`` each
    socket operation (see the module docstring).
    """
    for name, value in (
        ("request_timeout", request_timeout),
        ("job_timeout", job_timeout),
        ("connect_timeout", connect_timeout),
        ("poll", poll),
        ("backoff", backoff),
    ):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    if retries < 0:
        raise ValueError(f"retries must be non-negative, got {retries!r}")
    from tqdm.auto import tqdm

    tap_url = tap_url or DEFAULT_TAP_URL
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ranges = chunk_ranges(n_rows, chunk_rows)
    for name in remove_partial_writes(out_dir):
        log.warning("removed %s, left by an interrupted write", name)
    todo = [(lo, hi) for lo, hi in ranges if not chunk_is_complete(chunk_path(out_dir, lo, hi), lo, hi)]
    found = {p.name: _CHUNK_NAME.search(p.name) for p in out_dir.glob("gaia_dr2_ri_*.parquet")}
    stale = [name for name, match in found.items() if match and (int(match[1]), int(match[2])) not in ranges]
    if stale:
        raise ValueError(
            f"{out_dir} holds chunks of another chunking ({stale[0]}); use a fresh directory or the same chunk_rows"
        )
    log.info("%d of %d chunks to download from %s", len(todo), len(ranges), redact_url(tap_url))
    if todo:
        check_reachable(tap_url, connect_timeout)
        client, connections = make_client(tap_url, request_timeout)
        for lo, hi in tqdm(todo, desc="gaia query", unit="chunk", disable=not progress or None):
            frame = download_chunk(
                client, connections, lo, hi, retries=retries, backoff=backoff, job_timeout=job_timeout, poll=poll
            )
            with atomic_path(chunk_path(out_dir, lo, hi)) as tmp:
                frame.to_parquet(tmp, index=False)
    return [chunk_path(out_dir, lo, hi) for lo, hi in ranges]
