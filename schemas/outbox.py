"""A reference transactional outbox on SQLite (schemas/README.md, "Continuity").

A service that certifies its own history gives every event a gapless ``seq`` per ordering
domain (a repository, or one of its stripes), allocated **in the transaction of the change**,
and keeps the event in an outbox row of the same transaction. Its relay
(``schemas/relay.py``) publishes the rows, answers the tracker's ticks from the committed
counters and re-sends ranges on request. This module is that outbox for a service whose store
is a SQLite database (stdlib ``sqlite3``): the service's own tables live in the same file and
its changes go through the same transaction::

    outbox = Outbox("service.db")
    with outbox.transaction() as tx:
        tx.execute("UPDATE entries SET ... WHERE ...", (...))
        tx.emit(ObjectWritten(...), stripe=0)   # -> the event with seq and incarnation

Either everything of the transaction commits (the change, the counter, the row) or nothing: a
rolled-back transaction allocates no seq, so seqs stay gapless. Counters are per
``(repository, stripe)``; a repository's stripes are declared by its ``repository_created``
(``stripes``, default 1) or by :meth:`Transaction.declare`.

The **incarnation** is minted when the outbox is created and kept in the database. Restoring
the store from a copy brings back an older counter, so later changes would reuse seqs the
tracker may have applied already: **call** :meth:`Outbox.restored` **after restoring the store
from a copy, before it takes any write and before its relay runs.** It mints a new incarnation;
the tracker then stops the repository's domains until they are rebuilt from the service's
export, instead of taking a reused seq for a duplicate.

Rows are kept until acknowledged by the broker *and* no longer needed for a re-send:
:meth:`Outbox.trim` drops the published rows of a domain up to a seq (call it once the tracker's
horizon covers them), and :meth:`Outbox.expire` drops published rows older than the retention
(the relay calls it). A row never published is never dropped. A re-send of a dropped range is
answered with ``range_gone``: that domain is rebuilt, nothing is lost silently.

**Breaks**: the tracker reports each stripe it reads as broken (control ``broken``); the
relay keeps it with :meth:`Outbox.record_break` (per repository, stripe and incarnation), and
:meth:`Outbox.counters` returns it with the counters, so every watermark of that stripe
carries it and a tracker's Redis that went back to before the break breaks it again.

Durability: ``synchronous=FULL`` (the default) makes a commit durable when it returns. With
less, a power failure could take back a commit whose row the relay already published: the
store would go back without a new incarnation, and the next change would reuse a seq the
tracker applied (A2 of the contract). Pass ``synchronous="OFF"`` only where nothing survives
a crash anyway (tests).

Connections: one per thread (SQLite serialises writers with its lock; ``BEGIN IMMEDIATE``
takes it at the start of a transaction, so the counter read and its increment cannot
interleave with another writer's).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from schemas.events import MAX_STRIPES, RepositoryCreated, ServiceEvent, encode

E = TypeVar("E", bound=ServiceEvent)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS hd_outbox_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS hd_outbox_domains (
    repository TEXT PRIMARY KEY, stripes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS hd_outbox_counters (
    repository TEXT NOT NULL, stripe INTEGER NOT NULL, seq INTEGER NOT NULL,
    PRIMARY KEY (repository, stripe));
CREATE TABLE IF NOT EXISTS hd_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    repository TEXT NOT NULL, stripe INTEGER NOT NULL, seq INTEGER NOT NULL,
    incarnation TEXT NOT NULL, value BLOB NOT NULL, created_at REAL NOT NULL,
    published INTEGER NOT NULL DEFAULT 0,
    UNIQUE (repository, stripe, incarnation, seq));
CREATE INDEX IF NOT EXISTS hd_outbox_unpublished ON hd_outbox (id) WHERE published = 0;
CREATE TABLE IF NOT EXISTS hd_outbox_breaks (
    repository TEXT NOT NULL, stripe INTEGER NOT NULL, incarnation TEXT NOT NULL,
    reason TEXT NOT NULL, recorded_at REAL NOT NULL, epoch INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (repository, stripe, incarnation));
"""


