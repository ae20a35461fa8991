"""structlog set-up: JSON lines in production, readable output on a TTY."""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure_logging(fmt: str = "auto", level: str = "info") -> None:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        # Look sys.stderr up at each logger creation, never bind the object: it may be replaced
        # (pytest capture, a daemonised process) and the old one closed.
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    # Quieten chatty libraries; their warnings still show, as JSON lines too when logs are JSON
    # (a collector must not choke on a library's plain-text line).
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if use_json:
        for handler in logging.getLogger().handlers:
            if type(handler) is logging.StreamHandler:  # ours, not a test runner's capture
                handler.setFormatter(_JsonFormatter())
    for name in ("aiokafka", "botocore", "boto3", "urllib3", "py4j", "kafka"):
        logging.getLogger(name).setLevel(logging.WARNING if name != "aiokafka" else logging.ERROR)


class _JsonFormatter(logging.Formatter):
    """Standard-library records (aiokafka, botocore, py4j ...) as structlog-shaped JSON lines."""

    def format(self, record: logging.LogRecord) -> str:
        import datetime as dt

        import orjson

        body = {"event": record.getMessage(), "level": record.levelname.lower(),
                "logger": record.name,
                "timestamp": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat()}
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(body).decode()


def _stderr_logger(*_args: object) -> structlog.PrintLogger:
    return structlog.PrintLogger(file=sys.stderr)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(name)
    return logger
