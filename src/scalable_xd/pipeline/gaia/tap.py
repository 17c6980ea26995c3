"""The TAP transport of the archive query: astroquery's Gaia client over bounded, recording connections.

astroquery's client drives the asynchronous TAP protocol (launch, poll, fetch, delete); its HTTP
connections come from ``Connections`` here, which gives each a timeout no longer than the time left to
the attempt's deadline (and ``request_timeout``), records each reply's status and Retry-After (astroquery
raises without them), and sends the credentials of a ``https://user:password@host/`` URL as HTTP Basic
authentication. Such credentials never appear in a log line, an error message or a stored file
(``redact_url``). ``run_job`` runs one job within one deadline, from launch to the last byte of the result.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import socket
import time
from urllib.parse import unquote, urlparse

DEFAULT_TAP_URL = "https://gea.esac.esa.int/"
OFFLINE_HINT = (
    "To run offline, use the DR2-like mock instead: `snakemake --configfile config/mock.yaml` (or `scalable-xd mock`)."
)


class ArchiveUnreachableError(RuntimeError):
    """The TAP server did not accept a connection."""


class JobError(RuntimeError):
    """A TAP job that ended in ERROR or ABORTED, or whose result came back empty."""


class HttpStatusError(RuntimeError):
    """A reply with an error status; ``retry_after`` is the server's Retry-After in seconds, if any."""

    def __init__(self, status: int, reason: str, retry_after: float | None, what: str):
        self.status, self.retry_after = status, retry_after
        super().__init__(f"HTTP {status} {reason} {what}")


def redact_url(url: str | None) -> str | None:
    """``url`` with any user and password replaced by ``***``, for logs, messages and stored files."""
    if url is None:
        return None
    parsed = urlparse(url)
    if parsed.username is None and parsed.password is None:
        return url
    host = parsed.hostname or ""
    return parsed._replace(netloc=f"***@{host}" + (f":{parsed.port}" if parsed.port else "")).geturl()


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (the delta-seconds form; an HTTP date is read as no advice)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


