"""The reference outbox on SQLite (pure: a database file, no server): seqs gapless per domain
under concurrent writers, a rolled-back transaction allocates nothing, a restore gets a new
incarnation, rows stay until published and trimmed or expired."""

from __future__ import annotations

import contextlib
import itertools
import random
import shutil
import sqlite3
import threading
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import control
from schemas import events as ev
from schemas.outbox import Outbox, OutboxError

NS = "s3://b/r/"
FAST = {"synchronous": "OFF"}  # (durability is the disk's business, not these tests')


def tag(repo: str = "r", i: int = 0) -> ev.TagCreated:
    return ev.TagCreated(repository=repo, tag=f"v{i}", commit_id="c", ref_version=i + 1)


def created(repo: str = "r", stripes: int = 1) -> ev.RepositoryCreated:
    return ev.RepositoryCreated(repository=repo, storage_namespace=NS, default_branch="main",
                                default_retention_days=7, stripes=stripes)


def seqs(outbox: Outbox) -> dict[tuple[str, int], list[int]]:
    out: dict[tuple[str, int], list[int]] = defaultdict(list)
    for row in outbox.unpublished(limit=1_000_000):
        out[(row.repository, row.stripe)].append(row.seq)
    return {k: sorted(v) for k, v in out.items()}


@pytest.fixture
def outbox(tmp_path: Path) -> Outbox:
    box = Outbox(tmp_path / "service.db", **FAST)
    yield box
    box.close()


def test_emit_numbers_each_domain_and_keeps_the_event_as_published(outbox: Outbox) -> None:
    with outbox.transaction() as tx:
        first = tx.emit(created("r", stripes=2))
        a = tx.emit(tag("r", 1), stripe=1)
        b = tx.emit(tag("r", 2), stripe=1)
        c = tx.emit(tag("q", 1))
    assert (first.seq, first.stripe, a.seq, b.seq, c.seq) == (1, 0, 1, 2, 1)
    assert {e.incarnation for e in (first, a, b, c)} == {outbox.incarnation}
    rows = outbox.unpublished()
    assert [ev.decode(r.value) for r in rows] == [first, a, b, c]  # the bytes are the event
    counters = outbox.counters("r")
    assert counters is not None and counters.seqs == (1, 2) and counters.stripes == 2
    assert outbox.counters("unknown") is None


def test_a_rolled_back_transaction_allocates_nothing(outbox: Outbox) -> None:
    with outbox.transaction() as tx:
        tx.execute("CREATE TABLE entries (path TEXT PRIMARY KEY)")
        tx.emit(tag("r", 0))
    with pytest.raises(RuntimeError), outbox.transaction() as tx:
        tx.execute("INSERT INTO entries VALUES ('p')")
        tx.emit(tag("r", 1))
        raise RuntimeError("the service's change failed")
    with outbox.transaction() as tx:
        after = tx.emit(tag("r", 2))
        assert tx.execute("SELECT count(*) FROM entries").fetchone() == (0,)
    assert after.seq == 2  # no hole where the rolled-back one was
    assert seqs(outbox) == {("r", 0): [1, 2]}


def test_seqs_are_gapless_under_concurrent_writers(tmp_path: Path) -> None:
    path = tmp_path / "service.db"
    with Outbox(path, **FAST) as box, box.transaction() as tx:
        tx.emit(created("r", stripes=4))
    committed: dict[tuple[str, int], int] = defaultdict(int)
    lock = threading.Lock()
    barrier = threading.Barrier(6)

    def writer(i: int) -> None:
        rng = random.Random(i)
        with Outbox(path, **FAST) as box:  # one outbox per writer, as separate processes have
            barrier.wait()
            for n in range(40):
                repo, stripe = rng.choice([("r", 0), ("r", 1), ("r", 3), ("q", 0)])
                try:
                    with box.transaction() as tx:
                        tx.emit(tag(repo, n), stripe=stripe)
                        if rng.random() < 0.25:
                            raise ValueError("rolled back")
                except ValueError:
                    continue
                with lock:
                    committed[(repo, stripe)] += 1

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    committed[("r", 0)] += 1  # the repository_created
    with Outbox(path, **FAST) as box:
        assert seqs(box) == {k: list(range(1, n + 1)) for k, n in committed.items()}
        counters = box.counters("r")
        assert counters is not None
        assert counters.seqs == tuple(committed[("r", k)] for k in range(4))


@given(steps=st.lists(st.tuples(st.sampled_from([("r", 0), ("r", 1), ("q", 0)]),
                                st.booleans()), max_size=30))
