"""The operator's commands through the CLI on the real stack (Kafka, Redis, MinIO): holds, dead
letters, quarantine, pause/resume, status and health, the scheduler.

Every hold, record and quarantine copy an operator command acts on here is written by the real
tracker and reaper (a dead-lettered event, a reaped address), never by hand: the commands are
proven on the daemons' own state (issue 19 item 7)."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from hardelete.holds import add_hold, held_by
from hardelete.schedule import decide, last_slot
from schemas.events import RepositoryDeleted, encode
from schemas.layout import (
    FAIL_CLOSED,
    NAMESPACES,
    RECONCILER_SCHEDULE,
    REFUSED,
    AddressState,
    RepoKeys,
)
from schemas.publisher import ensure_topics
from sim.model import Model
from sim.operations import (
    broken,
    claims,
    created,
    kept,
    make_garbage,
    publish_and_track,
    reap_until,
    run,
    setup_repo,
    stored,
    tracked,
    written,
)
from sim.testing import redis_now, wait_horizon
from tracker.daemon import Tracker, running_tracker
from tracker.state import parse_address

# The service certifies its history (schemas/README.md, "Continuity").
pytestmark = pytest.mark.usefixtures("sequenced")

# --- holds ---------------------------------------------------------------------------------------

def test_hold_add_list_remove(cli, capsys, redis_client):
    setup_repo(cli)
    code, out, _ = run(capsys, "hold", "add", "s3://opsb/ns/data/a", "--reason", "legal: case 7")
    assert code == 0 and "held address s3://opsb/ns/data/a in ops" in out
    code, out, _ = run(capsys, "hold", "add", "s3://opsb/ns/legal/", "--reason", "case 8")
    assert code == 0 and "held prefix" in out
    code, out, _ = run(capsys, "hold", "list", "--json")
    rows = orjson.loads(out)
    assert {(h["target"], h["kind"], h["source"], h["reason"]) for h in rows} == {
        ("s3://opsb/ns/data/a", "address", "operator", "legal: case 7"),
        ("s3://opsb/ns/legal/", "prefix", "operator", "case 8")}
    holds = redis_client.hgetall(RepoKeys("ops").holds)
    prefixes = redis_client.hgetall(RepoKeys("ops").hold_prefixes)
    assert held_by("s3://opsb/ns/legal/x/y", holds, prefixes)["reason"] == "case 8"
    assert held_by("s3://opsb/ns/data/b", holds, prefixes) is None
    code, out, _ = run(capsys, "hold", "list")
    assert "legal: case 7" in out and "s3://opsb/ns/legal/" in out
    # mistakes: one line each
    code, _, err = run(capsys, "hold", "add", "s3://elsewhere/x", "--reason", "r")
    assert code == 2 and "inside no tracked repository" in err and err.count("\n") == 1
    code, _, err = run(capsys, "hold", "remove", "s3://opsb/ns/data/zzz")
    assert code == 2 and "no hold on" in err
    code, out, _ = run(capsys, "hold", "remove", "s3://opsb/ns/legal/")
    assert code == 0 and "lifted the hold" in out
    assert redis_client.hlen(RepoKeys("ops").hold_prefixes) == 0

    # The tracker dead-letters an event naming the held address: its claim joins the
    # operator's, and lifting the operator's leaves the address held by the dead letter.
    asyncio.run(publish_and_track(cli, (broken("ops", "s3://opsb/ns/data/a"), b"ops")))
    mine = claims(redis_client, "ops", "s3://opsb/ns/data/a")
    assert "operator" in mine and len(mine) == 2
    (dead,) = mine - {"operator"}
    assert dead.startswith(f"dlq:{cli.events_topic}:")
    code, out, _ = run(capsys, "hold", "remove", "s3://opsb/ns/data/a")
    assert code == 0 and "removed the operator claim" in out and "dlq resolve" in out
    assert claims(redis_client, "ops", "s3://opsb/ns/data/a") == {dead}
    code, _, err = run(capsys, "hold", "remove", "s3://opsb/ns/data/a")
    assert code == 2 and "dlq resolve" in err and err.count("\n") == 1
    code, out, _ = run(capsys, "hold", "remove", "--force", "s3://opsb/ns/data/a")
    assert code == 0 and "lifted the hold" in out and dead in out
    assert not redis_client.hexists(RepoKeys("ops").holds, "s3://opsb/ns/data/a")


# --- dead letters --------------------------------------------------------------------------------

def test_dlq_list_show_replay_resolve(cli, capsys, redis_client, tmp_path: Path):
    setup_repo(cli)
    bad = orjson.loads(broken("ops", "s3://opsb/ns/data/bad", size=-5))
    other = orjson.loads(encode(written("ops", "s3://opsb/ns/data/other")))
    other["v"] = 99
    again = {**bad, "size": -6}  # a retried publish (same event id), dead-lettered again
    lost = orjson.loads(broken("ops", 12345))  # names no address anyone can read
    asyncio.run(publish_and_track(cli, (orjson.dumps(bad), b"ops"),
                                  (orjson.dumps(other), b"ops"), (orjson.dumps(again), b"ops"),
                                  (orjson.dumps(lost), b"ops")))
    code, out, _ = run(capsys, "dlq", "list", "--json")
    letters = orjson.loads(out)
    assert code == 0 and len(letters) == 4
    by_size = {orjson.loads(run(capsys, "dlq", "show", d["id"], "--raw")[1]).get("size"): d
               for d in letters}
    first, second, third = by_size[-5], by_size[-6], by_size[-1]
    assert first["addresses"] == ["s3://opsb/ns/data/bad"]
    assert first["repository"] == "ops" and first["type"] == "object_written"
    assert "size" in first["reason"] and first["origin"]["topic"] == cli.events_topic
    code, out, _ = run(capsys, "dlq", "list")
    assert code == 0 and first["id"] in out and "object_written" in out
    code, out, _ = run(capsys, "dlq", "show", first["id"])
    shown = orjson.loads(out)
    assert shown["event"]["size"] == -5 and shown["key"] == "ops"
    code, out, _ = run(capsys, "dlq", "show", first["id"], "--raw")
    assert orjson.loads(out) == bad

    # The tracker held what each dead letter names, one claim per dead letter: two on data/bad,
    # and the whole namespace (a prefix hold) for the address nobody can read.
    def claim(d: dict[str, Any]) -> str:
        o = d["origin"]  # (the claim names the origin, its log and the record's digest)
        assert d["headers"]["claim"].startswith(f"dlq:{o['topic']}:{o['partition']}:{o['offset']}:")
        return str(d["headers"]["claim"])

    assert claims(redis_client, "ops", "s3://opsb/ns/data/bad") == {claim(first), claim(second)}
    assert len(claims(redis_client, "ops", "s3://opsb/ns/data/other")) == 1
    assert claims(redis_client, "ops", "s3://opsb/ns/", prefix=True) == {claim(third)}
    code, out, _ = run(capsys, "hold", "list", "--source", "dlq", "--json")
    assert {(h["target"], h["kind"]) for h in orjson.loads(out)} == {
        ("s3://opsb/ns/data/bad", "address"), ("s3://opsb/ns/data/other", "address"),
        ("s3://opsb/ns/", "prefix")}
    code, _, err = run(capsys, "hold", "remove", "s3://opsb/ns/data/bad")
    assert code == 2 and "dlq resolve" in err

    # replay: a still-broken fix is refused in one line; the fixed event is applied
    (tmp_path / "still.json").write_bytes(orjson.dumps(bad))
    code, _, err = run(capsys, "dlq", "replay", first["id"], "--file", str(tmp_path / "still.json"))
    assert code == 2 and "still invalid" in err and "size" in err
    bad["size"] = 5
    (tmp_path / "fixed.json").write_bytes(orjson.dumps(bad))
    code, out, _ = run(capsys, "dlq", "replay", first["id"], "--file", str(tmp_path / "fixed.json"))
    assert code == 0 and "published object_written" in out
    asyncio.run(Tracker(cli).run_until_caught_up())
    rec = parse_address(redis_client.hgetall(RepoKeys("ops").address("s3://opsb/ns/data/bad")))
    assert rec.state == AddressState.STAGED

    # Resolving one dead letter leaves the other's claim: the address stays held.
    code, out, _ = tracked(cli, capsys, "dlq", "resolve", first["id"])
    assert code == 0 and "still held by: " + claim(second) in out
    assert claims(redis_client, "ops", "s3://opsb/ns/data/bad") == {claim(second)}
    code, out, _ = tracked(cli, capsys, "dlq", "resolve", second["id"])
    assert code == 0 and "lifted the dlq hold on s3://opsb/ns/data/bad" in out
    holds = redis_client.hgetall(RepoKeys("ops").holds)
    assert "s3://opsb/ns/data/bad" not in holds and "s3://opsb/ns/data/other" in holds
    code, out, _ = tracked(cli, capsys, "dlq", "resolve", first["id"])
    assert code == 0 and "holds nothing" in out
    code, out, _ = tracked(cli, capsys, "dlq", "resolve", third["id"])
    assert code == 0 and "lifted the dlq hold on prefix s3://opsb/ns/" in out
    assert redis_client.hlen(RepoKeys("ops").hold_prefixes) == 0
    code, _, err = run(capsys, "dlq", "show", "0:999")
    assert code == 2 and "no dead letter" in err
    code, _, err = run(capsys, "dlq", "show", "nonsense")
    assert code == 2 and "PARTITION:OFFSET" in err


def test_the_reaper_keeps_an_address_until_every_dead_letter_naming_it_is_resolved(
        cli, capsys, s3, redis_client):
    """The finding "holds the operator cannot lift", end to end: the real tracker holds an
    address for each of two dead letters naming it, the real reaper keeps it; resolving one
    keeps it still, resolving both lets the reaper take it."""
    s = cli.replace(lease_seconds=1.0, upload_ttl_seconds=1.0)
    model = Model.from_settings(s)
    held, free = asyncio.run(make_garbage(s, s3, model, "repo", ["held", "free"],
                                          namespace="s3://dlqb/repo/"))
    asyncio.run(publish_and_track(s, (broken("repo", held, -1), b"repo"),
                                  (broken("repo", held, -2), b"repo")))
    assert len(claims(redis_client, "repo", held)) == 2
    asyncio.run(reap_until(s, lambda rep: not stored(s3, free) and kept(rep, "repo", "held")))
    assert stored(s3, held)

    code, out, _ = run(capsys, "dlq", "list", "--json")
    first, second = orjson.loads(out)
    code, out, _ = tracked(cli, capsys, "dlq", "resolve", first["id"])
    assert code == 0 and "still held by" in out
    asyncio.run(reap_until(s, lambda rep: kept(rep, "repo", "held") > 0))
    assert stored(s3, held)

    code, out, _ = tracked(cli, capsys, "dlq", "resolve", second["id"])
    assert code == 0 and f"lifted the dlq hold on {held}" in out
    asyncio.run(reap_until(s, lambda rep: not stored(s3, held)))


def test_dlq_replay_from_stdin(cli, capsys, redis_client, monkeypatch):
    import io
    import sys

    setup_repo(cli)
    ev = written("ops", "s3://opsb/ns/data/stdin")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(encode(ev))))
    code, out, _ = run(capsys, "dlq", "replay", "--file", "-")
    assert code == 0 and ev.event_id in out
    asyncio.run(Tracker(cli).run_until_caught_up())
    assert redis_client.exists(RepoKeys("ops").address("s3://opsb/ns/data/stdin"))


def test_dlq_replay_judges_a_refused_repository_again(cli, capsys, redis_client, tmp_path):
    """A refused repository_created stays refused on redelivery (hd:refused); an operator's
    replay of it, once the conflict is gone, is judged again and admitted."""
    setup_repo(cli)  # ops owns s3://opsb/ns/
    early = created("ops2", "s3://opsb/ns/sub/")
    asyncio.run(publish_and_track(cli, (encode(early), early.key)))
    assert redis_client.hget(REFUSED, early.event_id)
    asyncio.run(publish_and_track(cli, (encode(early), early.key)))  # a redelivery
    assert redis_client.hget(NAMESPACES, "s3://opsb/ns/sub/") is None
    gone = RepositoryDeleted(repository="ops", storage_namespace="s3://opsb/ns/")
    asyncio.run(publish_and_track(cli, (encode(gone), gone.key)))
    # retired, its data kept: the namespace stays its own until an operator releases it
    assert redis_client.hget(NAMESPACES, "s3://opsb/ns/") == "ops"
    code, out, err = run(capsys, "retired", "purge", "ops", "--release")
    assert code == 0 and "done" in out, err
    assert redis_client.hget(NAMESPACES, "s3://opsb/ns/") is None
    (tmp_path / "created.json").write_bytes(encode(early))
    code, out, _ = run(capsys, "dlq", "replay", "--file", str(tmp_path / "created.json"))
    assert code == 0 and early.event_id in out
    assert not redis_client.hexists(REFUSED, early.event_id)
    asyncio.run(Tracker(cli).run_until_caught_up())
    assert redis_client.hget(NAMESPACES, "s3://opsb/ns/sub/") == "ops2"


# --- pause, status, health -----------------------------------------------------------------------

def test_pause_resume_and_status(cli, capsys, redis_client, s3):
    setup_repo(cli)
    code, out, _ = run(capsys, "pause", "ops", "--reason", "incident 42")
    assert code == 0 and "paused ops" in out
    assert orjson.loads(redis_client.get(RepoKeys("ops").paused))["reason"] == "incident 42"
    add_hold(redis_client, "s3://opsb/ns/x", "legal", s3=s3)
    redis_client.hset(RepoKeys("ops").fail_closed, mapping={"reason": "log reset"})
    redis_client.hset(FAIL_CLOSED, mapping={"reason": "redis lost everything"})
    code, out, _ = run(capsys, "status", "--json")
    doc = orjson.loads(out)
    ops = doc["operations"]
    assert code == 1 and doc["verdict"] == "NEEDS A PERSON: 2 fail-closed"
    assert ops["tracker_alive"] and ops["tracker_progress_age_s"] < 60
    assert ops["dead_letters"] == 0 and ops["holds"] == {"ops": 1}
    assert ops["paused"]["ops"]["reason"] == "incident 42"
    assert ops["fail_closed"] == {"ops": {"reason": "log reset"},
                                  "*": {"reason": "redis lost everything"}}
    code, out, _ = run(capsys, "status")
    assert "tracker: alive" in out and "paused: ops (incident 42)" in out
    assert "fail-closed: every repository" in out and "dead letters: 0" in out
    code, out, _ = run(capsys, "resume", "ops")
    assert code == 0 and "incident 42" in out and redis_client.get(RepoKeys("ops").paused) is None
    code, _, err = run(capsys, "resume", "ops")
    assert code == 2 and "not paused" in err
    code, _, err = run(capsys, "pause", "nope", "--reason", "x")
    assert code == 2 and "unknown repository" in err


def test_one_operators_resume_leaves_anothers_pause(cli, capsys, redis_client):
    """A pause is a claim per operator, as a hold is (found by an adversarial review: B's pause
    overwrote A's, and A's resume lifted B's): the repository stays paused, which the gate,
    the claim script and status all read, until each resumes, or --force."""
    from core.gate import read_gate

    setup_repo(cli)
    assert run(capsys, "pause", "ops", "--reason", "incident 7", "--by", "alice")[0] == 0
    assert run(capsys, "pause", "ops", "--reason", "legal review", "--by", "bob")[0] == 0
    code, out, _ = run(capsys, "resume", "ops", "--by", "alice")
    assert code == 0 and "still paused by bob (legal review)" in out
    assert read_gate(redis_client, "ops").paused == "legal review"
    code, out, _ = run(capsys, "resume", "ops", "--by", "bob")
    assert code == 0 and "resumed ops" in out and redis_client.get(RepoKeys("ops").paused) is None
    # --force lifts every claim; a pause written before claims is lifted by any resume
    run(capsys, "pause", "ops", "--reason", "a", "--by", "alice")
    run(capsys, "pause", "ops", "--reason", "b", "--by", "bob")
    code, out, _ = run(capsys, "resume", "ops", "--force")
    assert code == 0 and "resumed ops" in out and redis_client.get(RepoKeys("ops").paused) is None
    redis_client.set(RepoKeys("ops").paused, orjson.dumps({"reason": "old", "at_ms": 1}))
    code, out, _ = run(capsys, "resume", "ops", "--by", "carol")
    assert code == 0 and "resumed ops" in out and redis_client.get(RepoKeys("ops").paused) is None


def test_status_leads_with_a_verdict_and_exits_1_while_a_person_is_needed(cli, capsys,
                                                                          monkeypatch):
    """Issue 36 finding 6, on the real tracker: `status` leads with one line, OK or what needs
    a person, fits 80 columns, and exits 1 while something does: a repository frozen by one
    unreadable event (a dead letter holds its whole namespace; it looked normal, "holds:
    ops=1", exit 0), a stale tracker, an incident nobody acknowledged, dead letters it cannot
    count. A resolved dead letter and an acknowledged incident need nobody."""
    monkeypatch.setenv("COLUMNS", "80")
    setup_repo(cli)

    def status() -> tuple[int, list[str]]:
        code, out, _ = run(capsys, "status")
        lines = out.splitlines()
        assert lines and all(len(line) <= 80 for line in lines), out
        return code, lines

    code, lines = status()
    assert code == 0 and lines[0] == "OK: nothing needs a person", lines
    # an event naming no address anyone can read: dead-lettered, its namespace held, and said
    asyncio.run(publish_and_track(cli, (broken("ops", 12345), b"ops")))
    code, lines = status()
    assert code == 1 and lines[0] == "NEEDS A PERSON: 1 frozen, 1 incident, 1 dead letter", lines
    assert any(line.startswith("- frozen: ops: a dead letter holds its whole") for line in lines)
    (row,) = [line for line in lines if line.split()[:1] == ["ops"]]
    assert "frozen" in row
    doc = orjson.loads(run(capsys, "status", "--json")[1])
    assert doc["operations"]["dead_letters"] == 1 and doc["operations"]["frozen"]["ops"]
    assert [a["kind"] for a in doc["attention"]] == ["frozen", "incident", "dead letter"]
    monkeypatch.setenv("HARDELETE_TRACKER_STALE_SECONDS", "0.001")
    code, lines = status()
    assert code == 1 and lines[0].startswith("NEEDS A PERSON: tracker stale, 1 frozen")
    assert any(line.startswith("- tracker: STALE") for line in lines)
    monkeypatch.setenv("HARDELETE_TRACKER_STALE_SECONDS", "600")
    (letter,) = orjson.loads(run(capsys, "dlq", "list", "--json")[1])
    assert tracked(cli, capsys, "dlq", "resolve", letter["id"])[0] == 0
    code, lines = status()
    assert code == 1 and lines[0] == "NEEDS A PERSON: 1 incident", lines
    code, out, _ = run(capsys, "incidents", "list")
    assert code == 0 and out.startswith("* #0 address_spelling: ")
    code, out, _ = run(capsys, "incidents", "ack", "--by", "alice", "--reason", "resolved 0:0")
    assert code == 0 and out == "acknowledged 1 incident(s) of *\n"
    code, lines = status()
    assert code == 0 and lines[0] == "OK: nothing needs a person", lines
    assert run(capsys, "incidents", "list")[1] == "no incident since the last acknowledgement\n"

    # Kafka gone: status still answers, and says what it does not know
    monkeypatch.setenv("HARDELETE_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    code, lines = status()
    assert code == 1 and "dead letters unknown" in lines[0]
    assert any(line.startswith("- dead letters: unknown (Kafka at 127.0.0.1:1 is unreachable")
               for line in lines)


def _until_health(capsys: Any, component: str, code: int, *args: str) -> str:
    """Ask `health COMPONENT` until it exits ``code``; its output. A blocking poll: called
    from the thread of the daemon's event loop, it keeps that loop from running."""
    deadline = time.monotonic() + 30
    while True:
        got, out, _ = run(capsys, "health", component, *args)
        if got == code:
            return out
        assert time.monotonic() < deadline, out
        time.sleep(0.2)


def test_health_tracker_reads_its_loop(cli, capsys, monkeypatch):
    """`health tracker`: its endpoint answers, its own loop completes cycles and the proven
    progress is fresh. A tracker whose loop stopped (here its event loop is blocked, as by a
    call that hangs) is unhealthy, though its endpoint, a thread of its own, still answers
    (issue 36 finding 6). Without the metrics port it cannot tell, and says so."""
    from sim.stack import free_port

    port = free_port()
    s = cli.replace(metrics_port=port)
    code, _, err = run(capsys, "health", "tracker")
    assert code == 2 and err.count("\n") == 1 and "set metrics_port" in err
    monkeypatch.setenv("HARDELETE_METRICS_PORT", str(port))
    code, out, _ = run(capsys, "health", "tracker")
    assert code == 1 and f"port {port} does not answer" in out

    async def scenario() -> None:
        await ensure_topics(s)
        async with running_tracker(s):
            await asyncio.to_thread(_until_health, capsys, "tracker", 0)
            monkeypatch.setenv("HARDELETE_TRACKER_STALE_SECONDS", "0.001")
            code, out, _ = await asyncio.to_thread(run, capsys, "health", "tracker",
                                                   "--stall-seconds", "60")
            assert code == 1 and "last progress" in out
            monkeypatch.delenv("HARDELETE_TRACKER_STALE_SECONDS")
            out = _until_health(capsys, "tracker", 1, "--stall-seconds", "1")
            assert "its loop is stuck: no step completed" in out
    asyncio.run(scenario())


# --- scheduler -----------------------------------------------------------------------------------

def test_schedule_decisions() -> None:
    at = dt.time(2, 0)
    utc = dt.UTC
    now = dt.datetime(2026, 1, 10, 1, 0, tzinfo=utc)
    assert last_slot(now, at) == dt.datetime(2026, 1, 9, 2, 0, tzinfo=utc)
    retry = dt.timedelta(minutes=30)
    assert decide(now, at, None, None, retry).run_now  # never ran
    done = dt.datetime(2026, 1, 9, 2, 5, tzinfo=utc)
    d = decide(now, at, done, None, retry)
    assert not d.run_now and d.wait_s == 3600
    # down at 02:00 on the 10th, back at 09:00: one catch-up run, now
    later = dt.datetime(2026, 1, 10, 9, 0, tzinfo=utc)
    assert decide(later, at, done, None, retry).run_now
    # down for three days: still one run
    assert decide(later + dt.timedelta(days=3), at, done, None, retry).run_now
    # a failure after the slot is retried after the retry delay, not before
    failed = dt.datetime(2026, 1, 10, 8, 50, tzinfo=utc)
    d = decide(later, at, done, failed, retry)
    assert not d.run_now and d.wait_s == 20 * 60
    assert decide(later + dt.timedelta(minutes=21), at, done, failed, retry).run_now


def test_schedule_records_failures_and_health_shows_them(cli, capsys, redis_client):
    """The scheduler's failures fail `health reconciler`; a command it ran that is no
    reconcile (here `config`) does not pass for one: only the reports runs write do."""
    setup_repo(cli)
    code, out, _ = run(capsys, "health", "reconciler")
    assert code == 1 and "no reconcile run has reported" in out
    code, _, _ = run(capsys, "schedule", "--once", "--", "explain", "not-an-address")
    assert code == 2
    h = redis_client.hgetall(RECONCILER_SCHEDULE)
    assert h["last_exit"] == "2" and "s3:// URI" in h["last_error"]
    code, out, _ = run(capsys, "health", "reconciler")
    assert code == 1 and "last scheduled run failed (exit 2)" in out
    # not retried before --retry-minutes
    assert run(capsys, "schedule", "--once", "--", "config")[0] == 0
    assert redis_client.hget(RECONCILER_SCHEDULE, "last_exit") == "2"
    code, _, _ = run(capsys, "schedule", "--once", "--retry-minutes", "0", "--", "config")
    assert code == 0 and redis_client.hget(RECONCILER_SCHEDULE, "last_exit") == "0"
    code, out, _ = run(capsys, "health", "reconciler")
    assert code == 1 and "no reconcile run has reported" in out
    # done for today's slot: not run again
    before = redis_client.hget(RECONCILER_SCHEDULE, "last_attempt_ms")
    assert run(capsys, "schedule", "--once", "--", "explain", "x")[0] == 0
    assert redis_client.hget(RECONCILER_SCHEDULE, "last_attempt_ms") == before


# --- quarantine, explain, restore ----------------------------------------------------------------

def test_quarantine_list_explain_restore_purge(cli, capsys, s3, redis_client):
    """Copies the real reaper quarantined, holds the real tracker placed (dead letters) and the
    restore's own claim: purge keeps a held copy, restore's claim and a dead letter's are
    lifted each by its own command."""
    keep = cli.replace(quarantine_days=1.0, upload_ttl_seconds=1.0, lease_seconds=2.0)
    model = Model.from_settings(keep)
    (g0,) = asyncio.run(make_garbage(keep, s3, model, "repo", ["g0"],
                                     namespace="s3://quar/repo/"))
    asyncio.run(reap_until(keep, lambda rep: not stored(s3, g0)))
    code, out, _ = run(capsys, "quarantine", "list", "--json")
    items = orjson.loads(out)
    assert code == 0 and [q["address"] for q in items] == [g0] and not items[0]["expired"]
    code, out, _ = run(capsys, "quarantine", "list")
    assert f"hardelete restore repo {g0}" in out
    code, out, _ = run(capsys, "explain", g0)
    assert code == 0 and f"restore with `hardelete restore repo {g0}`" in out

    # any spelling of the address: the restore hold is on the canonical object (issue 33)
    code, out, _ = run(capsys, "restore", "repo", "S3A://QUAR/" + g0.removeprefix("s3://quar/"))
    assert code == 0 and "held (source restore)" in out
    assert claims(redis_client, "repo", g0) == {"restore"}
    assert s3.head_object(Bucket="quar", Key=g0.removeprefix("s3://quar/"))
    code, out, _ = run(capsys, "hold", "list", "--source", "restore", "--json")
    assert [h["target"] for h in orjson.loads(out)] == [g0]

    # Two more, quarantined for 4 s: their keep period is over before the purge below.
    brief = keep.replace(quarantine_days=4 / 86400)
    g1, g2 = asyncio.run(make_garbage(brief, s3, model, "repo", ["g1", "g2"]))
    asyncio.run(reap_until(brief, lambda rep: not stored(s3, g1) and not stored(s3, g2)))
    # Dead letters naming g0 (restored) and g1 (in quarantine): the tracker claims both.
    asyncio.run(publish_and_track(cli, (broken("repo", g0), b"repo"),
                                  (broken("repo", g1), b"repo")))
    assert len(claims(redis_client, "repo", g0)) == 2 and len(claims(redis_client, "repo", g1)) == 1

    # each party lifts its own claim: `hold remove` (the operator's) finds none on g0 and says
    # which command lifts restore's; `hold remove --restore` lifts restore's only, and the
    # dead letter still holds g0
    code, _, err = run(capsys, "hold", "remove", g0)
    assert code == 2 and err.count("\n") == 1 and "no operator claim" in err
    assert f"hardelete hold remove --restore {g0}" in err
    assert len(claims(redis_client, "repo", g0)) == 2
    code, out, _ = run(capsys, "hold", "remove", "--restore", g0)
    assert code == 0 and "removed the restore claim" in out and "still held by dead letter" in out
    assert "restore" not in claims(redis_client, "repo", g0)

    deadline = time.monotonic() + 30
    while not all(q["expired"] for q in orjson.loads(run(capsys, "quarantine", "list",
                                                         "--json")[1]) if q["address"] != g0):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    code, out, _ = run(capsys, "quarantine", "purge", "--dry-run")
    assert code == 0 and out.count("would purge s3://") == 2
    # a held address keeps its last copy, expired or not (every delete path checks holds)
    def purge() -> tuple[int, str, str]:
        async def past_grace() -> tuple[int, str, str]:
            # the purge judges the address too (the gate): its grace since the reap must be
            # over by the tracker's proven progress
            async with running_tracker(cli):
                await wait_horizon(cli, await redis_now(cli) + int(cli.grace_seconds * 1000)
                                   + 200)
                return await asyncio.to_thread(run, capsys, "quarantine", "purge", "--repo",
                                               "repo")
        return asyncio.run(past_grace())

    # the repository's own grace, not the global one: an hour since the reap keeps g2's copy
    os.environ["HARDELETE_REPOSITORY_GRACE"] = "repo=3600"
    try:
        code, out, _ = purge()
    finally:
        del os.environ["HARDELETE_REPOSITORY_GRACE"]
    assert code == 0 and "purged 0 expired" in out, out
    code, out, _ = purge()
    assert code == 0 and "purged 1 expired" in out
    assert [q["address"] for q in orjson.loads(run(capsys, "quarantine", "list", "--json")[1])
            ] == [g1]
    letters = orjson.loads(run(capsys, "dlq", "list", "--json")[1])
    for d in letters:
        code, out, _ = tracked(cli, capsys, "dlq", "resolve", d["id"])
        assert code == 0 and "lifted the dlq hold" in out
    assert redis_client.hlen(RepoKeys("repo").holds) == 0
    code, out, _ = purge()
    assert code == 0 and "purged 1 expired" in out
    assert orjson.loads(run(capsys, "quarantine", "list", "--json")[1]) == []


def test_pause_keeps_what_the_tracker_marked_until_resume(cli, capsys, s3, redis_client):
    """pause and resume on the real tracker's record and the real reaper: a paused repository's
    garbage stays past its grace, and goes once resumed."""
    cli = cli.replace(upload_ttl_seconds=1.0)
    model = Model.from_settings(cli)
    (garbage,) = asyncio.run(make_garbage(cli, s3, model, "repo", ["g"],
                                          namespace="s3://pauseb/repo/"))
    asyncio.run(publish_and_track(cli))  # (no reaper runs yet)
    code, out, _ = run(capsys, "pause", "repo", "--reason", "incident 43")
    assert code == 0 and "paused repo" in out
    since = parse_address(redis_client.hgetall(RepoKeys("repo").address(garbage))).since
    assert since is not None
    grace_ms = int(cli.grace_seconds * 1000)
    asyncio.run(reap_until(cli, lambda rep: rep.horizon_ms is not None
                           and rep.horizon_ms - grace_ms > since + 500
                           and kept(rep, "repo", "paused") > 0))
    assert stored(s3, garbage)
    code, out, _ = run(capsys, "resume", "repo")
    assert code == 0 and "incident 43" in out
    asyncio.run(reap_until(cli, lambda rep: not stored(s3, garbage)))


def test_health_reaper_and_a_store_error_mid_command(cli, capsys, monkeypatch, s3):
    """`health reaper` without a metrics port says it cannot tell (it passed, silently); with
    one, a reaper whose loop stopped is unhealthy though its endpoint answers (issue 36)."""
    from prometheus_client import start_http_server

    from reaper.daemon import Reaper
    from sim.stack import free_port

    code, out, err = run(capsys, "health", "reaper")
    assert code == 2 and out == "" and err.count("\n") == 1 and "set metrics_port" in err
    port = free_port()
    monkeypatch.setenv("HARDELETE_METRICS_PORT", str(port))
    code, out, _ = run(capsys, "health", "reaper")
    assert code == 1 and "reaper unhealthy: metrics endpoint" in out

    async def scenario() -> None:
        reaper, stop = Reaper(cli), asyncio.Event()
        loop = asyncio.create_task(reaper.run(stop))
        server = start_http_server(port)  # the default registry, as `reaper run` serves it
        try:
            await asyncio.to_thread(_until_health, capsys, "reaper", 0)
            out = _until_health(capsys, "reaper", 1, "--stall-seconds", "1")
            assert "its loop is stuck: no step completed" in out
        finally:
            stop.set()
            await loop
            await reaper.close()
            server[0].shutdown()
    asyncio.run(scenario())
    monkeypatch.delenv("HARDELETE_METRICS_PORT")
    # S3 answers but the namespace's bucket is gone: one line from the store, no traceback
    setup_repo(cli, "nobucket", "s3://missing-bucket/ns/", bucket=False)
    code, out, err = run(capsys, "quarantine", "purge", "--repo", "nobucket")
    assert code == 3 and err.count("\n") == 1
    assert f"S3 at {cli.s3_endpoint_url} refused ListObjectsV2: NoSuchBucket" in err
    code, out, _ = run(capsys, "reports", "list", "--repo", "nobucket", "--json")
    assert code == 0 and orjson.loads(out) == []


@pytest.mark.unsequenced  # (a relay would have created the topics before the test)
def test_topics_are_created_with_the_configured_replication(settings):
    from aiokafka.admin import AIOKafkaAdminClient

    from schemas.publisher import TopicRefused

    # One broker cannot hold 3 replicas: Kafka refuses, and it is said (aiokafka returns the
    # refusal without raising; the topics were left to auto-creation with the broker's
    # defaults).
    with pytest.raises(TopicRefused, match=r"replication factor 3\): InvalidReplicationFactor"):
        asyncio.run(ensure_topics(settings.replace(topic_replication_factor=3)))
    s = settings.replace(topic_replication_factor=1, topic_partitions=2)

    async def described() -> list[Any]:
        await ensure_topics(s)
        admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
        await admin.start()
        try:
            return list(await admin.describe_topics([s.events_topic, s.dlq_topic]))
        finally:
            await admin.close()

    topics = asyncio.run(described())
    assert len(topics) == 2
    for topic in topics:
        assert [len(p["replicas"]) for p in topic["partitions"]] == [1, 1]
