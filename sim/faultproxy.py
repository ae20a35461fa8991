"""A fault-injecting HTTP proxy in front of the S3 server (the soak's, and fault tests').

Requests pass through to the real server; the proxy can answer the next N ``DeleteObjects``
requests with 503 SlowDown, can fail chosen keys inside a ``DeleteObjects`` request (they are
removed from the forwarded request and reported back as per-key ``<Error>`` entries, as real S3
does on partial failure), and can fail a seeded random share of delete requests and of the keys
inside them (``error_share``), can deliver chosen reads late (``late_reads``), and can fail a
listing part-way (``fail_listing``: its pages after the first, refused or cut short). Nothing here
imitates the reaper: it exercises it.

A request passes unchanged, its signature with it (the client's ``Host`` header is kept: SigV4
signs it). One whose body the proxy rewrites (keys taken out of a ``DeleteObjects``) is signed
again with the proxy's credentials, the S3 server's, as the client would have signed it: MinIO,
like S3, checks every signature and every body's hash. The one deleter's requests are signed
in the query string with an expiry (``core.deleter``): a rewritten one is signed again the
same way, with the original's date and expiry, so the store still refuses it once late.

(The fault tests import it through sim/faultproxy.py.)
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import random
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlparse
from xml.sax.saxutils import escape

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from core.deleter import ExpiringQueryAuth

_KEY_RE = re.compile(rb"<Object>\s*<Key>(.*?)</Key>.*?</Object>", re.S)
_SLOW_DOWN = b"<Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>"
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}
# Dropped from a rewritten request, and set again by its new signature.
_RESIGNED_HEADERS = {"host", "content-md5", "x-amz-sdk-checksum-algorithm", "authorization",
                     "x-amz-date", "x-amz-content-sha256", "x-amz-security-token"}


@dataclass
class Faults:
    throttle_deletes: int = 0  # next N DeleteObjects requests answer 503 SlowDown
    fail_keys: dict[str, tuple[str, int]] = field(default_factory=dict)  # key -> (code, times)
    hold_deletes: threading.Event | None = None  # DeleteObjects wait until this is set
    deletes_waiting: threading.Event = field(default_factory=threading.Event)
    drop_held: bool = False  # once released, held deletes are dropped, never forwarded
    # Once released, every held delete answers 503 SlowDown: each request that was in flight
    # while the test acted is retried (several sweep tasks may be in flight at once).
    throttle_held: bool = False
    delete_requests: int = 0
    deletes_forwarded: int = 0  # DeleteObjects the server has answered (it acted on them)
    # A seeded share of DeleteObjects requests answer 503, and the same share of the keys of
    # the others fail with InternalError (0 disables).
    error_share: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    injected_requests: int = 0
    injected_keys: int = 0
    keys_per_request: list[int] = field(default_factory=list)
    # An unconditional GET of a key ending with this suffix is answered by the server now and
    # delivered that many seconds late (a slow reply on a loaded machine).
    late_reads: tuple[str, float] | None = None
    # (prefix, how): every ListObjectsV2 page after the first of a listing whose prefix starts
    # with it is refused (``denied``: 403 AccessDenied) or its body cut in half (``truncated``)
    fail_listing: tuple[str, str] | None = None
    listings_failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class _QuietServer(ThreadingHTTPServer):
    """A client that gives up on a request (the deleter's bounded requests do) resets its
    connection: that is no proxy error worth a traceback."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


class FaultProxy:
    def __init__(self, upstream: str, *, access_key: str = "hardelete",
                 secret_key: str = "hardelete-secret", region: str = "us-east-1") -> None:
        """``upstream``: the S3 server; the keys are its (the embedded MinIO's by default)."""
        self.upstream = urlparse(upstream)
        self.faults = Faults()
        self._credentials = Credentials(access_key, secret_key)
        self._region = region
        self._signer = S3SigV4Auth(self._credentials, "s3", region)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                injected: list[tuple[str, str]] = []
                is_delete = self.command == "POST" and "delete" in self.path.split("?", 1)[-1]
                hold = proxy.faults.hold_deletes
                if is_delete and hold is not None:
                    held = not hold.is_set()
                    proxy.faults.deletes_waiting.set()
                    # (30 s ran out under a loaded suite: the request went on before the
                    # test's action, and a sweep test failed for the harness' reason)
                    hold.wait(120)
                    if proxy.faults.drop_held:
                        self.close_connection = True
                        return
                    if proxy.faults.throttle_held and held:
                        with proxy.faults.lock:
                            proxy.faults.delete_requests += 1
                        self._reply(503, _SLOW_DOWN)
                        return
                if is_delete:
                    with proxy.faults.lock:
                        proxy.faults.delete_requests += 1
                        proxy.faults.keys_per_request.append(len(_KEY_RE.findall(body)))
                        share = proxy.faults.error_share
                        random_503 = share > 0 and proxy.faults.rng.random() < share
                        if random_503:
                            proxy.faults.injected_requests += 1
                        if proxy.faults.throttle_deletes > 0 or random_503:
                            if not random_503:
                                proxy.faults.throttle_deletes -= 1
                            self._reply(503, _SLOW_DOWN)
                            return
                        body, injected = proxy._strip_failing(body)
                        if injected and not _KEY_RE.search(body):
                            # Every key failed: answer as S3 would, without an empty request.
                            errors = "".join(
                                f"<Error><Key>{escape(k)}</Key><Code>{c}</Code>"
                                f"<Message>injected</Message></Error>" for k, c in injected)
                            self._reply(200, f"<DeleteResult>{errors}</DeleteResult>".encode())
                            return
                failing = proxy._failing_listing(self.command, self.path)
                if failing == "denied":
                    self._reply(403, b"<Error><Code>AccessDenied</Code>"
                                     b"<Message>injected</Message></Error>")
                    return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in _HOP_HEADERS}
                path = self.path
                if injected:
                    path, headers = proxy._resign(self.command, self.path, headers, body)
                conn = http.client.HTTPConnection(proxy.upstream.hostname or "127.0.0.1",
                                                  proxy.upstream.port,
                                                  timeout=60)
                conn.request(self.command, path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                late = proxy.faults.late_reads
                if (late and self.command == "GET" and not self.headers.get("If-None-Match")
                        and self.path.split("?", 1)[0].endswith(late[0])):
                    time.sleep(late[1])
                if injected and resp.status == 200:
                    errors = "".join(
                        f"<Error><Key>{escape(k)}</Key><Code>{c}</Code>"
                        f"<Message>injected</Message></Error>" for k, c in injected)
                    data = data.replace(b"</DeleteResult>", errors.encode() + b"</DeleteResult>")
                if is_delete:
                    with proxy.faults.lock:
                        proxy.faults.deletes_forwarded += 1
                if failing == "truncated":
                    data = data[:len(data) // 2]
                self._reply(resp.status, data, resp.getheaders())
                conn.close()

            def _reply(self, status: int, data: bytes,
                       headers: list[tuple[str, str]] | None = None) -> None:
                self.send_response(status)
                for k, v in headers or []:
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _resign(self, method: str, path: str, headers: dict[str, str],
                body: bytes) -> tuple[str, dict[str, str]]:
        """(path, headers) of a request whose body changed, signed anew for the upstream."""
        kept = {k: v for k, v in headers.items()
                if k.lower() not in _RESIGNED_HEADERS and not k.lower().startswith(
                    "x-amz-checksum")}
        kept["Content-MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()
        base, _, query = path.partition("?")
        params = dict(parse_qsl(query, keep_blank_values=True))
        if "X-Amz-Signature" in params:  # query-signed: again so, same date and expiry
            date, expires = params["X-Amz-Date"], int(params["X-Amz-Expires"])
            rest = {k: v for k, v in params.items() if not k.startswith("X-Amz-")}
            req = AWSRequest(method=method, url=self.upstream._replace(path="").geturl() + base
                             + ("?" + urlencode(rest) if rest else ""), data=body, headers=kept)
            ExpiringQueryAuth(self._credentials, "s3", self._region,
                              expires=expires, timestamp=date).add_auth(req)
            return (str(req.url)[len(self.upstream._replace(path="").geturl()):],
                    dict(req.headers.items()))
        req = AWSRequest(method=method, url=self.upstream._replace(path="").geturl() + path,
                         data=body, headers=kept)
        self._signer.add_auth(req)
        return path, dict(req.headers.items())

    def _failing_listing(self, method: str, path: str) -> str | None:
        """How this request fails (``Faults.fail_listing``), or None."""
        rule = self.faults.fail_listing
        if rule is None or method != "GET" or "?" not in path:
            return None
        params = dict(parse_qsl(path.split("?", 1)[1], keep_blank_values=True))
        if params.get("list-type") != "2" or "continuation-token" not in params \
                or not params.get("prefix", "").startswith(rule[0]):
            return None
        with self.faults.lock:
            self.faults.listings_failed += 1
        return rule[1]

    def _strip_failing(self, body: bytes) -> tuple[bytes, list[tuple[str, str]]]:
        injected: list[tuple[str, str]] = []

        share = self.faults.error_share

        def keep(match: re.Match[bytes]) -> bytes:
            key = match.group(1).decode()
            if share > 0 and self.faults.rng.random() < share:
                self.faults.injected_keys += 1
                injected.append((key, "InternalError"))
                return b""
            rule = self.faults.fail_keys.get(key)
            if rule and rule[1] > 0:
                self.faults.fail_keys[key] = (rule[0], rule[1] - 1)
                injected.append((key, rule[0]))
                return b""
            return match.group(0)

        return _KEY_RE.sub(keep, body), injected

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
