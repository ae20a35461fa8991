"""The alert rules, their runbook and the dashboard, held to the code: one source of rules for
compose and Kubernetes, promtool's checks and unit tests (alerts_test.yml, alerts_daily_test.yml:
each alert under its fault and quiet without it), every metric a rule or a panel names defined
by a daemon, every alert with its runbook section. The live test, a real Prometheus scraping the
daemons with faults injected, is tests/integration/hardelete/test_alerts_fire.py."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sim import install
from sim.monitoring import (
    DASHBOARD,
    PROMETHEUS_RULE,
    PROMETHEUS_SERIES,
    ROOT,
    RULES,
    RUNBOOK,
    dashboard_panels,
    exported_metrics,
    prometheus_rule,
    promql_metrics,
)

HERE = Path(__file__).parent
PROMTOOL_TESTS = [HERE / "alerts_test.yml", HERE / "alerts_daily_test.yml"]
JOBS = {"hardelete-tracker", "hardelete-reaper", "hardelete-reconciler"}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        _prometheus, promtool = install.prometheus_binaries()
    except install.InstallError as exc:
        pytest.fail(str(exc))
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120)


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"]]


def _alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for r in _rules() if "alert" in r}


def test_the_rules_pass_promtool_check(tmp_path: Path) -> None:
    proc = _promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the Kubernetes copy too (its spec is a rules file)
    spec = tmp_path / "spec.yml"
    spec.write_text(yaml.safe_dump(yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]))
    proc = _promtool("check", "rules", str(spec))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_each_alert_fires_under_its_fault_in_promtool() -> None:
    proc = _promtool("test", "rules", *map(str, PROMTOOL_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in PROMTOOL_TESTS:
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["../../../compose/alerts.yml"]
        for group in doc["tests"]:
            for case in group.get("alert_rule_test", []):
                (firing if case["exp_alerts"] else quiet).add(case["alertname"])
    assert firing == set(_alerts()), "every alert has a case where it fires"
    assert quiet == set(_alerts()), "and one where it does not"


def test_the_promtool_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    """The same tests against a rule that lost its _created clause fail: a restarted tracker's
    first incident would go unnoticed."""
    text = RULES.read_text()
    broken = text.replace("""          or (hardelete_tracker_incidents_total > 0
              and time() - hardelete_tracker_incidents_created < 1800)
