"""Download the Gaia DR2 subset (random_index < N) through astroquery's Gaia TAP client, resumably.

The rows are fetched as asynchronous TAP jobs over ``random_index`` ranges (200,000 rows by default: each
range has a known row count to check). Every chunk is validated (exactly the random_index values of its
range, the expected units), written atomically as Parquet, and skipped on a rerun, so an interrupted
download resumes where it stopped. Failures (HTTP errors, jobs ending in ERROR, truncated results, replies
slower than ``request_timeout``, jobs running past ``job_timeout``) are retried with exponential backoff;
every server-side job is deleted after use, since anonymous users share a 10 GB quota.

astroquery's client sets no socket timeout and polls a job forever, so here every socket operation is
bounded by ``request_timeout`` and the polling by ``job_timeout``. When the archive cannot be reached at
all, ``ArchiveUnreachableError`` says so within ``connect_timeout`` seconds and how to run offline.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pandas as pd

from ..io import atomic_path
from .schema import GAIA_TABLE, QUERY_COLUMNS

log = logging.getLogger(__name__)

DEFAULT_TAP_URL = "https://gea.esac.esa.int/"
OFFLINE_HINT = (
    "To run offline, use the DR2-like mock instead: `snakemake --configfile config/mock.yaml` "
    "(or `scalable-xd mock`)."
)
_CHUNK_NAME = re.compile(r"gaia_dr2_ri_(\d{10})_(\d{10})\.parquet$")


class ArchiveUnreachableError(RuntimeError):
    """The TAP server did not accept a connection."""


class ChunkError(RuntimeError):
    """A chunk could not be downloaded intact after all retries (or came back wrong)."""


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
    """A chunk file counts as done when it exists and holds exactly hi - lo rows."""
    if not path.exists():
        return False
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows == hi - lo
    except Exception:  # an unreadable file is redone, not trusted
        return False


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


@contextlib.contextmanager
def _socket_timeout(seconds: float):
    """Bound every socket operation, including those astroquery's http.client connections make."""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


def check_reachable(tap_url: str, timeout: float) -> None:
    """Open (and close) a TCP connection to the TAP server, or raise ArchiveUnreachableError."""
    parsed = urlparse(tap_url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"tap_url must be an http(s) URL such as {DEFAULT_TAP_URL}, got {tap_url!r}")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            pass
    except OSError as err:
        raise ArchiveUnreachableError(
            f"cannot reach the Gaia archive at {tap_url} ({err.__class__.__name__}: {err}). {OFFLINE_HINT}"
        ) from err


def make_client(tap_url: str, request_timeout: float):
    """astroquery's GaiaClass pointed at ``tap_url``, built without touching the network."""
    with _socket_timeout(request_timeout), contextlib.redirect_stdout(io.StringIO()):
        # Importing astroquery.gaia builds a default client that asks the real archive for status
        # messages; bound that, and keep its console message out of our output.
        from astroquery.gaia import GaiaClass

        return GaiaClass(gaia_tap_server=tap_url, gaia_data_server=tap_url, show_server_messages=False)


def _run_job(client, query: str, request_timeout: float, job_timeout: float, poll: float):
    """Launch one async job, wait for it within job_timeout, return its astropy Table; always delete it."""
    jobid = None
    with _socket_timeout(request_timeout):
        try:
            job = client.launch_job_async(query, background=True)
            jobid = job.jobid
            deadline = time.monotonic() + job_timeout
            while True:
                phase = job.get_phase(update=True).strip().upper()
                if phase in ("COMPLETED", "ERROR", "ABORTED"):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {jobid} still {phase} after {job_timeout:g} s")
                time.sleep(poll)
            if phase != "COMPLETED":
                raise ChunkError(f"job {jobid} ended in phase {phase}")
            return job.get_results()
        finally:
            if jobid is not None:
                with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()):
                    client.remove_jobs([jobid])