@settings(max_examples=40, deadline=None)
def test_any_mix_of_commits_and_rollbacks_is_gapless(tmp_path_factory: pytest.TempPathFactory,
                                                     steps: list[tuple[tuple[str, int], bool]]
                                                     ) -> None:
    with Outbox(tmp_path_factory.mktemp("ob") / "s.db", **FAST) as box:
        with box.transaction() as tx:
            tx.emit(created("r", stripes=2))
        expected = {("r", 0): 1}
        for (repo, stripe), commit in steps:
            with pytest.raises(KeyError) if not commit else contextlib.nullcontext(), \
                    box.transaction() as tx:
                tx.emit(tag(repo), stripe=stripe)
                if not commit:
                    raise KeyError("rollback")
            if commit:
                expected[(repo, stripe)] = expected.get((repo, stripe), 0) + 1
        assert seqs(box) == {k: list(range(1, n + 1)) for k, n in expected.items()}


def test_a_restored_store_gets_a_new_incarnation(tmp_path: Path) -> None:
    path, copy = tmp_path / "service.db", tmp_path / "copy.db"
    with Outbox(path, **FAST) as box:
        with box.transaction() as tx:
            tx.emit(tag("r", 1))
        before = box.incarnation
        box.close()
        shutil.copy(path, copy)  # the backup (the outbox is closed: the WAL is checkpointed)
        with box.transaction() as tx:
            lost = tx.emit(tag("r", 2))
    shutil.copy(copy, path)  # the store restored from the backup
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    with Outbox(path, **FAST) as box:
        assert box.incarnation == before  # the copy's: reusing seq 2 would pass for `lost`
        new = box.restored()
        assert new != before and box.incarnation == new
        with box.transaction() as tx:
            reused = tx.emit(tag("r", 3))
    assert reused.seq == lost.seq == 2 and reused.incarnation == new != lost.incarnation


def test_rows_stay_until_published_and_trimmed_or_expired(tmp_path: Path) -> None:
    now = [1000.0]
    with Outbox(tmp_path / "s.db", retention_seconds=60, clock=lambda: now[0], **FAST) as box:
        with box.transaction() as tx:
            for i in range(5):
                tx.emit(tag("r", i))
        first = box.unpublished(limit=3)
        box.mark_published([r.id for r in first])
        assert box.trim("r", 0, 5) == 3  # seq 4 and 5 are not published: kept
        assert [r.seq for r in box.unpublished()] == [4, 5]
        assert box.rows("r", 0, box.incarnation, 1, 5) == box.unpublished()
        now[0] += 61
        assert box.expire() == 0  # never published: never dropped
        box.mark_published([r.id for r in box.unpublished()])
        assert box.expire(now=now[0] - 1) == 0 and box.expire() == 2
        assert box.rows("r", 0, box.incarnation, 1, 5) == []
        assert box.counters("r").seqs == (5,)  # type: ignore[union-attr]


def test_the_outbox_refuses_what_would_break_its_domains(outbox: Outbox) -> None:
    with outbox.transaction() as tx:
        tx.emit(created("r", stripes=2))
        done = tx.emit(tag("r"))
    cases = [
        (lambda tx: tx.emit(tag("r"), stripe=2), "stripes 0..1"),
        (lambda tx: tx.emit(tag("q"), stripe=1), "stripes 0..0"),  # undeclared: one stripe
        (lambda tx: tx.emit(created("r", stripes=3)), "cannot change"),
        (lambda tx: tx.emit(done), "emitted twice"),
        (lambda tx: tx.emit(ev.AddressesReaped(repository="r", addresses=[NS + "x"],
                                               reaper="x")), "not a service event"),
        (lambda tx: tx.declare("z", 65), "stripes must be"),
    ]
    for action, why in cases:
        with pytest.raises(OutboxError, match=why), outbox.transaction() as tx:
            action(tx)
    with pytest.raises(OutboxError, match="open on this thread"), \
            outbox.transaction(), outbox.transaction():
        pass
    with pytest.raises(OutboxError, match="database file"):
        Outbox(":memory:")
    assert seqs(outbox) == {("r", 0): [1, 2]}


def test_the_services_tables_share_the_transaction(outbox: Outbox, tmp_path: Path) -> None:
    with outbox.transaction() as tx:
        tx.execute("CREATE TABLE entries (path TEXT PRIMARY KEY, address TEXT)")
        tx.execute("INSERT INTO entries VALUES (?, ?)", ("p", NS + "x"))
        tx.emit(tag("r"))
    other = sqlite3.connect(tmp_path / "service.db")
    assert other.execute("SELECT count(*) FROM entries").fetchone() == (1,)
    assert other.execute("SELECT count(*) FROM hd_outbox").fetchone() == (1,)
    other.close()


