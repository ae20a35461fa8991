"""Which services a command needs, a fast check that they answer, and one line when they don't.

Before a command runs, the CLI checks the services it needs (a Redis PING, a TCP connection to
a Kafka bootstrap server, an HTTP request to the S3 endpoint), each within a couple of seconds.
A missing URL or a service that does not answer is one line naming the service and its URL, and
a non-zero exit, instead of minutes of client retries and a traceback. Errors raised later, when a
service goes away mid-command, are turned into the same kind of line by :func:`describe_error`.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass

from core.settings import Settings

TIMEOUT_S = 2.0

REDIS, KAFKA, S3 = "redis", "kafka", "s3"

# command path -> services it cannot work without; commands not listed check nothing up front.
NEEDS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("tracker", "run"): (KAFKA, REDIS),
    ("reaper", "run"): (REDIS, S3),
    ("restore",): (REDIS, S3),
    ("reconcile",): (REDIS, S3),
    ("status",): (REDIS,),
    ("explain",): (REDIS,),
    ("incidents", "list"): (REDIS,),
    ("incidents", "ack"): (REDIS,),
    ("hold", "add"): (REDIS,),
    ("hold", "remove"): (REDIS,),
    ("hold", "list"): (REDIS,),
    ("dlq", "list"): (KAFKA,),
    ("dlq", "show"): (KAFKA,),
    ("dlq", "replay"): (KAFKA,),
    ("dlq", "resolve"): (KAFKA, REDIS),
    ("quarantine", "list"): (REDIS, S3),
    ("quarantine", "purge"): (REDIS, S3),
    ("reports", "list"): (REDIS, S3),
    ("reports", "show"): (REDIS, S3),
    ("pause",): (REDIS,),
    ("resume",): (REDIS,),
    ("health",): (REDIS,),
    ("schedule",): (REDIS,),
}

_SETTING = {REDIS: "redis_url", KAFKA: "kafka_bootstrap", S3: "s3_endpoint_url"}
_NAME = {REDIS: "Redis", KAFKA: "Kafka", S3: "S3"}


class ServiceError(Exception):
    """A service a command needs is not configured or does not answer: one line."""


@dataclass(frozen=True)
class Service:
    kind: str
    url: str

    @property
    def name(self) -> str:
        return _NAME[self.kind]

    @property
    def env(self) -> str:
        return "HARDELETE_" + _SETTING[self.kind].upper()


def service(settings: Settings, kind: str) -> Service:
    return Service(kind, str(getattr(settings, _SETTING[kind])))


def needs(path: tuple[str, ...], args: object = None, impl: object = None) -> tuple[str, ...]:
    """The services a command needs: the command object's ``SERVICES`` (e.g. ``("redis",)``)
    when it declares them, else the table above."""
    declared = getattr(impl, "SERVICES", None)
    wanted = tuple(declared) if declared is not None else NEEDS.get(path, ())
    # explain reads the reconciler's reports from S3 unless told not to.
    if path == ("explain",) and not getattr(args, "no_reports", True):
        wanted = (*wanted, S3)
    # the reconciler's health is read from the reports its runs write in each namespace
    if path == ("health",) and getattr(args, "component", None) == "reconciler":
        wanted = (*wanted, S3)
    # a liveness probe reads the daemon's own endpoint only
    if path == ("health",) and getattr(args, "loop_only", False):
        wanted = ()
    return wanted


def check(settings: Settings, kinds: Iterable[str]) -> None:
    """Raise ServiceError for the first service that is unset or does not answer."""
    for kind in kinds:
        svc = service(settings, kind)
        if not svc.url:
            raise ServiceError(f"{svc.name} is not configured: set {_SETTING[kind]} "
                               f"({svc.env}); only `hardelete demo` starts embedded servers")
        problem = {REDIS: _redis_problem, KAFKA: _kafka_problem, S3: _s3_problem}[kind](svc.url)
        if problem:
            raise ServiceError(f"{svc.name} at {svc.url} is unreachable: {problem}")


def _redis_problem(url: str) -> str | None:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=TIMEOUT_S,
                                      socket_timeout=TIMEOUT_S)
    except ValueError as exc:
        return str(exc)
    try:
        client.ping()
    except redis.exceptions.RedisError as exc:
        return _first_line(exc)
    finally:
        client.close()
    return None


def _host_port(hostport: str, default: int) -> tuple[str, int]:
    host, sep, port = hostport.strip().rpartition(":")
    if not sep:
        return hostport.strip(), default
    return host.strip("[]"), int(port)


def _kafka_problem(bootstrap: str) -> str | None:
    """One bootstrap server that accepts a connection is enough (the client finds the rest)."""
    problems = []
    for hostport in filter(None, (h.strip() for h in bootstrap.split(","))):
        try:
            host, port = _host_port(hostport, 9092)
            with socket.create_connection((host, port), timeout=TIMEOUT_S):
                return None
        except ValueError:
            problems.append(f"{hostport}: not host:port")
        except OSError as exc:
            problems.append(f"{hostport}: {exc.strerror or exc}")
    return "; ".join(problems) or "no bootstrap server"


def _s3_problem(url: str) -> str | None:
    """Any HTTP answer (even 403) proves the endpoint is there; credentials are checked later."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"),
                               timeout=TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return str(getattr(reason, "strerror", None) or reason)
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def describe_error(exc: BaseException, settings: Settings | None) -> str | None:
    """One line for a service failing mid-command (None: not a service failure)."""

    def where(kind: str) -> str:
        if settings is None:
            return _NAME[kind]
        return f"{_NAME[kind]} at {service(settings, kind).url}"

    import redis

    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return f"{where(REDIS)} is unreachable: {_first_line(exc)}"
    try:
        from botocore.exceptions import (
            ConnectionClosedError,
            ConnectTimeoutError,
            EndpointConnectionError,
            ReadTimeoutError,
        )
    except ImportError:  # pragma: no cover - boto3 is a dependency
        pass
    else:
        if isinstance(exc, EndpointConnectionError | ConnectTimeoutError | ReadTimeoutError
                      | ConnectionClosedError):
            return f"{where(S3)} is unreachable: {_first_line(exc)}"
        from botocore.exceptions import ClientError, NoCredentialsError

        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            return (f"{where(S3)} refused {exc.operation_name}: {err.get('Code', '?')} "
                    f"{err.get('Message', '')}".rstrip())
        if isinstance(exc, NoCredentialsError):
            return f"{where(S3)}: no credentials (set s3_access_key, s3_secret_key)"
    try:
        from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError
    except ImportError:  # pragma: no cover
        pass
    else:
        if isinstance(exc, KafkaConnectionError | KafkaTimeoutError):
            return f"{where(KAFKA)} is unreachable: {_first_line(exc)}"
    return None
