"""The monitoring assets, held to the code: the alert rules (one source, ``compose/alerts.yml``;
Kubernetes gets the same text as a PrometheusRule), the dashboard, and the metrics the daemons
define, which every rule and panel may name and no other. Plus a real Prometheus for the tests
(Debian's, :func:`sim.install.prometheus_binaries`).

``python -m sim.monitoring`` writes ``deploy/k8s/monitoring/prometheusrule.yaml`` from the rules
(``--check``: exit 1 if it differs).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from sim import install
from sim.stack import Server, StackError, free_port

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "compose" / "alerts.yml"
PROMETHEUS_RULE = ROOT / "deploy" / "k8s" / "monitoring" / "prometheusrule.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "hardelete.json"
RUNBOOK = ROOT / "deploy" / "RUNBOOK.md"

# Series Prometheus makes itself, which rules may name besides the daemons' own.
PROMETHEUS_SERIES = frozenset({"up"})

_RULE_HEADER = """\
# Generated from compose/alerts.yml by `python -m sim.monitoring`: edit that file, not this one
# (tests/unit/project/test_alerts.py checks they are the same). For the Prometheus Operator;
# without it, give Prometheus compose/alerts.yml itself (its rule_files).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: hardelete
  namespace: hardelete
  labels: {app.kubernetes.io/name: hardelete}
spec:
"""


def prometheus_rule(rules_text: str) -> str:
    """The PrometheusRule manifest whose ``spec`` is the rules file, line for line."""
    body = "".join(f"  {line}" if line.strip() else line
                   for line in rules_text.splitlines(keepends=True))
    return _RULE_HEADER + body


# -- the metrics the code defines --

def _sample_names(registry: CollectorRegistry) -> set[str]:
    """The names of the samples each metric family exposes (a counter ``x``: ``x_total`` and
    ``x_created``; a histogram: its ``_bucket``, ``_count``, ``_sum`` and ``_created``)."""
    out: set[str] = set()
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",),
                "histogram": ("_bucket", "_count", "_sum", "_created"),
                "summary": ("", "_count", "_sum", "_created"), "info": ("_info",)}
    for family in registry.collect():
        out |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return out


def exported_metrics() -> frozenset[str]:
    """Every sample name the tracker, the reaper and the reconciler define."""
    import reaper.daemon
    from reconciler.metrics import registry_for
    from tracker.metrics import TrackerMetrics

    reaper_registry = CollectorRegistry()
    for value in vars(reaper.daemon).values():
        if isinstance(value, MetricWrapperBase):  # its module-level metrics
            reaper_registry.register(value)
    names = (_sample_names(TrackerMetrics().registry) | _sample_names(reaper_registry)
             | _sample_names(registry_for([])))
    return frozenset(names)


# -- the metric names a PromQL expression reads --

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_VARIABLES = re.compile(r"\$\{[^}]*\}|\$\w+")  # Grafana's
_NUMBERS = re.compile(r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d[\w.]*)")  # numbers and durations
_NAMES = re.compile(r"(?<![\w:])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on",
                       "ignoring", "group_left", "group_right", "inf", "nan", "atan2"})


def promql_metrics(expr: str) -> set[str]:
    """The metric names ``expr`` selects (not its functions, keywords or label names)."""
    text = _STRINGS.sub(" ", expr)
    text = _VARIABLES.sub(" ", text)
    # a selector may be written {__name__="x"}
    names = set(re.findall(r'__name__\s*=\s*"([^"]+)"', expr))
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _NUMBERS.sub(" ", text)
    for name, call in _NAMES.findall(text):
        if not call and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


# -- the rules and the dashboard, as text the tests parse --

@dataclass(frozen=True)
class Panel:
    title: str
    exprs: tuple[str, ...]


def dashboard_panels(dashboard: dict[str, Any]) -> list[Panel]:
    """Every panel (rows' nested panels too) with its queries."""
    out: list[Panel] = []

    def walk(panels: Iterable[dict[str, Any]]) -> None:
        for p in panels:
            exprs = tuple(str(t["expr"]) for t in p.get("targets", []) if "expr" in t)
            if p.get("type") != "row" or exprs:
                out.append(Panel(str(p.get("title", "")), exprs))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    return out


# -- a real Prometheus for the tests --

def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def prometheus_server(workdir: Path, config: Path) -> Server:
    """Prometheus on a free loopback port with ``config``, its storage under ``workdir``."""
    try:
        binary, _promtool = install.prometheus_binaries()
    except install.InstallError as exc:
        raise StackError(str(exc)) from None

    def argv(port: int) -> list[str]:
        return [binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
                f"--storage.tsdb.path={workdir / f'prometheus-data-{port}'}",
                "--log.level=warn"]

    return Server("prometheus", argv, free_port(), _ready, workdir)


def api(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/{path}", timeout=5) as resp:
        body = json.loads(resp.read())
    if body.get("status") != "success":
        raise StackError(f"Prometheus answered {body}")
    return body["data"]


def firing(port: int) -> list[dict[str, str]]:
    """The labels of every alert firing now (``/api/v1/alerts``)."""
    return [dict(a["labels"]) for a in api(port, "alerts")["alerts"] if a["state"] == "firing"]


def wait_firing(port: int, alertname: str, timeout: float = 20.0,
                **labels: str) -> dict[str, str]:
    """The labels of the first firing ``alertname`` whose labels include ``labels``."""
    deadline = time.monotonic() + timeout
    while True:
        now = firing(port)
        for alert in now:
            if alert.get("alertname") == alertname and labels.items() <= alert.items():
                return alert
        if time.monotonic() > deadline:
            raise TimeoutError(f"{alertname} {labels} not firing within {timeout}s; firing: "
                               f"{sorted(a.get('alertname', '') for a in now)}")
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sim.monitoring",
        description=f"Write {PROMETHEUS_RULE.relative_to(ROOT)} from "
                    f"{RULES.relative_to(ROOT)}.")
    parser.add_argument("--check", action="store_true", help="exit 1 if it is not up to date")
    args = parser.parse_args(argv)
    want = prometheus_rule(RULES.read_text())
    if args.check:
        same = PROMETHEUS_RULE.exists() and PROMETHEUS_RULE.read_text() == want
        print(f"{PROMETHEUS_RULE.relative_to(ROOT)}: {'up to date' if same else 'differs'}")
        return 0 if same else 1
    PROMETHEUS_RULE.parent.mkdir(parents=True, exist_ok=True)
    PROMETHEUS_RULE.write_text(want)
    print(f"wrote {PROMETHEUS_RULE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
