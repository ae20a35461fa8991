"""One settings object for every component.

Values come from, in increasing precedence: the defaults below, an optional TOML file (the
``[hardelete]`` table of ``$HARDELETE_CONFIG`` or ``--config``), and ``HARDELETE_*`` environment
variables (the field name upper-cased). Validation happens once, at start-up, and a bad value
stops start-up with a :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ENV_PREFIX = "HARDELETE_"


class ConfigError(ValueError):
    """A configuration value is missing or wrong; the message names the key."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config {key}: {problem}")
        self.key = key
        self.problem = problem


def _positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


def _non_negative(v: float) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _port(v: int) -> str | None:
    return None if 0 <= v <= 65_535 else "must be a TCP port, 0..65535"


def _one_of(*choices: str) -> Callable[[str], str | None]:
    def check(v: str) -> str | None:
        return None if v in choices else f"must be one of {', '.join(choices)}"

    return check


def _url(*schemes: str) -> Callable[[str], str | None]:
    def check(v: str) -> str | None:
        if not v:
            return None  # empty means "embedded/default"
        if not any(v.startswith(s) for s in schemes):
            return f"must start with {' or '.join(schemes)}"
        return None

    return check


def _opt(check: Callable[[Any], str | None] | None = None, doc: str = "") -> dict[str, Any]:
    return {"check": check, "doc": doc}


