"""The alert rules on a real Prometheus (Debian's 2.42) scraping real daemons: `hardelete tracker
run` and `hardelete reaper run` on the embedded stack, each fault injected, each alert awaited
on Prometheus' /api/v1/alerts. The rules are compose/alerts.yml with every `for:` at 0 and a
quarter-second scrape and evaluation, so an alert fires within a second of its fault."""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from core.clients import redis_sync
from core.settings import Settings
from schemas import events as ev
from schemas.layout import RepoKeys
from schemas.publisher import Publisher, ensure_topics
from sim.monitoring import RULES, api, firing, prometheus_server, wait_firing
from sim.stack import Server, free_port
from sim.testing import publish, wait_horizon

# The fault alerts: none may fire before its fault.
FAULTS = ("HardeleteIncident", "HardeleteDeadLetters", "HardeleteRepositoryFailClosed")


def _hardelete() -> list[str]:
    exe = Path(sys.executable).parent / "hardelete"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "hardelete.cli"]


def _metrics_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1):
            return True
    except OSError:
        return False


def _daemon(name: str, s: Settings, workdir: Path) -> Server:
    port = free_port()
    env = {f"HARDELETE_{k.upper()}": str(getattr(s, k)) for k in (
        "kafka_bootstrap", "redis_url", "s3_endpoint_url", "s3_access_key", "s3_secret_key",
        "events_topic", "dlq_topic", "consumer_group")}
    env |= {"HARDELETE_METRICS_PORT": str(port), "HARDELETE_SESSION_TIMEOUT_MS": "3000",
            "HARDELETE_HEARTBEAT_INTERVAL_MS": "1000", "HARDELETE_TRACKER_POLL_MS": "50",
            "HARDELETE_GRACE_SECONDS": "1", "HARDELETE_ALLOW_UNSAFE_GRACE": "true",
            "HARDELETE_REAPER_POLL_SECONDS": "0.1", "HARDELETE_REBUILD_INTERVAL_SECONDS": "0",
            "HARDELETE_LOG_FORMAT": "json"}
    return Server(name, lambda _p: [*_hardelete(), name, "run"], port, _metrics_ok, workdir,
                  env=env)


def _config(workdir: Path, tracker: int, reaper: int) -> Path:
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("for", None)  # at once: the test waits on the fault, not on the clock
    rules = workdir / "alerts.yml"
    rules.write_text(yaml.safe_dump(doc))
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "250ms", "scrape_timeout": "200ms",
                   "evaluation_interval": "250ms"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": "hardelete-tracker",
             "static_configs": [{"targets": [f"127.0.0.1:{tracker}"]}]},
            {"job_name": "hardelete-reaper",
             "static_configs": [{"targets": [f"127.0.0.1:{reaper}"]}]},
        ]}))
    return config


def _wait(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout}s"
        time.sleep(0.1)


async def test_each_fault_fires_its_alert_on_a_real_prometheus(
        settings: Settings, bucket: str, tmp_path: Path) -> None:
    s = settings
    repo, ns = "alerts", f"s3://{bucket}/alerts/"
    gone = ns + "data/gone"
    await ensure_topics(s)
    await publish(s, [
        ev.RepositoryCreated(repository=repo, storage_namespace=ns, default_branch="main",
                             default_retention_days=1.0),
        ev.ObjectDeleted(repository=repo, branch="main", staging_token="t", path="p",
                         address=gone, ref_id="r1")])
    tracker, reaper = _daemon("tracker", s, tmp_path), _daemon("reaper", s, tmp_path)
    prom = prometheus_server(tmp_path, _config(tmp_path, tracker.port, reaper.port))
    servers = [prom, tracker, reaper]
    r = redis_sync(s)
    try:
        await asyncio.gather(*(asyncio.to_thread(x.start, 60.0, move_on_clash=False)
                               for x in servers))
        port = prom.port

        def both_up() -> bool:
            targets = api(port, "targets")["activeTargets"]
            return sorted(t["health"] for t in targets) == ["up", "up"]

        def evaluated_up() -> bool:  # a rule evaluation after both answered
            return not any(a["alertname"] == "HardeleteDaemonDown" for a in firing(port))

        await asyncio.to_thread(_wait, both_up, "both daemons scraped")
        await asyncio.to_thread(_wait, evaluated_up, "an evaluation with both up")
        assert not [a for a in firing(port) if a["alertname"] in FAULTS]

        # A dead letter, and a copy published for an address the reaper took: an incident.
        await wait_horizon(s, await publish(s, []))
        k = RepoKeys(repo)
        r.hset(k.address(gone), mapping={"state": "reaped", "reaped_at": "1"})
        r.zrem(k.unreferenced, gone)
        async with Publisher(s) as pub:
            await pub.publish_raw(b"not json", repo.encode())
            await pub.publish(ev.ObjectCopied(
                repository=repo, branch="main", staging_token="t2", path="q", address=gone,
                size=1, ref_id="r2", source_read_at=1.0, event_id="late-copy"))
        dead = await asyncio.to_thread(wait_firing, port, "HardeleteDeadLetters",
                                       reason_kind="not_valid_JSON")
        incident = await asyncio.to_thread(wait_firing, port, "HardeleteIncident",
                                           job="hardelete-tracker")
        assert dead["severity"] == "warning" and incident["severity"] == "critical"
        assert r.llen(k.incidents) == 1

        # The repository fails closed: every reaper pass skips it.
        r.hset(k.fail_closed, mapping={"reason": "test: log reset", "at_ms": "1"})
        await asyncio.to_thread(wait_firing, port, "HardeleteRepositoryFailClosed",
                                repository=repo, reason="fail_closed")

        # The tracker dies.
        tracker.kill()
        down = await asyncio.to_thread(wait_firing, port, "HardeleteDaemonDown",
                                       job="hardelete-tracker")
        assert down["instance"] == f"127.0.0.1:{tracker.port}"
        assert not [a for a in firing(port) if a["alertname"] == "HardeleteDaemonDown"
                    and a["job"] == "hardelete-reaper"]
    finally:
        r.close()
        for x in reversed(servers):
            x.stop()