""", "")
    assert broken != text
    (tmp_path / "compose").mkdir()
    (tmp_path / "compose" / "alerts.yml").write_text(broken)
    tests = tmp_path / "a" / "b" / "c"
    tests.mkdir(parents=True)
    (tests / "alerts_test.yml").write_text(PROMTOOL_TESTS[0].read_text())
    proc = _promtool("test", "rules", str(tests / "alerts_test.yml"))
    assert proc.returncode != 0 and "HardeleteIncident" in proc.stdout + proc.stderr


def test_kubernetes_gets_the_same_rules() -> None:
    """One source: deploy/k8s/monitoring/prometheusrule.yaml is compose/alerts.yml, line for
    line, under a PrometheusRule (python -m sim.monitoring writes it)."""
    assert PROMETHEUS_RULE.read_text() == prometheus_rule(RULES.read_text()), \
        "run: python -m sim.monitoring"
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    monitoring = PROMETHEUS_RULE.parent
    listed = yaml.safe_load((monitoring / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in monitoring.glob("*.yaml")
                                    if p.name != "kustomization.yaml")


def test_the_scrape_jobs_are_the_ones_the_rules_name() -> None:
    """compose's Prometheus and the Kubernetes PodMonitor name the daemons' jobs as the rules
    do (a rule reading another job would never fire)."""
    named = set()
    for rule in _rules():
        named |= set(re.findall(r'job(?:=~?)"([^"]+)"', rule["expr"]))
    jobs = {j for pattern in named for j in pattern.split("|")}
    assert jobs == JOBS
    prom = yaml.safe_load((ROOT / "compose/prometheus.yml").read_text())
    assert {j["job_name"] for j in prom["scrape_configs"]} == JOBS
    assert prom["rule_files"] == ["/etc/prometheus/alerts.yml"]
    monitor = yaml.safe_load((PROMETHEUS_RULE.parent / "podmonitor.yaml").read_text())
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (relabel,) = endpoint["relabelings"]
    assert relabel["targetLabel"] == "job" and relabel["replacement"] == "hardelete-$1"
    assert relabel["sourceLabels"] == [
        "__meta_kubernetes_pod_label_app_kubernetes_io_component"]
    (expr,) = monitor["spec"]["selector"]["matchExpressions"]
    for component in expr["values"]:
        assert f"hardelete-{component}" in JOBS
        doc = yaml.safe_load((ROOT / f"deploy/k8s/{component}.yaml").read_text().split(
            "\n---\n")[0])
        pod = doc["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert labels["app.kubernetes.io/component"] == component
        ports = [p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]
        assert endpoint["port"] in ports


def test_every_rule_and_panel_names_a_metric_the_daemons_define() -> None:
    known = exported_metrics() | PROMETHEUS_SERIES
    for name, rule in _alerts().items():
        names = promql_metrics(rule["expr"])
        assert names, name
        assert names <= known, f"{name} reads {sorted(names - known)}, which no daemon defines"
    panels = dashboard_panels(json.loads(DASHBOARD.read_text()))
    assert len(panels) >= 20
    for panel in panels:
        assert panel.exprs, panel.title
        for expr in panel.exprs:
            names = promql_metrics(expr)
            assert names and names <= known, \
                f"panel {panel.title!r} reads {sorted(names - known)}, which no daemon defines"
    # every metric of the daemons is on the dashboard
    shown = {n for p in panels for e in p.exprs for n in promql_metrics(e)}
    families = {re.sub(r"_(total|created|bucket|count|sum)$", "", n) for n in known}
    missing = {f for f in families if not any(s.startswith(f) for s in shown)}
    assert not missing, f"not on the dashboard: {sorted(missing)}"


def test_the_dashboard_queries_are_promql(tmp_path: Path) -> None:
    """Each query parses (promtool checks it as a recording rule's expression)."""
    panels = dashboard_panels(json.loads(DASHBOARD.read_text()))
    rules = [{"record": f"panel:{i}:{j}", "expr": e.replace("$__rate_interval", "5m")}
             for i, p in enumerate(panels) for j, e in enumerate(p.exprs)]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = _promtool("check", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(rules)} rules found" in proc.stdout


def test_the_metric_names_are_read_from_promql() -> None:
    assert promql_metrics('sum by (repository, reason) (increase(a_total{reason=~"x|y"}[10m]))'
                          ' > 0') == {"a_total"}
    assert promql_metrics("time() - max by (partition) (p_ms) / 1000 > 180") == {"p_ms"}
    assert promql_metrics('x offset 15m unless on(job) group_left(le) y or absent(up{job="a"})'
                          " + 1e3 + Inf") == {"x", "y", "up"}
    assert promql_metrics(f"rate(z_bucket[$__rate_interval]) * {2}") == {"z_bucket"}
    assert promql_metrics('{__name__="w"} and bool 1') == {"w"}
    # and a misspelt one is caught
    known = exported_metrics()
    assert promql_metrics("rate(hardelete_tracker_event_applied_total[5m])") - known == {
        "hardelete_tracker_event_applied_total"}


def test_every_alert_has_a_runbook_entry() -> None:
    text = RUNBOOK.read_text()
    sections = re.findall(r"^## (\S+)$", text, flags=re.M)
    alerts = _alerts()
    assert sections == list(alerts), "one section per alert, in the rules' order"
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["runbook_url"] == f"deploy/RUNBOOK.md#{name.lower()}"
        assert rule["annotations"]["summary"], name
        body = text.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("**Meaning.**", "**Check.**", "**Act.**"):
            assert part in body, f"{name}: {part}"


def test_compose_runs_the_tested_prometheus_and_routes_to_an_alertmanager(
        tmp_path: Path) -> None:
    """compose's Prometheus is the version the rules are tested on, its configuration passes
    promtool, and its alerts reach the Alertmanager service, whose routes name its receivers."""
    version = re.search(r"version (\d+\.\d+\.\d+)", _promtool("--version").stdout)
    assert version
    compose = yaml.safe_load((ROOT / "compose/compose.yaml").read_text())["services"]
    assert compose["prometheus"]["image"] == f"prom/prometheus:v{version.group(1)}"
    prom = yaml.safe_load((ROOT / "compose/prometheus.yml").read_text())
    (manager,) = prom["alerting"]["alertmanagers"]
    assert manager["static_configs"] == [{"targets": ["alertmanager:9093"]}]
    am = compose["alertmanager"]
    assert "./alertmanager.yml:/etc/alertmanager/alertmanager.yml:ro" in am["volumes"]
    assert "9093:9093" in am["ports"]
    routes = yaml.safe_load((ROOT / "compose/alertmanager.yml").read_text())
    receivers = {r["name"] for r in routes["receivers"]}
    assert routes["route"]["receiver"] in receivers
    assert {r["receiver"] for r in routes["route"].get("routes", [])} <= receivers
    # promtool checks the configuration with the rules where it would mount them
    (tmp_path / "alerts.yml").write_text(RULES.read_text())
    prom["rule_files"] = [str(tmp_path / "alerts.yml")]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prom))
    proc = _promtool("check", "config", str(config))
    assert proc.returncode == 0, proc.stdout + proc.stderr