class OutboxError(RuntimeError):
    """The outbox was used against its rules (a stripe not declared, an event emitted twice)."""


@dataclass(frozen=True, slots=True)
class Row:
    id: int
    repository: str
    stripe: int
    seq: int
    incarnation: str
    value: bytes


@dataclass(frozen=True, slots=True)
class Counters:
    """A repository's committed counters, read in one transaction."""

    incarnation: str
    stripes: int
    seqs: tuple[int, ...]  # per stripe: the last seq allocated (0: none)
    # per stripe: the break the tracker reported for this incarnation (record_break), or None
    broken: tuple[str | None, ...] = ()
    broken_epochs: tuple[int, ...] = ()  # per stripe: the tracker's epoch of that break


class Transaction:
    """One transaction of the service's store: its own SQL and its events, atomically."""

    def __init__(self, outbox: Outbox, conn: sqlite3.Connection, incarnation: str) -> None:
        self._outbox = outbox
        self._conn = conn
        self.incarnation = incarnation
        self.emitted: list[ServiceEvent] = []
        self.stripes: dict[str, int] = {}  # read or declared here (known for good once committed)

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> sqlite3.Cursor:
        return self._conn.execute(sql, params)

    def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
        return self._conn.executemany(sql, rows)

    def declare(self, repository: str, stripes: int) -> None:
        """The repository's ordering domains are stripes ``0..stripes-1``; fixed once set."""
        if isinstance(stripes, bool) or not 1 <= stripes <= MAX_STRIPES:
            raise OutboxError(f"stripes must be 1..{MAX_STRIPES}, got {stripes!r}")
        self._conn.execute("INSERT OR IGNORE INTO hd_outbox_domains VALUES (?, ?)",
                           (repository, stripes))
        have = self._stripes(repository)
        if have != stripes:
            raise OutboxError(f"repository {repository!r} has {have} stripes; they cannot "
                              f"change to {stripes}")

    def emit(self, event: E, stripe: int = 0) -> E:
        """Allocate the event's seq in its domain ``(repository, stripe)`` and keep it in the
        outbox, both in this transaction. Returns the event as published (seq, incarnation,
        stripe set)."""
        if not isinstance(event, ServiceEvent):
            raise OutboxError(f"{type(event).__name__} is not a service event")
        if event.seq is not None or event.incarnation is not None:
            raise OutboxError(f"event {event.event_id} has a seq already (emitted twice?)")
        repo = event.repository
        if isinstance(event, RepositoryCreated):
            self.declare(repo, event.stripes)
        stripes = self._outbox._known_stripes.get(repo) or self.stripes.get(repo)
        if stripes is None:
            self._conn.execute("INSERT OR IGNORE INTO hd_outbox_domains VALUES (?, 1)",
                               (repo,))
            stripes = self._stripes(repo)
        if isinstance(stripe, bool) or not 0 <= stripe < stripes:
            raise OutboxError(f"repository {repo!r} has stripes 0..{stripes - 1}, not {stripe!r}")
        (seq,) = self._conn.execute(
            "INSERT INTO hd_outbox_counters VALUES (?, ?, 1) ON CONFLICT (repository, stripe) "
            "DO UPDATE SET seq = seq + 1 RETURNING seq", (repo, stripe)).fetchone()
        stamped = replace(event, seq=seq, incarnation=self.incarnation, stripe=stripe)
        self._conn.execute(
            "INSERT INTO hd_outbox (repository, stripe, seq, incarnation, value, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (repo, stripe, seq, self.incarnation, encode(stamped), self._outbox.clock()))
        self.emitted.append(stamped)
        return stamped

    def _stripes(self, repository: str) -> int:
        row = self._conn.execute("SELECT stripes FROM hd_outbox_domains WHERE repository = ?",
                                 (repository,)).fetchone()
        stripes = self.stripes[repository] = int(row[0]) if row else 1
        return stripes


class Outbox:
    """The transactional outbox in the SQLite database at ``path`` (created if absent)."""

    def __init__(self, path: str | Path, *, retention_seconds: float = 7 * 86_400.0,
                 clock: Callable[[], float] = time.time, busy_timeout_seconds: float = 60.0,
                 synchronous: str = "FULL") -> None:
        if str(path) in ("", ":memory:"):
            raise OutboxError("the outbox needs a database file (its rows must outlive the "
                              "process)")
        self.path = str(path)
        self.retention_seconds = retention_seconds
        self.clock = clock
        self._busy_ms = int(busy_timeout_seconds * 1000)
        self._synchronous = synchronous
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        self._known_stripes: dict[str, int] = {}
        conn = self._conn()
        conn.execute("PRAGMA journal_mode=WAL")
        with self._write(conn):  # (not executescript: it commits by itself)
            for statement in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
                conn.execute(statement)
            conn.execute("INSERT OR IGNORE INTO hd_outbox_meta VALUES ('incarnation', ?)",
                         (_new_incarnation(),))

    # -- the service's side --

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """A write transaction: everything in it commits together, or nothing does."""
        conn = self._conn()
        if conn.in_transaction:
            raise OutboxError("a transaction is open on this thread already")
        with self._write(conn):
            tx = Transaction(self, conn, self._incarnation(conn))
            yield tx
        self._known_stripes.update(tx.stripes)  # (committed: a repository's stripes are fixed)
        if tx.emitted:
            for listener in list(self._listeners):
                listener()

    @property
    def incarnation(self) -> str:
        return self._incarnation(self._conn())

    def restored(self) -> str:
        """Call after restoring the store from a copy (before it takes a write): a new
        incarnation, so that no seq the copy reuses can pass for the one the tracker knows."""
        conn = self._conn()
        new = _new_incarnation()
        with self._write(conn):
            conn.execute("UPDATE hd_outbox_meta SET value = ? WHERE key = 'incarnation'", (new,))
        return new

    def trim(self, repository: str, stripe: int, upto: int) -> int:
        """Drop the published rows of the domain with seq <= ``upto``; returns how many."""
        conn = self._conn()
        with self._write(conn):
            cur = conn.execute("DELETE FROM hd_outbox WHERE repository = ? AND stripe = ? AND "
                               "seq <= ? AND published = 1", (repository, stripe, upto))
        return cur.rowcount

    def expire(self, now: float | None = None) -> int:
        """Drop the published rows older than the retention; returns how many."""
        cutoff = (self.clock() if now is None else now) - self.retention_seconds
        conn = self._conn()
        with self._write(conn):
            cur = conn.execute("DELETE FROM hd_outbox WHERE published = 1 AND created_at < ?",
                               (cutoff,))
        return cur.rowcount

    # -- the relay's side --

    def add_listener(self, listener: Callable[[], None]) -> None:
        """``listener()`` runs after each commit that emitted events (on the committing
        thread): a relay in the same process wakes up instead of waiting for its poll."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def counters(self, repository: str) -> Counters | None:
        """The repository's committed counters and the incarnation, read now in one read
        transaction; None when the outbox has never held the repository."""
        conn = self._conn()
        with self._read(conn):
            inc = self._incarnation(conn)
            row = conn.execute("SELECT stripes FROM hd_outbox_domains WHERE repository = ?",
                               (repository,)).fetchone()
            found = dict(conn.execute("SELECT stripe, seq FROM hd_outbox_counters WHERE "
                                      "repository = ?", (repository,)).fetchall())
            breaks = {int(k): (str(why), int(ep)) for k, why, ep in conn.execute(
                "SELECT stripe, reason, epoch FROM hd_outbox_breaks WHERE repository = ? AND "
                "incarnation = ?", (repository, inc)).fetchall()}
        if row is None:
            return None
        stripes = int(row[0])
        return Counters(inc, stripes, tuple(int(found.get(k, 0)) for k in range(stripes)),
                        tuple(breaks[k][0] if k in breaks else None for k in range(stripes)),
                        tuple(breaks[k][1] if k in breaks else 0 for k in range(stripes)))

    def record_break(self, repository: str, stripe: int, incarnation: str, reason: str,
                     epoch: int = 0) -> bool:
        """Keep, durably, that the tracker read the domain as broken (its ``broken`` control
        message), so that every later watermark of the domain says so: a tracker's Redis that
        went back to before the break breaks it again instead of certifying it. Only for a
        repository this outbox holds, a stripe it declared and the **current** incarnation (a
        break of an older one is moot: the new incarnation breaks the domain anyway).
        Idempotent: the first reason of an epoch stays; a break of a later epoch (the tracker
        rebuilt the stripe since) replaces it. True when the domain is (now) recorded broken."""
        conn = self._conn()
        with self._write(conn):
            if incarnation != self._incarnation(conn):
                return False
            row = conn.execute("SELECT stripes FROM hd_outbox_domains WHERE repository = ?",
                               (repository,)).fetchone()
            if row is None or not 0 <= stripe < int(row[0]):
                return False
            conn.execute(
                "INSERT INTO hd_outbox_breaks VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT "
                "(repository, stripe, incarnation) DO UPDATE SET reason = excluded.reason, "
                "recorded_at = excluded.recorded_at, epoch = excluded.epoch "
                "WHERE excluded.epoch > hd_outbox_breaks.epoch",
                (repository, stripe, incarnation, reason, self.clock(), epoch))
        return True

    def breaks(self, repository: str) -> dict[tuple[int, str], str]:
        """The breaks recorded for the repository: (stripe, incarnation) -> reason."""
        conn = self._conn()
        with self._read(conn):
            rows = conn.execute("SELECT stripe, incarnation, reason FROM hd_outbox_breaks "
                                "WHERE repository = ?", (repository,)).fetchall()
        return {(int(k), str(inc)): str(reason) for k, inc, reason in rows}

    def unpublished(self, limit: int = 1000) -> list[Row]:
        """The oldest rows not yet acknowledged by the broker, in commit order."""
        conn = self._conn()
        with self._read(conn):
            rows = conn.execute(
                "SELECT id, repository, stripe, seq, incarnation, value FROM hd_outbox "
                "WHERE published = 0 ORDER BY id LIMIT ?", (limit,)).fetchall()
        return [Row(*r) for r in rows]

    def mark_published(self, ids: Sequence[int]) -> None:
        conn = self._conn()
        with self._write(conn):
            conn.executemany("UPDATE hd_outbox SET published = 1 WHERE id = ?",
                             [(i,) for i in ids])

    def rows(self, repository: str, stripe: int, incarnation: str, from_seq: int, to_seq: int,
             limit: int = 10_000) -> list[Row]:
        """The rows of the domain's range that the outbox still holds, by seq."""
        conn = self._conn()
        with self._read(conn):
            rows = conn.execute(
                "SELECT id, repository, stripe, seq, incarnation, value FROM hd_outbox WHERE "
                "repository = ? AND stripe = ? AND incarnation = ? AND seq BETWEEN ? AND ? "
                "ORDER BY seq LIMIT ?",
                (repository, stripe, incarnation, from_seq, to_seq, limit)).fetchall()
        return [Row(*r) for r in rows]

    def close(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()
        self._local = threading.local()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            # Autocommit mode: transactions are the explicit BEGIN ... COMMIT below.
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    @staticmethod
    @contextlib.contextmanager
    def _write(conn: sqlite3.Connection) -> Iterator[None]:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        try:
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    @staticmethod
    @contextlib.contextmanager
    def _read(conn: sqlite3.Connection) -> Iterator[None]:
        conn.execute("BEGIN")  # one snapshot for every SELECT inside
        try:
            yield
        finally:
            conn.execute("COMMIT")

    @staticmethod
    def _incarnation(conn: sqlite3.Connection) -> str:
        row = conn.execute("SELECT value FROM hd_outbox_meta WHERE key = 'incarnation'"
                           ).fetchone()
        if row is None:  # pragma: no cover - written when the outbox is created
            raise OutboxError("the outbox has no incarnation")
        return str(row[0])


def _new_incarnation() -> str:
    return uuid.uuid4().hex
