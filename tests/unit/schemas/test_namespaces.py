"""Namespace ownership and the repository lifecycle (SPEC safety 8): the pure rules, the
registry script, and end to end on the real stack (Kafka, Redis, MinIO) with the reaper.

A repository whose namespace equals, contains or lies inside a live repository's is refused
(dead letter with the reason, and an incident); ``repository_deleted`` retires a repository:
its queue and claims go, later events of it are refused, its id is never reused, and only
then is its namespace free for a new repository."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import events as ev
from schemas.namespaces import conflict_of, overlaps, standing_conflict
from sim.model import ManualClock, Model, ModelError, seeded_ids
from sim.operations import created, deleted, written
from tracker.references import World

NOW = 1_000_000


# --- the pure rules -----------------------------------------------------------------------------

@pytest.mark.parametrize(("other", "how"), [("s3://b/R/", "equals"), ("s3://b/", "contains"),
                                            ("s3://b/R/x/", "lies inside")])
def test_an_overlapping_namespace_is_refused_with_an_incident(other, how):
    w = World()
    assert w.apply(created("R", "s3://b/R/"), NOW).rejected is None
    out = w.apply(created("P", other, event_id="p1"), NOW)
    assert out.rejected is not None and how in out.rejected and "'R'" in out.rejected
    assert "P" not in w.repos and w.namespaces == {"s3://b/R/": "R"}
    assert [(i.repository, i.event_id) for i in w.refused] == [("P", "p1")]
    # P's later events are refused as unknown: nothing of it is tracked
    assert w.apply(written("P", "s3://b/R/data/x", token="t", ref="r1"), NOW).rejected \
        == "unknown repository 'P'"
    # neighbours that share only a string prefix are not nested
    assert w.apply(created("Q", "s3://b/Rx/"), NOW).rejected is None


def test_a_namespace_is_free_only_once_its_retired_repositorys_data_is_purged():
    w = World()
    w.apply(created("R", "s3://b/R/"), NOW)
    w.apply(written("R", "s3://b/R/data/a", token="t", ref="r1"), NOW)
    w.apply(deleted("R", "s3://b/R/data/a", token="t", ref="r1"), NOW)
    assert w.repos["R"].unreferenced  # queued for the reaper
    bad = ev.RepositoryDeleted(repository="R", storage_namespace="s3://b/other/")
    assert "not 's3://b/other/'" in (w.apply(bad, NOW).rejected or "")
    retire = ev.RepositoryDeleted(repository="R", storage_namespace="s3://b/R/")
    assert w.apply(retire, NOW + 1).rejected is None
    st = w.repos["R"]
    assert st.retired_at == NOW + 1 and st.unreferenced == {}
    # retired, its data is kept: the namespace stays taken (issue 19: retirement must not hand
    # the retired repository's committed objects to the next owner as leaks)
    assert "namespace overlap" in (w.apply(created("S", "s3://b/R/"), NOW).rejected or "")
    w.settle()
    assert "namespace overlap" in (w.apply(created("S", "s3://b/R/"), NOW).rejected or "")
    assert w.apply(retire, NOW + 2).rejected is None  # a duplicate changes nothing
    assert st.retired_at == NOW + 1
    assert w.apply(written("R", "s3://b/R/data/b", token="t", ref="r2"), NOW).rejected \
        == "repository 'R' is retired"
    assert "never used again" in (w.apply(created("R", "s3://b/R/"), NOW).rejected or "")
    w.release("R")  # its data purged (reconciler/retirement.py): the namespace is free
    assert w.apply(created("S", "s3://b/R/"), NOW).rejected is None
    assert w.namespaces == {"s3://b/R/": "S"}
    assert w.apply(ev.RepositoryDeleted(repository="X", storage_namespace="s3://b/X/"),
                   NOW).rejected == "unknown repository 'X'"


def test_the_model_service_retires_repositories_and_never_reuses_an_id():
    m = Model(clock=ManualClock(step=0.01), new_id=seeded_ids(1))
    events = list(m.create_repository("R", "s3://b/R/"))
    with pytest.raises(ModelError, match="overlaps"):
        m.create_repository("P", "s3://b/")
    events += m.write("R", "main", "a", 1)
    events += m.delete_repository("R")
    assert events[-1] == ev.RepositoryDeleted(repository="R", storage_namespace="s3://b/R/",
                                              event_id=events[-1].event_id,
                                              emitted_at=events[-1].emitted_at)
    with pytest.raises(ModelError, match="never reused"):
        m.create_repository("R", "s3://b/R/")
    w = World()
    for e in events:
        assert w.apply(e, NOW).rejected is None
    w.settle()
    w.release("R")  # once the retired repository's data is purged
    again = m.create_repository("S", "s3://b/R/")
    assert all(w.apply(e, NOW).rejected is None for e in again)
    assert w.namespaces == {"s3://b/R/": "S"}


@pytest.mark.parametrize("ns", ["s3://b//x/", "s3://b/./", "s3:///x/", "s3://b/x//"])
def test_a_namespace_must_be_canonical(ns):
    out = World().apply(created("R", ns), NOW)
    assert out.rejected is not None






# --- end to end ----------------------------------------------------------------------------------























def test_status_prints_refusals_and_retired_repositories(capsys):
    from hardelete.status import Status, _print_status

    _print_status(Status(now_ms=0, horizon_ms=None, progress_lag_s={}, repositories=[],
                         global_incidents=[{"repository": "P", "reason": "namespace overlap"}],
                         global_incidents_total=1,
                         retired={"R1": {"namespace": "s3://b/R1/", "at_ms": 1}}))
    out = capsys.readouterr().out
    assert "1 incident(s) outside any live repository" in out
    assert "P: namespace overlap" in out and "R1 (s3://b/R1/, kept until" in out


# --- registry conflicts (issue 34 item 4) ------------------------------------------------------

def test_a_conflict_names_every_repository_whose_namespace_overlaps() -> None:
    registry = {"s3://b/x/": "X", "s3://b/x/y/z/": "Z", "s3://b/w/": "W"}
    c = conflict_of("Y", "s3://b/x/y/", registry)
    assert c is not None and c.repositories == ["X", "Y", "Z"]
    assert dict(c.members) == {"X": "s3://b/x/", "Y": "s3://b/x/y/", "Z": "s3://b/x/y/z/"}
    assert all(f"'{r}'" in c.reason() for r in "XYZ")
    assert conflict_of("Y", "s3://b/v/", registry) is None
    assert conflict_of("W", "s3://b/w/", registry) is None  # its own entry
    assert conflict_of("Y", "not a namespace", registry) is None
    assert conflict_of("E", "S3://B/w/", registry) is not None  # compared canonically


def test_a_conflict_stands_while_another_holder_overlaps() -> None:
    holders = [("A", "s3://b/A/"), ("B", "s3://b/A/B/"), ("C", "s3://b/C/")]
    for repo in ("A", "B"):
        c = standing_conflict(repo, holders)
        assert c is not None and c.repositories == ["A", "B"]
    assert standing_conflict("C", holders) is None
    assert standing_conflict("P", holders) is None  # holds nothing (refused, retired, unknown)
    assert standing_conflict("A", [h for h in holders if h[0] != "B"]) is None  # B retired


@given(spaces=st.lists(st.sampled_from(["s3://b/", "s3://b/x/", "s3://b/x/y/", "s3://b/w/",
                                        "s3://c/"]), min_size=1, max_size=5))
def test_standing_conflict_is_exactly_an_overlap_with_another_holder(spaces: list[str]) -> None:
    holders = [(f"r{i}", ns) for i, ns in enumerate(spaces)]
    for repo, ns in holders:
        others = [o for o, n in holders if o != repo and overlaps(ns, n)]
        c = standing_conflict(repo, holders)
        assert (c is None) == (not others)
        if c is not None:
            assert set(c.repositories) == {repo, *others}
