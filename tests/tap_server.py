"""A TAP server on 127.0.0.1 that speaks the part of the async protocol astroquery's Gaia client uses.

It answers the project's ADQL (a random_index range of gaiadr2.gaia_source) with rows of a mock catalogue,
encoded as the archive does (gzipped VOTable 1.3, BINARY2, NULLs masked, archive units), counts every
request, and fails on purpose when told to:

* ``http500``, ``http503``, ``http401``, ``http403``: the job-creating POST answers with that status,
* ``http429``: the job-creating POST answers 429 Too Many Requests with ``Retry-After: retry_after``,
* ``phase500``: polling the job's phase answers HTTP 500,
* ``error`` / ``aborted``: the job ends in phase ERROR / ABORTED,
* ``stuck``: the job stays EXECUTING forever,
* ``truncated``: the result is cut off half way (a short body under an honest Content-Length),
* ``reset``: the connection is reset (TCP RST) half way through the result,
* ``slow``: the result arrives after ``slow_seconds``,
* ``drip``: the result arrives 64 bytes every ``drip_seconds``,
* ``html`` / ``empty``: the result is an HTML error page / an empty body, with status 200,

each for the first ``n`` attempts at the chunk (keyed by its lower random_index), or forever with n = -1.
With ``credentials=(user, password)`` every request without that HTTP Basic authorisation gets 401.
"""

from __future__ import annotations

import base64
import collections
import gzip
import io
import re
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

import numpy as np
from astropy.io.votable import from_table
from astropy.io.votable.tree import Info
from astropy.table import MaskedColumn, Table

from scalable_xd.pipeline.gaia.schema import QUERY_COLUMNS

PREFIX = "/tap-server/tap"
_RANGE = re.compile(r"random_index >= (\d+) AND random_index < (\d+)")


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        """A client that gave up (timed out) mid-reply is part of the tests, not a server error."""


def votable_bytes(frame, query: str) -> bytes:
    """Rows in the DR2 schema as the archive encodes them: VOTable 1.3, BINARY2, masked NULLs, units."""
    table = Table()
    for name, (dtype, unit) in QUERY_COLUMNS.items():
        values = frame[name].to_numpy(dtype=dtype)
        mask = np.isnan(values) if dtype.startswith("float") else np.zeros(len(values), bool)
        table[name] = MaskedColumn(values, mask=mask, unit=unit, dtype=dtype)
    votable = from_table(table)
    resource = votable.resources[0]
    resource.infos.append(Info(name="QUERY_STATUS", value="OK"))
    resource.infos.append(Info(name="QUERY", value=query))
    buffer = io.BytesIO()
    votable.to_xml(buffer, tabledata_format="binary2")
    return buffer.getvalue()