def _check_chunk(frame: pd.DataFrame, lo: int, hi: int) -> None:
    indices = np.sort(frame["random_index"].to_numpy())
    if len(indices) != hi - lo or not np.array_equal(indices, np.arange(lo, hi)):
        raise ChunkError(
            f"chunk [{lo}, {hi}) came back with {len(indices)} rows, not exactly random_index {lo}..{hi - 1}"
        )


def download_chunk(client, lo: int, hi: int, *, retries: int, backoff: float, request_timeout: float,
                   job_timeout: float, poll: float) -> pd.DataFrame:  # fmt: skip
    """One random_index range as a validated DataFrame, retrying failures with exponential backoff."""
    for attempt in range(retries + 1):
        try:
            frame = table_to_frame(_run_job(client, build_query(lo, hi), request_timeout, job_timeout, poll))
            _check_chunk(frame, lo, hi)
            return frame
        except KeyboardInterrupt:
            raise
        except Exception as err:  # HTTP errors, ERROR jobs, timeouts, truncated or wrong results
            if attempt == retries:
                raise ChunkError(f"chunk [{lo}, {hi}) failed after {retries + 1} attempts: {err}") from err
            delay = backoff * 2**attempt
            log.warning("chunk [%d, %d) attempt %d failed (%s: %s); retrying in %.1f s",
                        lo, hi, attempt + 1, err.__class__.__name__, err, delay)  # fmt: skip
            time.sleep(delay)
    raise AssertionError("unreachable")


def write_manifest(path, chunks, *, n_rows: int, tap_url: str | None) -> None:
    """A JSON file naming the complete chunk files (relative to the manifest), for the workflow to depend on."""
    from ..io import write_json

    base = Path(path).resolve().parent
    write_json(path, {
        "table": GAIA_TABLE,
        "n_rows": n_rows,
        "tap_url": tap_url or DEFAULT_TAP_URL,
        "chunks": [str(Path(c).resolve().relative_to(base)) for c in chunks],
    })  # fmt: skip


def query_gaia(
    n_rows: int,
    out_dir,
    chunk_rows: int = 200_000,
    tap_url: str | None = None,
    *,
    retries: int = 5,
    backoff: float = 10.0,
    request_timeout: float = 300.0,
    job_timeout: float = 5400.0,
    connect_timeout: float = 15.0,
    poll: float = 2.0,
    progress: bool = True,
) -> list[Path]:
    """Download the rows with random_index < n_rows into ``out_dir`` as Parquet chunks; returns their paths.

    Chunks already complete on disk are not requested again. ``tap_url`` defaults to the ESA archive.
    """
    from tqdm.auto import tqdm

    tap_url = tap_url or DEFAULT_TAP_URL
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ranges = chunk_ranges(n_rows, chunk_rows)
    todo = [(lo, hi) for lo, hi in ranges if not chunk_is_complete(chunk_path(out_dir, lo, hi), lo, hi)]
    found = {p.name: _CHUNK_NAME.search(p.name) for p in out_dir.glob("gaia_dr2_ri_*.parquet")}
    stale = [name for name, match in found.items() if match and (int(match[1]), int(match[2])) not in ranges]
    if stale:
        raise ValueError(
            f"{out_dir} holds chunks of another chunking ({stale[0]}); use a fresh directory or the same chunk_rows"
        )
    log.info("%d of %d chunks to download from %s", len(todo), len(ranges), tap_url)
    if todo:
        check_reachable(tap_url, connect_timeout)
        client = make_client(tap_url, request_timeout)
        for lo, hi in tqdm(todo, desc="gaia query", unit="chunk", disable=not progress or None):
            frame = download_chunk(client, lo, hi, retries=retries, backoff=backoff,
                                   request_timeout=request_timeout, job_timeout=job_timeout, poll=poll)  # fmt: skip
            with atomic_path(chunk_path(out_dir, lo, hi)) as tmp:
                frame.to_parquet(tmp, index=False)
    return [chunk_path(out_dir, lo, hi) for lo, hi in ranges]