@dataclass(frozen=True)
class Settings:
    # --- where the real parts are (empty: start the embedded stack, see sim.stack) ---
    kafka_bootstrap: str = field(default="", metadata=_opt(doc="host:port[,host:port]"))
    redis_url: str = field(
        default="", metadata=_opt(_url("redis://", "rediss://", "unix://"), "Redis URL")
    )
    redis_cluster: bool = field(default=False, metadata=_opt(doc="redis_url is a cluster node"))
    s3_endpoint_url: str = field(
        default="", metadata=_opt(_url("http://", "https://"), "S3 endpoint")
    )
    s3_region: str = "us-east-1"
    # The embedded MinIO's credentials (compose/'s too); MinIO wants 3+ and 8+ characters.
    s3_access_key: str = "hardelete"
    s3_secret_key: str = "hardelete-secret"

    # --- Kafka ---
    events_topic: str = "hardelete.events"
    dlq_topic: str = "hardelete.events.dlq"
    control_topic: str = "hardelete.control"
    topic_partitions: int = field(default=4, metadata=_opt(_positive))
    topic_replication_factor: int = field(default=1, metadata=_opt(_positive))
    consumer_group: str = "hardelete-tracker"
    session_timeout_ms: int = field(default=10_000, metadata=_opt(_positive))
    heartbeat_interval_ms: int = field(default=3_000, metadata=_opt(_positive))

    # --- tracker ---
    tracker_batch_max: int = field(default=5_000, metadata=_opt(_positive))
    tracker_poll_ms: int = field(default=200, metadata=_opt(_positive))
    tracker_catchup_wait_ms: int = field(default=3_000, metadata=_opt(_positive))

    # --- reaper ---
    grace_seconds: float = field(default=3_600.0, metadata=_opt(_non_negative))
    repository_grace: str = ""
    min_safe_grace_seconds: float = field(default=300.0, metadata=_opt(_non_negative))
    allow_unsafe_grace: bool = False
    lease_seconds: float = field(default=120.0, metadata=_opt(_positive))
    s3_request_seconds: int = field(default=10, metadata=_opt(_positive))
    clock_skew_seconds: float = field(default=1.0, metadata=_opt(_non_negative))
    tombstone_days: float = field(default=7.0, metadata=_opt(_positive))
    retired_retention_days: float = field(default=7.0, metadata=_opt(_non_negative))
    reaper_batch_keys: int = field(default=1_000, metadata=_opt(_positive))
    reaper_concurrency: int = field(default=8, metadata=_opt(_positive))
    reaper_poll_seconds: float = field(default=1.0, metadata=_opt(_positive))
    quarantine_days: float = field(
        default=0.0, metadata=_opt(_non_negative, "0: delete; >0: move to quarantine for N days")
    )

    # --- uploads ---
    upload_token_secret: str = "hardelete-dev-secret-change-me"  # DEFAULT_UPLOAD_TOKEN_SECRET
    reaper_secret: str = ""
    upload_ttl_seconds: float = field(default=3_600.0, metadata=_opt(_positive))

    # --- reconciler ---
    spark_master: str = "local[2]"
    spark_shuffle_partitions: int = field(default=0, metadata=_opt(_non_negative))
    reconcile_min_age_seconds: float = field(default=6 * 3_600.0, metadata=_opt(_non_negative))
    uncommitted_export: str = ""
    uncommitted_export_max_age_seconds: float = field(default=2 * 86_400.0,
                                                      metadata=_opt(_positive))
    # The tracker's self-healing (tracker/rebuild.py): how often it prepares a rebuild for a
    # fail-closed repository and looks for the service's state export; 0: only by command.
    rebuild_interval_seconds: float = field(default=10.0, metadata=_opt(_non_negative))
    tick_interval_seconds: float = field(default=1.0, metadata=_opt(_positive))
    resend_interval_seconds: float = field(default=5.0, metadata=_opt(_positive))
    sweep_max_share: float = field(default=0.5, metadata=_opt(
        lambda v: None if 0 < v <= 1 else "must be > 0 and <= 1"))
    sweep_max_growth: float = field(default=10.0, metadata=_opt(_positive))
    sweep_growth_floor: int = field(default=1_000, metadata=_opt(_non_negative))
    sweep_history_runs: int = field(default=7, metadata=_opt(_non_negative))

    # --- operations ---
    metrics_port: int = field(default=0, metadata=_opt(_port, "0 disables the endpoint"))
    metrics_textfile: str = ""
    pushgateway_url: str = field(default="", metadata=_opt(_url("http://", "https://")))
    tracker_stale_seconds: float = field(default=60.0, metadata=_opt(_positive))
    log_format: str = field(default="auto", metadata=_opt(_one_of("auto", "json", "console")))
    log_level: str = field(
        default="info", metadata=_opt(_one_of("debug", "info", "warning", "error"))
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            check = f.metadata.get("check")
            problem = check(value) if check else None
            if problem:
                raise ConfigError(f.name, f"{problem} (got {value!r})")
        if self.reaper_batch_keys > 1_000:
            raise ConfigError("reaper_batch_keys", "S3 accepts at most 1000 keys per delete")
        graces = {"grace_seconds": self.grace_seconds}
        graces.update({f"repository_grace.{r}": g for r, g in self.repository_graces().items()})
        for key, grace in graces.items():
            if grace < self.min_safe_grace_seconds and not self.allow_unsafe_grace:
                raise ConfigError(
                    key,
                    f"{grace:g}s is under the safe minimum {self.min_safe_grace_seconds:g}s; "
                    "set allow_unsafe_grace=true to force it",
                )

    def repository_graces(self) -> dict[str, float]:
        """Per-repository grace windows from ``repository_grace`` ("repo=seconds,...")."""
        out: dict[str, float] = {}
        for item in filter(None, (p.strip() for p in self.repository_grace.split(","))):
            repo, sep, value = item.partition("=")
            try:
                if not sep or not repo.strip():
                    raise ValueError
                out[repo.strip()] = float(value)
            except ValueError:
                raise ConfigError("repository_grace",
                                  f"expected repo=seconds[,repo=seconds], got {item!r}") from None
            if out[repo.strip()] < 0:
                raise ConfigError(f"repository_grace.{repo.strip()}", "must be >= 0")
        return out

    def grace_for(self, repo: str) -> float:
        """The grace window of a repository: its own if configured, else the global default."""
        return self.repository_graces().get(repo, self.grace_seconds)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


# What each setting is for: `hardelete config`, the README's configuration table.
DOCS: dict[str, str] = {
    "kafka_bootstrap": "Kafka bootstrap servers host:port[,...]; empty: embedded Apache Kafka",
    "redis_url": "Redis URL; empty: embedded redis-server/valkey-server",
    "redis_cluster": "treat redis_url as a Redis Cluster node",
    "s3_endpoint_url": "S3 endpoint URL; empty: embedded MinIO server",
    "s3_region": "S3 region",
    "s3_access_key": "S3 access key id",
    "s3_secret_key": "S3 secret key",
    "events_topic": "topic the services publish events to",
    "dlq_topic": "dead-letter topic for malformed events (reason in a header)",
    "control_topic": "topic of the tracker's signed ticks and re-send requests, which the "
                     "services' relays consume (schemas/control.py)",
    "topic_partitions": "partitions when the topics are created",
    "topic_replication_factor": "replication factor when the topics are created (3 in production)",
    "consumer_group": "tracker consumer group",
    "session_timeout_ms": "Kafka consumer session timeout",
    "heartbeat_interval_ms": "Kafka consumer heartbeat interval",
    "tracker_batch_max": "most events fetched and applied in one tracker batch",
    "tracker_poll_ms": "longest wait of one fetch",
    "tracker_catchup_wait_ms": "longest wait of one fetch while behind the log's end "
                               "(a broker may answer with what it read within the wait)",
    "grace_seconds": "how long after its last reference ended (tracker clock) an address may go",
    "min_safe_grace_seconds": "grace windows under this are refused unless allow_unsafe_grace",
    "repository_grace": "per-repository grace windows: repo=seconds[,repo=seconds]",
    "allow_unsafe_grace": "accept a grace window under min_safe_grace_seconds",
    "lease_seconds": "a reaper's claim on an address expires after this",
    "s3_request_seconds": "a delete or copy request is void after this (its signature expires; "
                          "the S3 client's timeouts too): restore waits it out",
    "clock_skew_seconds": "the largest clock difference between the reaper, the S3 store, "
                          "Redis and the operator's host, and the most a repository's Redis "
                          "clock may jump forward (a node's clock stepped, a failover to a "
                          "replica whose clock is ahead): a tick's time is lowered by this",
    "tombstone_days": "reaped addresses are remembered this long to catch late references",
    "retired_retention_days": "a retired repository's data is kept this long (its namespace "
                              "is not given to another repository meanwhile), then purged",
    "reaper_batch_keys": "keys per S3 delete_objects request (at most 1000)",
    "reaper_concurrency": "delete requests in flight per reaper",
    "reaper_poll_seconds": "reaper idle poll interval",
    "quarantine_days": "0: delete; >0: move to the quarantine prefix and keep N days",
    "upload_token_secret": "HMAC secret that signs upload tokens",
    "reaper_secret": "HMAC key that signs addresses_reaped (reaper and tracker share it); empty: "
                     "one minted in the tracker's Redis (hd:reaperkey), never given to publishers",
    "upload_ttl_seconds": "lifetime of an issued upload address",
    "spark_master": "Spark master for the reconciler",
    "spark_shuffle_partitions": "Spark SQL shuffle partitions; 0: 4 in local mode, 200 on a "
                                "cluster",
    "reconcile_min_age_seconds": "reconciler cutoff: younger objects are never candidates",
    "uncommitted_export": "the service's uncommitted-address export for the reconciler: a path, "
                          "s3:// prefix ({repo} is replaced), or 'namespace' "
                          "(<namespace>_hardelete/exports/); empty: none",
    "uncommitted_export_max_age_seconds": "a named uncommitted export older than this refuses "
                                          "the run; a state export too (rebuild)",
    "tick_interval_seconds": "how often the tracker asks the services' relays for a watermark "
                             "of each sequenced repository (a signed tick on the control topic)",
    "resend_interval_seconds": "how long the tracker waits before asking a relay again for a "
                               "range of seqs it is missing",
    "rebuild_interval_seconds": "how often the tracker prepares the rebuild of a fail-closed "
                                "repository and applies its service's state export (0: only "
                                "by command)",
    "sweep_max_share": "a repository's first sweep deleting more than this share of the listed "
                       "objects is refused without --allow-large-sweep",
    "sweep_max_growth": "a later sweep deleting more than this many times the median of the "
                        "repository's recent completed sweeps is refused",
    "sweep_growth_floor": "a sweep of at most this many objects is never refused (small and "
                          "young repositories)",
    "sweep_history_runs": "how many recent completed sweeps make a repository's usual size",
    "metrics_port": "Prometheus metrics port; 0 disables the endpoint",
    "metrics_textfile": "reconciler: write run metrics here (node-exporter textfile, *.prom)",
    "pushgateway_url": "reconciler: push run metrics to this Prometheus Pushgateway",
    "tracker_stale_seconds": "status/health: the tracker is stale when its progress is older",
    "log_format": "auto (console on a TTY, else JSON), json or console",
    "log_level": "debug, info, warning or error",
}


def _coerce(key: str, raw: Any, kind: Any) -> Any:
    kind_name = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    try:
        if kind_name == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off", ""):
                return False
            raise ValueError
        if kind_name == "int":
            if isinstance(raw, bool):
                raise ValueError
            return int(raw)
        if kind_name == "float":
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if kind_name == "str":
            if isinstance(raw, dict):  # a TOML table such as [hardelete.repository_grace]
                return ",".join(f"{k}={v}" for k, v in raw.items())
            if not isinstance(raw, str | int | float):
                raise ValueError
            return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(key, f"expected {kind_name}, got {raw!r}") from None
    raise ConfigError(key, f"unsupported type {kind_name}")


# HARDELETE_* variables that are not settings but are read by the CLI.
_ENV_NAMES = frozenset({ENV_PREFIX + "CONFIG"}
                       | {ENV_PREFIX + f.name.upper() for f in fields(Settings)})


def _unknown_env(name: str) -> str:
    """A misspelt variable would silently leave a default in force (say, hard deletes instead
    of quarantine): refuse it, and suggest the closest known name."""
    import difflib

    close = difflib.get_close_matches(name, sorted(_ENV_NAMES), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"unknown variable (no such setting){hint}"


def load_settings(
    config_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Build and validate the settings; raises ConfigError naming the bad key."""
    return load_with_sources(config_file, env, **overrides)[0]


DEFAULT_UPLOAD_TOKEN_SECRET = "hardelete-dev-secret-change-me"


def load_with_sources(
    config_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> tuple[Settings, dict[str, str]]:
    """The settings and, per setting, where its value came from: ``default``, ``file PATH``,
    ``env NAME`` or ``override`` (what ``hardelete config`` shows)."""
    env = os.environ if env is None else env
    sources: dict[str, str] = {}
    known = {f.name: f for f in fields(Settings)}
    values: dict[str, Any] = {}

    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError("config", f"file {str(p)!r} does not exist")
        try:
            doc = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"{p} is not valid TOML: {exc}") from None
        table = doc.get("hardelete", doc)
        for key, raw in table.items():
            if key not in known:
                import difflib

                close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ConfigError(key, f"unknown key in {p}{hint}")
            values[key] = _coerce(key, raw, known[key].type)
            sources[key] = f"file {p}"

    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in _ENV_NAMES)
    if unknown:
        raise ConfigError(unknown[0], _unknown_env(unknown[0]))

    for name, f in known.items():
        raw_env = env.get(ENV_PREFIX + name.upper())
        if raw_env is not None:
            values[name] = _coerce(ENV_PREFIX + name.upper(), raw_env, f.type)
            sources[name] = f"env {ENV_PREFIX + name.upper()}"

    for key, raw in overrides.items():
        if key not in known:
            raise ConfigError(key, "unknown setting")
        values[key] = raw
        sources[key] = "override"
    return Settings(**values), {name: sources.get(name, "default") for name in known}


def describe() -> list[tuple[str, str, str]]:
    """(env var, default, doc) for every setting: the README's configuration table."""
    rows = []
    for f in fields(Settings):
        rows.append((ENV_PREFIX + f.name.upper(), repr(f.default), DOCS.get(f.name, "")))
    return rows
