"""Log identity and continuity, pure parts (tracker/logid.py), the dead-letter message, holds
from dead letters, the verified horizon, and the fail-closed readers and CLI (on the session
Redis)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import orjson

from core.gate import read_gate
from core.guards import fail_closed_reason, fail_closed_repos
from core.settings import Settings
from hardelete.failclosed import clear
from hardelete.status import collect_status
from schemas.layout import FAIL_CLOSED, INCIDENTS, REPOS, RepoKeys


def test_fail_closed_readers_clear_and_status(redis_client: Any) -> None:
    r = redis_client
    r.sadd(REPOS, "a", "b")
    assert fail_closed_reason(r, "a") is None
    r.hset(RepoKeys("a").fail_closed, mapping={"reason": "log reset", "at_ms": "1"})
    assert fail_closed_reason(r, "a") == "repository: log reset"
    assert fail_closed_reason(r, "b") is None
    r.hset(FAIL_CLOSED, mapping={"reason": "redis lost everything", "at_ms": "2"})
    assert fail_closed_reason(r, "b") == "all repositories: redis lost everything"
    # One precedence for every reader and the gate: the global flag covers the repository's.
    assert fail_closed_reason(r, "a") == "all repositories: redis lost everything"
    gate = read_gate(r, "a", [])
    assert gate.repo_problem("a", "s3://b/a/") == (
        "fail_closed", "all repositories: redis lost everything")
    assert set(fail_closed_repos(r)) == {"*", "a"}
    st = collect_status(r)
    assert st.fail_closed_all == "redis lost everything"
    assert {x.repository: x.fail_closed for x in st.repositories} == {"a": "log reset",
                                                                     "b": None}
    assert clear(r, "b", reason="x", who="t") == 0
    assert clear(r, "a", reason="rebuilt", who="op@host") == 1
    inc = orjson.loads(r.lrange(RepoKeys("a").incidents, 0, -1)[-1])
    assert inc["type"] == "fail_closed_cleared" and inc["by"] == "op@host"
    assert inc["reason"] == "rebuilt" and inc["was"]["reason"] == "log reset"
    assert clear(r, None, reason="all rebuilt", who="t") == 1
    assert fail_closed_reason(r, "b") is None and r.llen(INCIDENTS) == 1
    # A flag with no reason is still a flag: status says so, as the gate does (status used to
    # read the reason field alone and showed such a repository as healthy).
    r.hset(RepoKeys("b").fail_closed, mapping={"at_ms": "3"})
    assert fail_closed_reason(r, "b") == "repository: fail-closed"
    assert {x.repository: x.fail_closed for x in collect_status(r).repositories}["b"] \
        == "fail-closed"


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HARDELETE_REDIS_URL": settings.redis_url}
    return subprocess.run([sys.executable, "-m", "hardelete.cli", "fail-closed", *args],
                          capture_output=True, text=True, env=env, timeout=120)
def test_fail_closed_cli(settings: Settings, redis_client: Any) -> None:
    redis_client.sadd(REPOS, "a")
    redis_client.hset(RepoKeys("a").fail_closed, mapping={"reason": "log reset", "at_ms": "1"})
    out = _cli(settings, "list")
    assert out.returncode == 0 and "a" in out.stdout and "log reset" in out.stdout
    bad = _cli(settings, "clear")
    assert bad.returncode == 2 and "REPOSITORY or --all" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert _cli(settings, "clear", "nope").returncode == 1  # nothing to clear
    ok = _cli(settings, "clear", "a", "--reason", "rebuilt by reconciler run 7")
    assert ok.returncode == 0, ok.stderr
    assert fail_closed_reason(redis_client, "a") is None
    assert "no repository is fail-closed" in _cli(settings, "list").stdout
