class Connections:
    """The HTTP connections astroquery's TapConn asks for: each with a timeout no longer than the time left
    to the attempt's deadline (and ``request_timeout``), Basic authentication when the URL carries
    credentials, and the status of every reply recorded in ``last``."""

    def __init__(self, host: str, port: int, https: bool, request_timeout: float, authorization: str | None):
        self.host, self.port, self.https = host, port, https
        self.request_timeout = request_timeout
        self.authorization = authorization
        self.deadline = float("inf")
        self.last: tuple[int, str, float | None] | None = None  # (status, reason, retry_after)

    def timeout(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the attempt's deadline passed")
        return min(self.request_timeout, left)

    def get_connection(self, *, ishttps=False, cookie=None, verbose=False):
        base = http.client.HTTPSConnection if self.https or ishttps else http.client.HTTPConnection
        handler = self

        class Connection(base):
            def request(self, method, url, body=None, headers=None, **kwargs):
                headers = dict(headers or {})
                if handler.authorization:
                    headers["Authorization"] = handler.authorization
                super().request(method, url, body, headers, **kwargs)

            def getresponse(self):
                response = super().getresponse()
                handler.last = (response.status, response.reason, _retry_after(response.getheader("Retry-After")))
                return response

        return Connection(self.host, self.port, timeout=self.timeout())

    def get_connection_secure(self, verbose=False):
        return self.get_connection(ishttps=True)


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
        raise ValueError(f"tap_url must be an http(s) URL such as {DEFAULT_TAP_URL}, got {redact_url(tap_url)!r}")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            pass
    except OSError as err:
        raise ArchiveUnreachableError(
            f"cannot reach the Gaia archive at {redact_url(tap_url)} ({err.__class__.__name__}: {err}). {OFFLINE_HINT}"
        ) from err


def make_client(tap_url: str, request_timeout: float):
    """astroquery's GaiaClass pointed at ``tap_url`` over ``Connections``, built without touching the
    network; returns (client, connections)."""
    with _socket_timeout(request_timeout), contextlib.redirect_stdout(io.StringIO()):
        # Importing astroquery.gaia builds a default client that asks the real archive for status
        # messages; bound that, and keep its console message out of our output.
        from astroquery.gaia import GaiaClass
        from astroquery.utils.tap.conn.tapconn import TapConn

    parsed = urlparse(tap_url)
    if parsed.hostname is None:
        raise ValueError(f"tap_url must be an http(s) URL such as {DEFAULT_TAP_URL}, got {redact_url(tap_url)!r}")
    https = parsed.scheme == "https"
    port = parsed.port or (443 if https else 80)
    authorization = None
    if parsed.username is not None:
        secret = f"{unquote(parsed.username)}:{unquote(parsed.password or '')}".encode()
        authorization = "Basic " + base64.b64encode(secret).decode()
    connections = Connections(parsed.hostname, port, https, request_timeout, authorization)
    tap = TapConn(
        https,
        parsed.hostname,
        server_context="tap-server",
        tap_context="tap",
        upload_context="Upload",
        table_edit_context="TableTool",
        data_context="data",
        datalink_context="datalink",
        port=port,
        sslport=port,
        connhandler=connections,
    )
    bare_url = f"{parsed.scheme}://{parsed.hostname}:{port}/"
    with contextlib.redirect_stdout(io.StringIO()):
        client = GaiaClass(
            tap_plus_conn_handler=tap, gaia_tap_server=bare_url, gaia_data_server=bare_url, show_server_messages=False
        )
    return client, connections


def _raise_for_status(connections: Connections, what: str) -> None:
    """Turn the last reply's error status (which astroquery reports without it) into HttpStatusError."""
    if connections.last is not None and connections.last[0] >= 400:
        status, reason, retry_after = connections.last
        raise HttpStatusError(status, reason, retry_after, what)


def _read_body(response, connections: Connections, what: str) -> bytes:
    """A reply's body, read as it arrives and abandoned at the attempt's deadline."""
    parts = []
    while True:
        if time.monotonic() > connections.deadline:
            response.close()
            raise TimeoutError(f"{what} was still arriving at the attempt's deadline")
        part = response.read1(1 << 16)
        if not part:
            break
        parts.append(part)
    if response.length:  # http.client leaves this > 0 when the connection closed early
        raise http.client.IncompleteRead(b"".join(parts), response.length)
    return b"".join(parts)


def _download_result(client, job, connections: Connections):
    """The result table of a completed job, read within the attempt's deadline."""
    from astroquery.utils.tap.xmlparser.utils import read_http_response

    what = f"the result of job {job.jobid}"
    response = job.connHandler.execute_tapget(f"async/{job.jobid}/results/result")
    for _ in range(5):  # the archive may redirect results to a data server
        if response.status not in (302, 303):
            break
        location = response.getheader("Location")
        response.read()
        response = job.connHandler.execute_tapget(location)
    if response.status != 200:
        response.read()
        _raise_for_status(connections, f"for {what}")
    body = _read_body(response, connections, what)
    if not body:
        raise JobError(f"{what} came back empty")
    return read_http_response(io.BytesIO(body), job.parameters["format"], use_names_over_ids=client.USE_NAMES_OVER_IDS)


def run_job(client, connections: Connections, query: str, job_timeout: float, poll: float):
    """Launch one async job, wait for it and read its result within job_timeout seconds in all, return its
    astropy Table; always delete the job."""
    jobid = None
    connections.deadline = time.monotonic() + job_timeout
    connections.last = None
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # astroquery prints HTTP errors; they are raised here
            try:
                job = client.launch_job_async(query, background=True)
            except Exception:
                _raise_for_status(connections, "when launching the job")
                raise
            jobid = job.jobid
            while True:
                try:
                    phase = job.get_phase(update=True).strip().upper()
                except Exception:
                    _raise_for_status(connections, f"when polling job {jobid}")
                    raise
                if phase in ("COMPLETED", "ERROR", "ABORTED"):
                    break
                if time.monotonic() + poll > connections.deadline:
                    raise TimeoutError(f"job {jobid} still {phase} after {job_timeout:g} s")
                time.sleep(poll)
            if phase != "COMPLETED":
                raise JobError(f"job {jobid} ended in phase {phase}")
            return _download_result(client, job, connections)
    finally:
        if jobid is not None:
            connections.deadline = time.monotonic() + connections.request_timeout
            with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()):
                client.remove_jobs([jobid])
