"""A write lost with the broker log, committed by a commit the mirror DID apply (from the new log,
before the rebuild's prepare): the rebuild marks committed only the manifests of commits the
snapshot did not know, so the committed object is left with no live reference and is reapable.

Found by the soak as dead-letter operator (seed 103, branch dlq): object
``.../data/9999501212/6e8a8fdc...`` of ``r0`` was kept after the rebuild only by an unrelated
dead letter's prefix hold; the soak's ``dlq resolve`` lifted it and the reaper deleted the object
while commit 4924f5 (tag t7684) still listed it. Sequence seen in the soak:

1. ``address_issued`` + ``object_written`` X into main's token T (published, acked);
2. the broker's log is lost before the tracker applied them;
3. ``commit_created`` sealing T (published to the new log) is applied: T is ``committed`` but
   the mirror holds no reference of X in T, so X is not flagged committed;
4. X is copied to another path and that copy is overwritten (applied): X's only known reference
   ended, X is unreferenced;
5. the tracker fails the repository closed; prepare (the commit is known to the snapshot),
   export, rebuild: the manifest of the known commit is not marked; the export lists no staged
   reference of X (T is committed at the service).

Expected: X, in the head commit of main, is never reapable online. Today it is.
"""

from __future__ import annotations

import pytest

from hardelete.model import Model as M
from tests.test_rebuild import MAX_AGE, call, export, lose_log, reapable, state_of
from tests.test_rebuild import w as w  # the fixture
from tests.test_reconcile import BUCKET, World
from tracker.rebuild import prepare, rebuild

pytestmark = [pytest.mark.integration]


def test_a_write_lost_with_the_log_into_a_commit_the_mirror_saw_stays_protected(
        w: World) -> None:
    call(w, M.create_repository, "r", f"s3://{BUCKET}/rebuild-known/r/")
    call(w, M.write, "r", "main", "a", 10)
    w.track(None)

    x = call(w, M.write, "r", "main", "x", 10).address  # issued + written: both lost
    w.applied = len(w.model.events)  # lost with the broker's log: never applied
    commit = call(w, M.commit, "r", "main").commit.id  # published to the new log
    call(w, M.copy, "r", "main", "x", "main", "y")  # y shares x's address
    call(w, M.overwrite, "r", "main", "y", 10)  # ... and is overwritten: x's copy ends
    w.track(None)  # applied from the new log before the tracker noticed the loss
    lose_log(w, "r")

    assert w.model.repository("r").branches["main"].head == commit
    assert x not in w.model.truth(issued_ttl_respected=False).online_garbage
    assert state_of(w, "r", x) == "unreferenced"  # the mirror's view before the rebuild

    p = prepare(w.r, w.s3, "r")
    location = export(w, "r", p.nonce)
    rebuild(w.r, w.s3, "r", location, max_age_ms=MAX_AGE, by="test")

    # x is in the head commit of main: never reapable online (committed)
    assert not reapable(w, "r", x), f"x reapable, mirror state {state_of(w, 'r', x)}"
    assert state_of(w, "r", x) == "committed"


def test_control_the_same_write_replayed_late_as_dlq_replay_does_is_committed(
        w: World) -> None:
    """Control (passes): the dead-letter path. The write is not applied when published
    (dead-lettered), the commit and the copy's end are; `dlq replay` publishes it again and the
    tracker applies it after its successors: the reference lands in a committed token, so x is
    committed. Replay order does not matter here; the rebuild path above has no replay."""
    call(w, M.create_repository, "r", f"s3://{BUCKET}/replay-late/r/")
    call(w, M.write, "r", "main", "a", 10)
    w.track(None)
    start = len(w.model.events)
    x = call(w, M.write, "r", "main", "x", 10).address
    lost = w.model.events[start:]
    w.applied = len(w.model.events)  # dead-lettered: not applied
    call(w, M.commit, "r", "main")
    call(w, M.copy, "r", "main", "x", "main", "y")
    call(w, M.overwrite, "r", "main", "y", 10)
    w.track(None)
    assert reapable(w, "r", x)  # only the dead letter's hold keeps it now
    w.model.events.extend(lost)  # the replay, after its successors
    w.track(None)
    assert state_of(w, "r", x) == "committed"
    assert not reapable(w, "r", x)