@given(lo=st.integers(1, 30), span=st.integers(0, 30), held=st.sets(st.integers(0, 70)))
@settings(max_examples=200, deadline=None)
def test_gone_ranges_are_exactly_what_is_not_held(lo: int, span: int, held: set[int]) -> None:
    from schemas.relay import gone_ranges

    hi = lo + span
    out = gone_ranges(lo, hi, held)
    covered = [s for a, b in out for s in range(a, b + 1)]
    assert covered == [s for s in range(lo, hi + 1) if s not in held]  # in order, no overlap
    assert all(b + 1 < c for (_, b), (c, _) in itertools.pairwise(out))  # maximal


def test_a_break_is_kept_once_for_the_current_incarnation_of_a_held_domain(
        outbox: Outbox) -> None:
    with outbox.transaction() as tx:
        tx.emit(created("r", stripes=2))
        tx.emit(tag("r", 1), stripe=1)
    inc = outbox.incarnation
    c = outbox.counters("r")
    assert c is not None and c.broken == (None, None)
    assert outbox.record_break("r", 1, inc, "an event without a seq")
    assert outbox.record_break("r", 1, inc, "another reason")  # idempotent: the first stays
    assert outbox.breaks("r") == {(1, inc): "an event without a seq"}
    c = outbox.counters("r")
    assert c is not None and c.broken == (None, "an event without a seq") and c.seqs == (1, 1)
    # not this outbox's repository, a stripe not declared, another incarnation: nothing kept
    assert not outbox.record_break("elsewhere", 0, inc, "x")
    assert not outbox.record_break("r", 2, inc, "x")
    assert not outbox.record_break("r", 0, "old", "x")
    assert outbox.breaks("r") == {(1, inc): "an event without a seq"}
    assert outbox.breaks("elsewhere") == {}


def test_a_break_outlives_the_process_and_a_restore_leaves_it_behind(tmp_path: Path) -> None:
    path = tmp_path / "service.db"
    with Outbox(path, **FAST) as box:
        with box.transaction() as tx:
            tx.emit(tag("r", 1))
        inc = box.incarnation
        assert box.record_break("r", 0, inc, "gone")
    with Outbox(path, **FAST) as box:  # (a relay restarted)
        c = box.counters("r")
        assert c is not None and c.broken == ("gone",)
        new = box.restored()
        c = box.counters("r")
        assert c is not None and c.broken == (None,)  # the new incarnation breaks it anyway
        assert box.breaks("r") == {(0, inc): "gone"}
        assert box.record_break("r", 0, new, "again")
        c = box.counters("r")
        assert c is not None and c.broken == ("again",)


def test_every_watermark_of_a_broken_stripe_carries_its_break() -> None:
    from schemas import control
    from schemas.outbox import Counters
    from schemas.relay import watermarks

    tick = control.Tick(repository="r", tick_ms=50, applied=[4, 0, 6], tick_id="t", sig="s")
    marks = watermarks(tick, Counters("i", 3, (4, 0, 7), (None, "lost", None)), 1.0)
    assert [(w.stripe, w.seq, w.broken) for w in marks] == [(0, 4, None), (1, 0, "lost"),
                                                            (2, 7, None)]
    assert all((w.repository, w.incarnation, w.tick_ms, w.tick_applied, w.tick_id, w.tick_sig)
               == ("r", "i", 50, [4, 0, 6], "t", "s") for w in marks)
    assert [w.broken for w in watermarks(tick, Counters("i", 2, (1, 1)), 1.0)] == [None, None]


def test_a_break_of_a_later_rebuild_epoch_replaces_the_one_kept() -> None:
    import tempfile

    from schemas.relay import watermarks

    with tempfile.TemporaryDirectory() as d, Outbox(Path(d) / "s.db", **FAST) as box:
        with box.transaction() as tx:
            tx.emit(created("r"))
        inc = box.incarnation
        assert box.record_break("r", 0, inc, "first", 0)
        assert box.record_break("r", 0, inc, "after the rebuild", 1)
        assert box.record_break("r", 0, inc, "an older report, late", 0)
        c = box.counters("r")
        assert c is not None and c.broken == ("after the rebuild",) and c.broken_epochs == (1,)
        tick = control.Tick(repository="r", tick_ms=5, applied=[0], tick_id="t", sig="s")
        (w,) = watermarks(tick, c, 1.0)
        assert (w.broken, w.broken_epoch) == ("after the rebuild", 1)