class MockTapServer:
    def __init__(
        self,
        catalogue,
        slow_seconds: float = 3.0,
        drip_seconds: float = 0.5,
        retry_after: float = 1.0,
        credentials: tuple[str, str] | None = None,
    ):
        self.catalogue = catalogue
        self.slow_seconds = slow_seconds
        self.drip_seconds = drip_seconds
        self.retry_after = retry_after
        self.credentials = credentials
        self.post_times: list[float] = []  # monotonic time of every job-creating POST
        self.faults: dict[str, dict[int, int]] = collections.defaultdict(dict)
        self.attempts: collections.Counter = collections.Counter()  # (fault kind, chunk lo) -> attempts seen
        self.queries: collections.Counter = collections.Counter()  # (lo, hi) -> job-creating POSTs
        self.deleted: list[str] = []
        self.jobs: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._httpd = _QuietServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/"

    def fail(self, kind: str, chunk_lo: int, times: int = 1) -> None:
        self.faults[kind][chunk_lo] = times

    def _should_fail(self, kind: str, lo: int) -> bool:
        with self._lock:
            times = self.faults[kind].get(lo)
            if times is None:
                return False
            self.attempts[(kind, lo)] += 1
            return times < 0 or self.attempts[(kind, lo)] <= times

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._httpd.shutdown()
        self._httpd.server_close()

    def _handler(server):  # noqa: N805 - the closure's "self" is the MockTapServer
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status: int, body: bytes = b"", content_type: str = "text/plain", headers=()):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for key, value in headers:
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def _authorised(self) -> bool:
                if server.credentials is None:
                    return True
                expected = "Basic " + base64.b64encode(":".join(server.credentials).encode()).decode()
                if self.headers.get("Authorization") == expected:
                    return True
                self._reply(401, b"Unauthorized", headers=[("WWW-Authenticate", 'Basic realm="tap"')])
                return False

            def _reset_after(self, status: int, body: bytes, content_type: str) -> None:
                """Send the headers and half the body, then reset the connection (SO_LINGER 0 sends RST)."""
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
                self.close_connection = True

            def _drip(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for start in range(0, len(body), 64):
                    try:
                        self.wfile.write(body[start : start + 64])
                        self.wfile.flush()
                    except OSError:  # the client gave up
                        return
                    time.sleep(server.drip_seconds)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                if not self._authorised():
                    return None
                form = {k: v[0] for k, v in parse_qs(body).items()}
                if self.path == f"{PREFIX}/deletejobs":
                    server.deleted.extend(form.get("JOB_IDS", "").split(","))
                    return self._reply(200, b"OK")
                if self.path != f"{PREFIX}/async":
                    return self._reply(404, b"no such endpoint")
                match = _RANGE.search(form.get("QUERY", ""))
                if match is None:
                    return self._reply(400, b"this server answers random_index range queries only")
                lo, hi = int(match.group(1)), int(match.group(2))
                with server._lock:
                    server.queries[(lo, hi)] += 1
                    server.post_times.append(time.monotonic())
                for status in (500, 503, 401, 403):
                    if server._should_fail(f"http{status}", lo):
                        return self._reply(status, f"HTTP {status} (injected)".encode())
                if server._should_fail("http429", lo):
                    return self._reply(
                        429, b"Too Many Requests (injected)", headers=[("Retry-After", f"{server.retry_after:g}")]
                    )
                jobid = f"{time.time_ns()}O"
                server.jobs[jobid] = dict(
                    lo=lo,
                    hi=hi,
                    query=form["QUERY"],
                    format=form.get("FORMAT", "votable"),
                    polls=0,
                    error=server._should_fail("error", lo),
                    aborted=server._should_fail("aborted", lo),
                    stuck=server._should_fail("stuck", lo),
                )
                location = f"http://127.0.0.1:{server._httpd.server_address[1]}{PREFIX}/async/{jobid}"
                return self._reply(303, b"", headers=[("Location", location)])

            def do_GET(self):
                if not self._authorised():
                    return None
                parts = self.path[len(PREFIX) + 1 :].split("/") if self.path.startswith(PREFIX) else []
                if len(parts) < 3 or parts[0] != "async" or parts[1] not in server.jobs:
                    return self._reply(404, b"no such job")
                job = server.jobs[parts[1]]
                what = "/".join(parts[2:])
                if what == "phase":
                    job["polls"] += 1
                    if server._should_fail("phase500", job["lo"]):
                        return self._reply(500, b"Internal Server Error (injected)")
                    if job["polls"] == 1 or job["stuck"]:
                        phase = "EXECUTING"
                    else:
                        phase = "ERROR" if job["error"] else "ABORTED" if job["aborted"] else "COMPLETED"
                    return self._reply(200, phase.encode())
                if what == "error":
                    return self._reply(200, b"Query failed (injected)")
                if what == "results/result":
                    if job["error"]:
                        return self._reply(500, b"job failed")
                    rows = server.catalogue[
                        (server.catalogue.random_index >= job["lo"]) & (server.catalogue.random_index < job["hi"])
                    ]
                    body = votable_bytes(rows, job["query"])
                    if job["format"] == "votable_gzip":
                        body = gzip.compress(body)
                    if server._should_fail("slow", job["lo"]):
                        time.sleep(server.slow_seconds)
                    if server._should_fail("truncated", job["lo"]):
                        body = body[: len(body) // 2]
                    if server._should_fail("html", job["lo"]):
                        return self._reply(200, b"<html><body>Service under maintenance</body></html>", "text/html")
                    if server._should_fail("empty", job["lo"]):
                        return self._reply(200, b"", "application/x-votable+xml")
                    if server._should_fail("reset", job["lo"]):
                        return self._reset_after(200, body, "application/x-votable+xml")
                    if server._should_fail("drip", job["lo"]):
                        return self._drip(200, body, "application/x-votable+xml")
                    return self._reply(200, body, "application/x-votable+xml")
                return self._reply(404, b"unknown job resource")

        return Handler
