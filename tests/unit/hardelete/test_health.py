"""`hardelete health`'s pure judgments: a daemon's loop from its own metrics, and reconciling
from each repository's newest real run."""

from __future__ import annotations

import http.server
import os
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hardelete.health import LastRun, judge_reconciler, loop_problem, metric_value

H = 3_600_000
BODY = (b"# HELP hardelete_reaper_progress_timestamp_seconds when ...\n"
        b"# TYPE hardelete_reaper_progress_timestamp_seconds gauge\n"
        b"hardelete_reaper_progress_timestamp_seconds_extra 5.0\n"
        b"hardelete_reaper_progress_timestamp_seconds 1.7e+09\n")


def test_metric_value_reads_the_unlabelled_sample_by_its_exact_name() -> None:
    assert metric_value(BODY, "hardelete_reaper_progress_timestamp_seconds") == 1.7e9
    assert metric_value(BODY, "hardelete_tracker_cycle_timestamp_seconds") is None
    assert metric_value(b"x not-a-number\n", "x") is None


def test_a_loop_is_stuck_once_its_last_step_is_older_than_the_limit() -> None:
    name = b"hardelete_tracker_cycle_timestamp_seconds"
    assert loop_problem("tracker", name + b" 100.0\n", 159.0, 60) is None
    stuck = loop_problem("tracker", name + b" 100.0\n", 161.0, 60)
    assert stuck is not None and stuck.startswith("its loop is stuck: no step completed for 61s")
    assert "not completed a step yet" in str(loop_problem("tracker", name + b" 0.0\n", 1, 60))
    assert "not completed a step yet" in str(loop_problem("reaper", BODY[:40], 1, 60))


def _ok(started_ms: int, rid: str = "r1") -> LastRun:
    return LastRun(rid, started_ms, True, None)


def test_reconciler_health_from_the_newest_runs() -> None:
    now = 100 * H
    assert judge_reconciler({}, now, 26) is None  # nothing to reconcile
    assert judge_reconciler({"a": _ok(now - 25 * H), "b": None}, now, 26) is None
    late = judge_reconciler({"a": _ok(now - 27 * H)}, now, 26)
    assert late == "the last reconcile run of a (r1) started 27.0 h ago (> 26 h)"
    failed = judge_reconciler({"a": LastRun("r2", now, False, "sweep refused")}, now, 26)
    assert failed == "the last reconcile run of a (r2) failed: sweep refused"
    never = "no reconcile run has reported in any repository's namespace"
    assert judge_reconciler({"a": None}, now, 26) == never
    # a scheduler that has not run yet waits one period for its first run, not longer
    assert judge_reconciler({"a": None}, now, 26, scheduler_started_ms=now - 2 * H) is None
    assert judge_reconciler({"a": None}, now, 26, scheduler_started_ms=now - 27 * H) == never


@given(st.dictionaries(st.sampled_from("abcd"), st.one_of(st.none(), st.builds(
    LastRun, st.just("r"), st.integers(0, 200 * H), st.booleans(), st.none()))),
       st.integers(0, 200 * H), st.floats(1, 48))
def test_healthy_only_if_every_run_shown_succeeded_within_the_age(
        runs: dict[str, LastRun | None], now: int, hours: float) -> None:
    problem = judge_reconciler(runs, now, hours)
    shown = [r for r in runs.values() if r is not None]
    fine = all(r.ok and now - r.started_ms <= hours * H for r in shown)
    assert (problem is None) == (fine and (bool(shown) or not runs))


class _Metrics(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(type(self).body)

    def log_message(self, *args: object) -> None:
        pass


def test_loop_only_judges_the_daemons_own_loop_and_asks_no_other_service(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The liveness probe's check: a tracker catching up a backlog proves no progress and
    Redis may be down, yet its loop runs and a restart would cure nothing. `--loop-only`
    reads only the daemon's endpoint (no Redis is configured here: the full check exits 3)."""
    from hardelete.cli import main

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for name in [k for k in os.environ if k.startswith("HARDELETE_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("HARDELETE_METRICS_PORT", str(server.server_address[1]))
        gauge = b"hardelete_tracker_cycle_timestamp_seconds"
        _Metrics.body = b"# HELP x\n" + gauge + b" %f\n" % time.time()
        assert main(["health", "tracker"]) == 3
        assert "Redis is not configured" in capsys.readouterr().err
        assert main(["health", "tracker", "--loop-only"]) == 0
        assert capsys.readouterr().out == "tracker: healthy\n"
        _Metrics.body = b"# HELP x\n" + gauge + b" %f\n" % (time.time() - 400)
        assert main(["health", "tracker", "--loop-only", "--stall-seconds", "300"]) == 1
        assert "its loop is stuck" in capsys.readouterr().out
        assert main(["health", "reconciler", "--loop-only"]) == 2
        assert "--loop-only is for the daemons" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()
